"""benchmarks/checkpoints.py, shrunk: every case runs, and the bytes say who holds what.

The model is 2 layers of 128 x 128 (3 x 129 KiB of state with Adam): what is measured here is the layout, not
the speed. Data parallelism writes its state once; DiLoCo between syncs both ranks' models and Adam moments
and the snapshot and outer momentum; a sharded folder's largest file is at most one rank's part.
"""

from __future__ import annotations

import re

import pytest

from tests.helpers.recipes import run_benchmark


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_checkpoint_benchmark_reports_every_case_of_both_formats(tmp_path):
    output = run_benchmark(
        "checkpoints", "devices=[2]", "width=128", "layers=2", "saves=1", "steps=12", "async_every=5",
        f"hydra.run.dir={tmp_path}", timeout=1700,
    )  # fmt: skip
    rows = {
        (m.group(1), m.group(2)): (float(m.group(3)), float(m.group(4)))
        for m in re.finditer(r"^\| 2 \| ([\w (),-]+?) \| (full|sharded) \| [\d.]+ \| [\d.]+ \| [\d.]+ \| ([\d.]+) \| ([\d.]+) \|", output, re.M)
    }
    assert set(rows) == {("torch DDP (Lightning)", "full")} | {
        (mode, kind) for mode in ("data parallel", "ZeRO-2", "DiLoCo between syncs") for kind in ("full", "sharded")
    }, output
    state = rows[("data parallel", "full")][0]
    assert rows[("torch DDP (Lightning)", "full")][0] == pytest.approx(state, rel=0.2), output
    # DiLoCo on 2 ranks between syncs: each rank's model and moments (6P) and the snapshot and momentum (2P), 8/3.
    assert rows[("DiLoCo between syncs", "full")][0] == pytest.approx(8 / 3 * state, rel=0.2), output
    for mode in ("data parallel", "ZeRO-2"):
        written, largest = rows[(mode, "sharded")]
        assert largest < 0.8 * written, f"{mode}: one rank wrote most of the folder: {output}"
