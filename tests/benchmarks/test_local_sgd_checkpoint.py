"""benchmarks/local_sgd_checkpoint.py, shrunk: both modes run, and DiLoCo's checkpoint holds every rank's state."""

from __future__ import annotations

import re

import pytest

from tests.helpers.recipes import run_benchmark


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_checkpoint_benchmark_reports_the_bytes_of_every_ranks_state(tmp_path):
    output = run_benchmark(
        "local_sgd_checkpoint", "width=64", "layers=2", "saves=1", f"hydra.run.dir={tmp_path}", timeout=500
    )
    rows = {m.group(1): float(m.group(2)) for m in re.finditer(r"^\| ([\w =]+?) \| [\d.]+ \| ([\d.]+) \|", output, re.M)}
    assert set(rows) == {"data parallel", "DiLoCo K=4"}, output
    # Data parallelism: the model and AdamW's two moments (3P, rank 0's). DiLoCo on 2 ranks: those of both
    # ranks (6P), the snapshot and the outer momentum (2P): 8/3 of it, less the small entries' overhead.
    assert 2.4 < rows["DiLoCo K=4"] < 2.8, output
