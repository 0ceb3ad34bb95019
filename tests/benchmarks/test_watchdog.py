"""`python -m benchmarks.watchdog`, shrunk: its table comes out, consistent with itself."""

from __future__ import annotations

import pytest

from tests.helpers.recipes import run_benchmark


@pytest.mark.slow
def test_watchdog_benchmark_prints_on_against_off(tmp_path):
    output = run_benchmark(
        "watchdog", "rounds=1", "steps=1", "warmup=1", "models=[many_small]", f"hydra.run.dir={tmp_path}"
    )
    row = next(line for line in output.splitlines() if line.startswith("| many_small |"))
    off, on, off_again, ratio, noise = (float(cell) for cell in row.strip("|").split("|")[1:])
    assert ratio == pytest.approx(on / ((off + off_again) / 2), abs=2e-3)
    assert noise == pytest.approx(off / off_again, abs=2e-3)
