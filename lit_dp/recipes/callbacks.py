"""Callbacks the recipes share: a start-up summary line and a throughput meter."""

from __future__ import annotations

import time

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy, Strategy

from lit_dp.strategy import PaddleDPStrategy


def describe_strategy(strategy: Strategy, world_size: int) -> str:
    """One line with the strategy, backend, world size, devices and bucket sizes in effect."""
    if isinstance(strategy, PaddleDPStrategy):
        return strategy.describe()
    devices = [str(d) for d in getattr(strategy, "parallel_devices", None) or [strategy.root_device]]
    line = f"strategy={type(strategy).__name__} world_size={world_size} devices={devices}"
    if isinstance(strategy, DDPStrategy):
        cap = strategy._ddp_kwargs.get("bucket_cap_mb", 25)
        line += f" backend={strategy.process_group_backend} bucket_cap_mb={cap}MB"
    return line


class RunSummary(pl.Callback):
    """Prints, on rank 0 once the processes are up, the parallel settings actually in effect."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.is_global_zero:
            print(f"[lit_dp] {describe_strategy(trainer.strategy, trainer.world_size)}", flush=True)


class StepThroughput(pl.Callback):
    """Logs ``samples_per_sec`` (all ranks together) over the steps so far, after ``warmup`` steps.

    Validation and epoch boundaries are excluded: only training steps are timed.
    """

    def __init__(self, warmup: int = 5) -> None:
        self.warmup = warmup
        self._started: float | None = None
        self._samples = 0
        self._seconds = 0.0
        self._steps = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._samples, self._seconds, self._steps = 0, 0.0, 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._steps += 1
        if self._steps > self.warmup and self._started is not None:
            self._seconds += time.perf_counter() - self._started
            self._samples += len(batch[0]) * trainer.world_size

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._seconds > 0:
            pl_module.log("samples_per_sec", self._samples / self._seconds, rank_zero_only=True)
