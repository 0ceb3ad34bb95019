"""`python -m benchmarks.ft_diloco`, shrunk: a tiny GPT, groups of one rank, DiLoCo K=4 over 24 steps. Every
row is reported; the slow group's inner steps take at least its sleep; the fault fires once and its
run is reported against the one without; the runs without faults commit every transaction (a step each with
per-step sync; with DiLoCo the first step's and a sync's) and end equal."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("torchft")

from tests.helpers.recipes import run_benchmark  # noqa: E402

TINY = '["data.max_bytes=30000","data.block_size=32","data.batch_size=4","model.n_layer=1","model.n_embd=32","model.n_head=2","model.warmup_steps=1","callbacks.throughput.warmup=1","trainer.limit_val_batches=4"]'
PACE = re.compile(
    r"^\| (fast group alone|fast and slow) \| (fast|slow) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| (.*) \|$", re.MULTILINE
)
FAULT = re.compile(r"^\| (per-step sync|DiLoCo K=4) \| (no fault|one fault) \| ([\d, ]+) \| ([\d, ]+) \| (\d+)[^|]* \| ([-\d., ]+) \| (\S+) \| (.*) \|$",
                   re.MULTILINE)  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(1500)  # six launches of two CPU processes, about 5 minutes on a loaded 2-core machine
def test_the_benchmark_reports_a_slow_group_and_the_cost_of_one_transient_fault(tmp_path):
    output = run_benchmark(
        "ft_diloco", "ranks=1", "local_steps=4", "max_steps=24", "timing_from=8", "slow_seconds=0.2", "fault_sync=3",
        f"extra={TINY}", f"hydra.run.dir={tmp_path}", timeout=1400,
    )  # fmt: skip
    paces = {(m.group(1), m.group(2)): m.groups()[2:] for m in PACE.finditer(output)}
    assert set(paces) == {("fast group alone", "fast"), ("fast and slow", "fast"), ("fast and slow", "slow")}, output
    for (run, group), (inner, sync, per_step, ended) in paces.items():
        assert ended == "every group ended by itself", output
        assert float(per_step) > 0 and float(sync) > 0, output
    assert float(paces["fast and slow", "slow"][0]) >= 0.2, output  # it sleeps 0.2 s in every step
    assert re.search(r"the fast group's inner steps take [\d.]+ times as long with the slow group as alone", output)
    rows = {(m.group(1), m.group(2)): m.groups()[2:] for m in FAULT.finditer(output)}
    assert set(rows) == {
        (mode, run) for mode in ("per-step sync", "DiLoCo K=4") for run in ("no fault", "one fault")
    }, output
    transactions = {"per-step sync": 24, "DiLoCo K=4": 1 + 24 // 4}  # DiLoCo: the first step's quorum, then a sync's
    for mode in ("per-step sync", "DiLoCo K=4"):
        committed, discarded, failed, losses, equal, ended = rows[mode, "no fault"]
        assert committed == f"{transactions[mode]}, {transactions[mode]}", output
        assert discarded == "0, 0" and failed == "0", output
        assert equal == "yes" and ended == "every group ended by itself", output
        assert int(rows[mode, "one fault"][2]) >= 1, output  # the fault is seen from below the library
        assert re.search(
            rf"^{mode}: one fault cost [-\d]+, [-\d]+ committed transactions \(per group\)", output, re.MULTILINE
        ), output
    assert "fired 0 times" not in output
