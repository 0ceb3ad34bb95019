"""Faults injected on purpose, to test and measure recovery: ``KillRankOnce``.

    torchrun --standalone --nproc-per-node=2 --max-restarts=1 recipes/digits.py \\
        +callbacks.kill._target_=lit_dp_recipes.faults.KillRankOnce +callbacks.kill.step=30
"""

from __future__ import annotations

import os

import lightning.pytorch as pl

from lit_dp.job.restart import JobAttempt


class KillRankOnce(pl.Callback):
    """Ends process ``rank`` abruptly (``os._exit``: no exception, no cleanup, like a lost node or an
    OOM kill) after training step ``step``, in the job's first attempt only."""

    def __init__(self, rank: int = 1, step: int = 30, exit_code: int = 137) -> None:
        self.rank = rank
        self.step = step
        self.exit_code = exit_code

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step and not JobAttempt.from_environ().is_restart:
            print(f"[lit_dp] fault: rank {self.rank} killed after step {self.step}", flush=True)
            os._exit(self.exit_code)
