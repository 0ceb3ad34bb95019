"""The Chrome trace: written by 2 real ranks, merged and rendered by the command line; a timeline's events."""

from __future__ import annotations

import json

import pytest

from lit_dp.observability.stats import BucketSpan, StepTimeline
from lit_dp.observability.trace import TraceWriter
from lit_dp.observability.trace import main as trace_main
from lit_dp_recipes.trace_render import main as render_main
from tests.helpers.observability import TRACED


def test_trace_of_two_ranks_merges_and_renders(two_ranks, tmp_path):
    results, trace_dir = two_ranks
    # The trace: valid trace-event JSON, one complete event per bucket per traced step.
    for rank, result in results.items():
        events = json.loads((trace_dir / f"rank{rank}.json").read_text())["traceEvents"]
        spans = [e for e in events if e["ph"] == "X" and e["cat"] == "bucket"]
        assert len(spans) == result["buckets"] * (TRACED[1] - TRACED[0])
        assert sorted({e["args"]["step"] for e in spans}) == list(range(*TRACED))
        for e in spans:
            assert {"name", "ts", "dur", "pid", "tid"} <= e.keys() and e["pid"] == rank and e["dur"] >= 0
            assert e["args"]["bytes"] > 0 and e["args"]["params"] and isinstance(e["args"]["bucket"], int)
        assert sum(e["name"] == "backward" for e in events) == TRACED[1] - TRACED[0]
        assert sum(e["ph"] == "i" for e in events) == TRACED[1] - TRACED[0]
    trace_main(["merge", str(trace_dir), "-o", str(tmp_path / "merged.json")])
    merged = json.loads((tmp_path / "merged.json").read_text())["traceEvents"]
    assert {e["pid"] for e in merged} == {0, 1}
    render_main([str(tmp_path / "merged.json"), "-o", str(tmp_path / "timeline.png")])
    assert (tmp_path / "timeline.png").stat().st_size > 1000


def test_a_step_becomes_a_marker_backward_one_span_per_bucket_and_the_exposed_tail(tmp_path):
    writer = TraceWriter(tmp_path, rank=1, steps=(2, 3), names=["w", "b", "head"])
    buckets = (BucketSpan(0, 16, (2,), 1.0, 4.0), BucketSpan(1, 32, (0, 1), 3.0, 6.0))
    writer.add(StepTimeline(step=1, start=0.0, backward_start=0.5, backward_end=5.0, reduced=6.0, buckets=buckets))
    assert not (tmp_path / "rank1.json").exists()  # step 1 is not traced
    writer.add(StepTimeline(step=2, start=0.0, backward_start=0.5, backward_end=5.0, reduced=6.0, buckets=buckets))
    events = json.loads((tmp_path / "rank1.json").read_text())["traceEvents"]  # written at the last traced step
    spans = {e["name"]: e for e in events if e["ph"] == "X"}
    assert spans["all_reduce bucket 1"]["args"]["params"] == ["w", "b"]
    assert spans["all_reduce bucket 1"]["tid"] == 2 and spans["all_reduce bucket 0"]["tid"] == 1
    assert spans["exposed communication"]["dur"] == pytest.approx(1e6)  # from backward's end (5 s) to 6 s
    assert spans["backward"]["dur"] == pytest.approx(4.5e6)
    assert [e["name"] for e in events if e["ph"] == "i"] == ["step 2"]
