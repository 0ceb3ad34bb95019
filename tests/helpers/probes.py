"""Callbacks the recipe tests add on a recipe's command line (``+callbacks.probe._target_=...``)."""

from __future__ import annotations

import os
import sys
import traceback
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import lit_dp
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
        # One write of the whole line: both ranks print to one pipe, and print() writes its end apart
        # (unbuffered, the two ranks' lines interleaved as "[probe] rank=1 ...[probe] rank=0 ...").
        sys.stdout.write(
            f"[probe] rank={trainer.global_rank} synchronised={self.observer.steps} micro_batches={self.batches} "
            f"optimizer_steps={trainer.global_step}\n"
        )
        sys.stdout.flush()


SYNC_WARNING = "called a synchronizing CUDA operation"
TORCH = str(Path(torch.__file__).parent)
LIT_DP = str(Path(lit_dp.__file__).parent)


def caller_outside_torch(stack: list[traceback.FrameSummary]) -> str:
    """Where a synchronisation comes from: the innermost frame of the stack (innermost last)
    outside torch, the warnings module and this probe, as ``file:line``."""
    for frame in reversed(stack):
        if not frame.filename.startswith(TORCH) and frame.filename not in (warnings.__file__, __file__):
            return f"{frame.filename}:{frame.lineno}"
    return "torch"


class HostSyncs(pl.Callback):
    """Counts host-device synchronisations in the training steps after ``warmup``.

    A step here runs from one ``on_train_batch_start`` to the next, so Lightning's own work after
    the step's callbacks (its metrics, the next batch's fetch and copy to the device) counts.
    CUDA's sync debug mode reports each synchronising call as a warning, attributed to the
    innermost frame outside torch (``caller_outside_torch``). Two counts, logged at the epoch's
    end with the steps each covers:

    - ``host_syncs``, ``host_sync_steps``: every synchronisation, in the steps that write no logs,
      are not the step before one (whose window holds the start of the log step, where Lightning's
      ``LearningRateMonitor`` copies each group's rate to the device), and are not followed by a
      validation or an epoch's end: those may synchronise for Lightning;
    - ``lit_dp_host_syncs``, ``lit_dp_sync_steps``: those called from lit_dp's own code, in every
      step after the warm-up, log steps included.

    Where they were called from is printed at the end of training.
    """

    def __init__(self, warmup: int = 5) -> None:
        self.warmup = warmup
        self.syncs = self.steps = 0
        self.lit_dp_syncs = self.lit_dp_steps = 0
        self.where: Counter[str] = Counter()
        self._recorder: warnings.catch_warnings | None = None
        self._caught: list[str] = []
        self._counted = self._clean = False

    def _record(self, message, category, filename, lineno, file=None, line=None) -> None:
        if SYNC_WARNING in str(message):
            self._caught.append(caller_outside_torch(traceback.extract_stack()))

    def _stop(self) -> None:
        if self._recorder is None:
            return
        torch.cuda.set_sync_debug_mode("default")
        self._recorder.__exit__(None, None, None)
        self._recorder = None
        if self._counted:
            self.where.update(self._caught)
            ours = [where for where in self._caught if where.startswith(LIT_DP + os.sep)]
            self.lit_dp_syncs += len(ours)
            self.lit_dp_steps += 1
        if self._clean:
            self.syncs += len(self._caught)
            self.steps += 1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._stop()
        step = trainer.global_step  # optimizer steps before this one
        logs = trainer.log_every_n_steps
        self._counted = step >= self.warmup
        self._clean = self._counted and (step + 1) % logs != 0 and (step + 2) % logs != 0
        self._recorder = warnings.catch_warnings()
        self._recorder.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self._record
        self._caught = []
        torch.cuda.set_sync_debug_mode("warn")

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._counted = self._clean = False
        self._stop()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._counted = self._clean = False
        self._stop()
        pl_module.log_dict(
            {
                "host_syncs": float(self.syncs),
                "host_sync_steps": float(self.steps),
                "lit_dp_host_syncs": float(self.lit_dp_syncs),
                "lit_dp_sync_steps": float(self.lit_dp_steps),
            }
        )

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._counted = self._clean = False
        self._stop()
        if self.where:
            print(f"[probe] host syncs called from: {dict(self.where.most_common())}", flush=True)


class _CountingMode(TorchDispatchMode):
    """Counts every aten operator dispatched inside, by name (``aten.mm.default``)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def counting_ops() -> Iterator[Counter[str]]:
    """The aten operators dispatched inside, forward, backward and optimizer alike, counted by name."""
    with _CountingMode() as mode:
        yield mode.counts


class OpsPerStep(pl.Callback):
    """Counts the aten operators dispatched in training step ``step`` (counted from 0), from its
    ``on_train_batch_start`` to its ``on_train_batch_end`` (forward, backward, clipping, optimizer
    step, and every hook's work in between); the counts are left in ``OpsPerStep.counted``."""

    counted: Counter[str] = Counter()

    def __init__(self, step: int = 3) -> None:
        self.step = step
        self._mode: _CountingMode | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            self._mode = _CountingMode()
            self._mode.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            OpsPerStep.counted = self._mode.counts
            self._mode = None
