"""Faults injected on purpose, to test and measure recovery and diagnosis: ``KillRankOnce``,
``SlowRank``, ``CorruptWeight``.

    torchrun --standalone --nproc-per-node=2 --max-restarts=1 recipes/digits.py \\
        +callbacks.kill._target_=lit_dp_recipes.faults.KillRankOnce +callbacks.kill.step=30
    python recipes/digits.py +callbacks.slow._target_=lit_dp_recipes.faults.SlowRank +callbacks.slow.where=data
"""

from __future__ import annotations

import os
import time

import lightning.pytorch as pl
import torch

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


class SlowRank(pl.Callback):
    """Makes process ``rank`` slower by ``seconds`` per training batch: ``where="data"`` before the
    batch reaches ``training_step``, as a slow loader would; ``where="step"`` inside the step,
    between the loss and the backward, as a slow device would."""

    def __init__(self, rank: int = 1, seconds: float = 0.05, where: str = "data") -> None:
        if where not in ("data", "step"):
            raise ValueError(f"SlowRank(where={where!r}) is invalid: expected 'data' or 'step'.")
        self.rank = rank
        self.seconds = seconds
        self.where = where

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx) -> None:
        if self.where == "data" and trainer.global_rank == self.rank:
            time.sleep(self.seconds)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss) -> None:
        if self.where == "step" and trainer.global_rank == self.rank:
            time.sleep(self.seconds)


class CorruptWeight(pl.Callback):
    """After optimizer step ``step``, flips bit ``bit`` of the first element of ``parameter`` (its
    name in the LightningModule; default: the first parameter) on process ``rank`` only, as a
    memory error would: bit 0 moves the weight by one unit in the last place."""

    def __init__(self, rank: int = 1, step: int = 20, parameter: str | None = None, bit: int = 0) -> None:
        self.rank = rank
        self.step = step
        self.parameter = parameter
        self.bit = bit

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        if trainer.global_rank != self.rank or trainer.global_step != self.step:
            return
        name, weight = next(
            (name, param) for name, param in pl_module.named_parameters() if self.parameter in (None, name)
        )
        with torch.no_grad():
            raw = weight.view(-1)[:1].view(torch.uint8)
            raw[self.bit // 8] ^= 1 << (self.bit % 8)
        print(f"[lit_dp] fault: flipped bit {self.bit} of {name}[0] on rank {self.rank} after step {self.step}", flush=True)
