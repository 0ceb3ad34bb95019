"""Callbacks the recipe tests add on a recipe's command line (``+callbacks.probe._target_=...``)."""

from __future__ import annotations

import warnings
from collections import Counter

import lightning.pytorch as pl
import torch

from lit_dp.data_parallel import DataParallel
from lit_dp.gradients.events import ReducerObserver
from lit_dp.gradients.plan import StepPlan


class _CountSteps(ReducerObserver):
    def __init__(self) -> None:
        self.steps = 0

    def step_started(self, step: int, plan: StepPlan) -> None:
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


class HostSyncs(pl.Callback):
    """Counts host-device synchronisations in the training steps after ``warmup`` that write no logs.

    A step here runs from one ``on_train_batch_start`` to the next, so Lightning's own work after
    the step's callbacks (its metrics, the next batch's fetch and copy to the device) counts.
    Steps on which logs are written (every ``log_every_n_steps``) and the steps before them,
    steps followed by a validation or an epoch's end are left out: those may synchronise. CUDA's sync debug mode
    reports each synchronising call as a warning; ``host_syncs`` is their number, logged at the
    epoch's end, with ``host_sync_steps``, the steps counted; where they were called from (the
    Python line that called into CUDA) is printed at the end of training.
    """

    def __init__(self, warmup: int = 5) -> None:
        self.warmup = warmup
        self.syncs = 0
        self.steps = 0
        self.where: Counter[str] = Counter()
        self._recorder: warnings.catch_warnings | None = None
        self._caught: list = []
        self._clean = False

    def _stop(self) -> None:
        if self._recorder is not None:
            torch.cuda.set_sync_debug_mode("default")
            self._recorder.__exit__(None, None, None)
            self._recorder = None
            if self._clean:
                syncs = [w for w in self._caught if "called a synchronizing CUDA operation" in str(w.message)]
                self.syncs += len(syncs)
                self.where.update(f"{w.filename}:{w.lineno}" for w in syncs)
                self.steps += 1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._stop()
        step = trainer.global_step  # optimizer steps before this one
        # Left out: a step that writes logs, and the step before it, whose window holds the start
        # of the log step (the callbacks whose on_train_batch_start runs before this one's:
        # LearningRateMonitor copies each group's rate to the device there on log steps).
        logs = trainer.log_every_n_steps
        self._clean = step >= self.warmup and (step + 1) % logs != 0 and (step + 2) % logs != 0
        self._recorder = warnings.catch_warnings(record=True)
        self._caught = self._recorder.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._clean = False
        self._stop()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._clean = False
        self._stop()
        pl_module.log_dict({"host_syncs": float(self.syncs), "host_sync_steps": float(self.steps)})

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._clean = False
        self._stop()
        if self.where:
            print(f"[probe] host syncs called from: {dict(self.where.most_common())}", flush=True)
