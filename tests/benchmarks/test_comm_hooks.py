"""benchmarks/comm_hooks.py: gradient compression side by side, bytes counted at the collectives."""

from __future__ import annotations

import pytest

from tests.helpers.recipes import run_benchmark


@pytest.mark.slow
def test_compression_benchmark_counts_bytes(tmp_path):
    output = run_benchmark(
        "comm_hooks", "steps=3", "powersgd_start_iter=2", "tasks=[digits]", "modes=[fp32,powersgd_1]",
        f"hydra.run.dir={tmp_path}",
    )
    table = [line.strip("|").split("|") for line in output.splitlines() if line.startswith("| digits |")]
    rows = {cells[1].strip(): [cell.strip() for cell in cells] for cells in table}
    assert float(rows["fp32"][2]) == pytest.approx(8500.1, abs=0.1)  # 2.18 M fp32 gradients and 8 flags
    assert float(rows["powersgd_1"][3]) < 0.01, rows  # rank-1 factors of the 1024 x 1024 weights
