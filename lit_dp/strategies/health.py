"""``HealthMonitor``: the straggler report and the replica-consistency check as a Trainer fit sees them."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from lit_dp.data_parallel import DataParallel
from lit_dp.observability.straggler import WindowReport


class HealthMonitor(pl.Callback):
    """What only the Trainer knows, told to the wrapped model's step clock, and the results in its loggers.

    ``PaddleDPStrategy`` installs it when the model has a step clock (the straggler report, the
    consistency check, the hang watchdog or the statistics are on), as it installs
    ``CommStatsMonitor``:

    - where each training batch starts and ends, so that the straggler report's ``data`` is the
      wait between batches (a hand-written loop has no such hook: there the first forward after
      an optimizer step stands for the batch's arrival); validation is a pause every rank takes,
      left out of the figures;
    - each window the ranks judged, as ``straggler/*`` metrics (the slowest rank, its lag, where
      its time and the others' went; ``WindowReport.as_metrics``), logged by rank 0 at the step
      the window was read;
    The lines a run ends with (how many windows had a rank lagging and the largest lag, or that none
    lagged; how many consistency checks ran; a run too short for a window or a check gets neither)
    are printed by the strategy's monitors feature instead (``lit_dp.strategies.monitoring``), after
    every feature ended training: LocalSGD's final sync, which the consistency check follows, comes
    after the callbacks' ``on_train_end``.
    """

    def __init__(self) -> None:
        self._logged: WindowReport | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        model = self._model(trainer)
        if model is not None and model.step_clock is not None:
            model.step_clock.batch_started()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        model = self._model(trainer)
        if model is None or model.step_clock is None:
            return
        report = model.straggler_report()
        if report is not None and report is not self._logged:
            self._logged = report
            metrics = report.as_metrics()
            if metrics and trainer.is_global_zero:
                for logger in trainer.loggers:
                    logger.log_metrics(metrics, step=trainer.global_step)
        model.step_clock.batch_ended()  # last: this callback runs after the others, checkpoints included

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        model = self._model(trainer)
        if model is not None and model.step_clock is not None:
            model.step_clock.pause()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        model = self._model(trainer)
        if model is not None and model.step_clock is not None:
            model.step_clock.resume()

    @staticmethod
    def _model(trainer: pl.Trainer) -> DataParallel | None:
        model = trainer.strategy.model
        return model if isinstance(model, DataParallel) else None


def health_summaries(model: DataParallel) -> list[str]:
    """The lines a run ends with: the straggler report's and the consistency check's, where they are on
    and have judged something."""
    lines = []
    if model.straggler is not None and (straggler := model.straggler.summary()) is not None:
        lines.append(f"[lit_dp] straggler: {straggler}")
    if model.consistency is not None and model.consistency.checks:
        lines.append(f"[lit_dp] replica consistency: {model.consistency.summary()}")
    return lines
