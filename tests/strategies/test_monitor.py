"""CommStatsMonitor: the comm/* columns in a recipe's CSV log, and the tuned size kept across a resume."""

from __future__ import annotations

import csv
import re
import time

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from lit_dp import PaddleDPStrategy
from lit_dp.strategies.monitor import CommStatsMonitor
from tests.helpers.distributed import run_ranks
from tests.helpers.lightning import Regressor, trainer
from tests.helpers.recipes import QUIET, run_recipe

LATE_S = 0.5  # rank 1's lateness at each log step


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


class LateAtLogSteps(pl.Callback):
    """Rank 1 reaches the end of each log step ``LATE_S`` late (before the monitor, installed after it)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_rank == 1 and trainer.global_step % trainer.log_every_n_steps == 0:
            time.sleep(LATE_S)


def fit_with_a_late_rank(rank: int, root: str) -> list[float]:
    """The seconds rank ``rank``'s monitor took at each step's end."""
    took = []
    logging_step_end = CommStatsMonitor.on_train_batch_end

    def timed(self, *args, **kwargs) -> None:
        began = time.perf_counter()
        logging_step_end(self, *args, **kwargs)
        took.append(time.perf_counter() - began)

    CommStatsMonitor.on_train_batch_end = timed
    data = TensorDataset(torch.randn(64, 6), torch.randn(64, 1))
    run = pl.Trainer(
        accelerator="cpu", devices=2, max_epochs=1, logger=CSVLogger(root, name="late"), log_every_n_steps=2,
        callbacks=[LateAtLogSteps()], enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, strategy=PaddleDPStrategy(comm_stats=True),
    )  # fmt: skip
    run.fit(Regressor(), DataLoader(data, batch_size=4))
    return took


def test_a_log_step_does_not_wait_for_a_late_rank_and_every_log_step_still_gets_the_maximum(tmp_path):
    results = run_ranks(fit_with_a_late_rank, 2, str(tmp_path), timeout=240)
    # Reading the all-gather of comm/exposed_ms_max at once made rank 0 wait LATE_S for rank 1 there.
    assert max(results[0]) < LATE_S / 2, results[0]
    [path] = (tmp_path / "late").glob("version_*/metrics.csv")
    with path.open() as file:
        logged = [row for row in csv.DictReader(file) if row.get("comm/bytes")]
    # 8 steps, logged after steps 2, 4, 6 and 8: the last one's maximum read when training ended.
    assert [int(row["step"]) for row in logged] == [2, 4, 6, 8], logged
    assert all(float(row["comm/exposed_ms_max"]) >= float(row["comm/exposed_ms"]) for row in logged), logged
