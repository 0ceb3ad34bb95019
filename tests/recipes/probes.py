"""Callbacks the recipe tests add on a recipe's command line (``+callbacks.probe._target_=...``)."""

from __future__ import annotations

import lightning.pytorch as pl

from lit_dp.data_parallel import DataParallel
from lit_dp.gradients.events import ReducerObserver


class _CountSteps(ReducerObserver):
    def __init__(self) -> None:
        self.steps = 0

    def step_started(self, step: int) -> None:
        self.steps += 1


class SynchronisedSteps(pl.Callback):
    """Prints, per rank, how many backward passes the reducer synchronised and how many micro-batches ran."""

    def __init__(self) -> None:
        self.observer = _CountSteps()
        self.batches = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        model = trainer.strategy.model
        assert isinstance(model, DataParallel) and model.reducer is not None, type(model)
        model.reducer.add_observer(self.observer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.batches += 1

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        print(
            f"[probe] rank={trainer.global_rank} synchronised={self.observer.steps} micro_batches={self.batches} "
            f"optimizer_steps={trainer.global_step}",
            flush=True,
        )
