"""CommStatsMonitor: the comm/* columns in a recipe's CSV log, and the tuned size kept across a resume."""

from __future__ import annotations

import csv
import re

import pytest

from lit_dp import PaddleDPStrategy
from tests.helpers.lightning import Regressor, trainer
from tests.helpers.recipes import QUIET, run_recipe


@pytest.mark.slow
def test_recipe_logs_comm_columns_and_a_resumed_run_keeps_the_tuned_size(tmp_path):
    short = [
        "trainer.max_epochs=1", "trainer.limit_train_batches=6", "trainer.limit_val_batches=1", "trainer.log_every_n_steps=2",
    ]  # fmt: skip
    output = run_recipe("digits", *QUIET, *short, "strategy.comm_buffer_size=auto", f"hydra.run.dir={tmp_path / 'run'}")
    assert "[lit_dp] comm_buffer_size=auto chose 1 MB" in output  # the digits MLP: one bucket for every candidate
    assert re.search(r"\[lit_dp\] comm: 0\.100 MB in 1 bucket per step; time [\d.]+ ms, exposed [\d.]+ ms", output)
    [metrics] = (tmp_path / "run").glob("csv/version_*/metrics.csv")
    with metrics.open() as file:
        rows = list(csv.DictReader(file))
    columns = {f"comm/{name}" for name in ("bytes", "buckets", "time_ms", "exposed_ms", "overlap", "exposed_ms_max", "tuned_buffer_mb")}
    assert columns <= rows[0].keys()
    logged = [row for row in rows if row["comm/bytes"]]
    assert len(logged) >= 2 and float(logged[-1]["comm/tuned_buffer_mb"]) == 1  # logged once chosen (step 1)
    assert all(float(row["comm/exposed_ms_max"]) >= float(row["comm/exposed_ms"]) for row in logged)

    resumed = run_recipe(
        "digits", *QUIET, *short[1:], "trainer.max_epochs=2", "strategy.comm_buffer_size=auto",
        f"ckpt_path={tmp_path / 'run' / 'checkpoints' / 'last.ckpt'}", f"hydra.run.dir={tmp_path / 'resumed'}",
    )  # fmt: skip
    assert "comm_buffer_size=auto: 1 MB, tuned before" in resumed
    assert "comm_buffer_size=auto chose" not in resumed


def test_one_rank_logs_no_communication_means(tmp_path, capsys):
    # A group of one rank communicates nothing: its means (0 ms, overlap 1.0) would say nothing true,
    # and would end a sweep's one-device job's final line.
    run = trainer(PaddleDPStrategy(comm_stats=True), tmp_path, devices=1, max_epochs=1, limit_train_batches=4)
    run.fit(Regressor())
    assert not [name for name in run.callback_metrics if name.startswith("comm/")], run.callback_metrics
    assert "[lit_dp] comm:" not in capsys.readouterr().out
