"""benchmarks/training_sweep.py: a Hydra multirun over strategies and bucket sizes, with its report."""

from __future__ import annotations

import pytest

from tests.helpers.recipes import run_benchmark


@pytest.mark.slow
def test_benchmark_multirun_writes_table_and_plot(tmp_path):
    run_benchmark(
        "training_sweep",
        "-m",
        "strategy=paddle_dp,ddp",
        "strategy.comm_buffer_size=1",
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=8",
        f"hydra.sweep.dir={tmp_path}",
    )
    table = (tmp_path / "throughput.md").read_text()
    assert "| paddle_dp | 1 |" in table and "| ddp | 1 |" in table
    assert (tmp_path / "throughput.png").stat().st_size > 1000
    assert (tmp_path / "exposed.png").stat().st_size > 1000  # paddle_dp's comm_stats, plotted per size
    # Every job writes in its own folder, none in the working directory.
    assert len(list(tmp_path.rglob("lit_dp_profile.rank0.json"))) == 1
