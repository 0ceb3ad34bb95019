"""`python -m benchmarks.sharding`, shrunk: its tables come out, consistent with themselves."""

from __future__ import annotations

import pytest

from tests.helpers.recipes import run_benchmark


def rows(output: str, first_cell: str) -> list[list[str]]:
    found = [line for line in output.splitlines() if line.startswith(f"| {first_cell} |")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in found]


@pytest.mark.slow
def test_sharding_benchmark_prints_times_and_ratios(tmp_path):
    # Memory is left out, as in the reducer benchmark's test: each mode would cost a fresh process pair.
    output = run_benchmark(
        "sharding", "rounds=1", "steps=1", "warmup=1", "models=[many_small]", "measure_memory=false",
        f"hydra.run.dir={tmp_path}",
    )  # fmt: skip
    iteration, step = rows(output, "many_small")
    modes = ["lit_dp", "zero", "zero_view", "stage1", "stage1_overlap", "stage2", "stage2_overlap"]
    times = dict(zip(modes, map(float, iteration[2:9])))
    ratios = [float(cell) for cell in iteration[9:]]
    peer = min(times["zero"], times["zero_view"])
    assert ratios == pytest.approx([times[mode] / peer for mode in modes[3:]], abs=2e-3)
    assert all(value > 0 for value in times.values()) and all(float(cell) > 0 for cell in step[1:])
