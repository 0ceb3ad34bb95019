"""The hang watchdog under the Trainer: a rank asleep in ``training_step`` is named by the others,
and its stack is in the run's log directory (``<default_root_dir>/lit_dp_hang``)."""

from __future__ import annotations

import time

import pytest

import lit_dp
from lit_dp.observability.watchdog import HANG_DIRECTORY
from tests.helpers.distributed import run_ranks
from tests.helpers.lightning import Regressor, trainer

HANG_TIMEOUT = 2.0


class SleepyRegressor(Regressor):
    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and batch_idx == 2:
            time.sleep(HANG_TIMEOUT + 2)
        return self.step_loss(*batch)  # no step-level sync_dist: the others wait in a bucket


def fit_with_a_sleeping_rank(rank: int, root: str) -> None:
    strategy = lit_dp.PaddleDPStrategy(hang_timeout=HANG_TIMEOUT)
    trainer(strategy, root, max_epochs=1).fit(SleepyRegressor())


@pytest.mark.slow
def test_a_rank_sleeping_in_training_step_is_named_and_its_stack_is_in_the_log_directory(tmp_path):
    failures = run_ranks(fit_with_a_sleeping_rank, 2, str(tmp_path), timeout=90, expect_failure=True)
    message = failures[0]
    assert "rank 1 never launched bucket" in message, message
    assert "outside lit_dp's collectives" in message and "in training_step" in message, message
    assert "in training_step" in (tmp_path / HANG_DIRECTORY / "rank1.txt").read_text()


