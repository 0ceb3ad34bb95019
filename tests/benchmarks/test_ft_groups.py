"""`python -m benchmarks.ft_groups`, shrunk: per-step sync and DiLoCo (K=2) on a tiny GPT, two
replica groups of two ranks against one 4-rank job; every column is reported, the bytes across
groups are 1/N of the one job's (and 1/K of P with DiLoCo), and the groups end on equal models."""

from __future__ import annotations

import math
import re

import pytest

pytest.importorskip("torchft")

from tests.helpers.recipes import run_benchmark  # noqa: E402

TINY = '["data.max_bytes=30000","data.block_size=32","data.batch_size=4","model.n_layer=1","model.n_embd=32","model.n_head=2","model.warmup_steps=1","callbacks.throughput.warmup=1"]'
ROW = re.compile(r"^\| (per-step sync|DiLoCo K=2) \| (one job of 4 ranks|2 groups of 2 ranks \(torchft\)) \|"
                 r" ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]*) \| ([\d.]+) \| (\d+) \|$", re.MULTILINE)  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(1200)  # four runs of 4 CPU processes, about 4 minutes on a loaded 2-core machine
def test_the_benchmark_reports_traffic_step_time_and_loss_of_groups_and_one_job(tmp_path):
    output = run_benchmark(
        "ft_groups", "modes=[per_step,diloco]", "local_steps=2", "max_steps=8", "timing_from=4", f"extra={TINY}",
        f"hydra.run.dir={tmp_path}", timeout=1100,
    )  # fmt: skip
    rows = {(m.group(1), m.group(2).split()[0]): m.groups()[2:] for m in ROW.finditer(output)}
    assert set(rows) == {(mode, job) for mode in ("per-step sync", "DiLoCo K=2") for job in ("one", "2")}, output
    of_p = {key: float(row[1]) for key, row in rows.items()}
    # A flat all-reduce sends all of P (per-step) or P/K (DiLoCo); a group's rank 1/N of that.
    assert of_p["per-step sync", "one"] == pytest.approx(1.0)
    assert of_p["per-step sync", "2"] == pytest.approx(0.5, abs=0.01)
    assert of_p["DiLoCo K=2", "one"] == pytest.approx(0.5, abs=0.01)
    assert of_p["DiLoCo K=2", "2"] == pytest.approx(0.25, abs=0.01)
    for (mode, job), (across, _, step, ratio, loss, wall) in rows.items():
        assert float(step) > 0 and int(wall) > 0 and math.isfinite(float(loss)), (mode, job, output)
        assert (ratio != "") == (job == "2"), output  # the groups' step time against the one job's
    assert "the replica groups' val losses at most 0.0000 apart in any run" in output  # equal final models
    for mode in ("per-step sync", "DiLoCo K=2"):
        assert re.search(rf"^{mode}: the groups send 0\.50\d of the one job's bytes across groups", output, re.MULTILINE), output
