"""``CommStatsMonitor``: the reducer's communication figures in the Trainer's loggers."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info

import lit_dp.gradients.group as groups
from lit_dp.data_parallel import DataParallel
from lit_dp.observability.exchange import Exchange
from lit_dp.observability.stats import CommStats


class CommStatsMonitor(pl.Callback):
    """Logs ``PaddleDPStrategy``'s communication figures through the trainer's loggers (CSV, TensorBoard).

    Only with ``PaddleDPStrategy``: the strategy installs it when ``comm_stats=True`` or ``comm_buffer_size="auto"``, so a user
    turns statistics on with one strategy option and no callback to remember. It follows
    Lightning's ``LearningRateMonitor``: on the steps the trainer writes its logs
    (``log_every_n_steps``) it logs rank 0's last-step ``comm/*`` figures, plus
    ``comm/exposed_ms_max``, the largest exposed time over ranks (one all-gather of one number,
    on those steps only), and ``comm/tuned_buffer_mb`` once the autotuner has chosen. At each
    epoch end it logs the means so far over steps and ranks (``comm/*_mean``, also in
    ``trainer.callback_metrics``); when training ends, rank 0 prints its own.

    Nothing waits for the device or for another rank: the figures are the host's already
    (``DataParallel.comm_stats``), and the all-gather's result is read by the next log step (or the
    end of training), when it has long arrived, and the step's figures are logged with it, under
    their own step. On one rank there is nothing to gather.
    """

    def __init__(self) -> None:
        self._exchange: Exchange | None = None
        self._loggers: list[pl.loggers.Logger] = []  # rank 0's, which alone writes

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        model = trainer.strategy.model
        self._exchange = None
        # Over the strategy's process group, as its other collectives (under torchft: one replica group's ranks).
        group = dist.group.WORLD
        if trainer.strategy.options.comm_stats and isinstance(model, DataParallel) and not groups.trivially_alone(group):
            what = "the all-gather of each rank's exposed communication time (comm/exposed_ms_max)"
            self._exchange = Exchange(group, model.waiter, what, self._gathered)
        self._loggers = list(trainer.loggers) if trainer.is_global_zero else []

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # The steps on which the trainer writes its own logs; every rank decides alike.
        if trainer.global_step % trainer.log_every_n_steps != 0 and not trainer.should_stop:
            return
        metrics = self._step_metrics(trainer)
        if not trainer.strategy.options.comm_stats:
            self._log(metrics, trainer.global_step)
            return
        stats = self._model_stats(trainer)
        exposed = stats.exposed_ms if stats is not None else -1.0  # every rank takes part, -1 where none is measured yet
        if self._exchange is None:
            self._log({**metrics, "comm/exposed_ms_max": exposed} if stats is not None else metrics, trainer.global_step)
            return
        # float64: rank 0's own value must not exceed the maximum by float32 rounding. Filled on the
        # device, not copied from the host, which would wait for the device.
        value = torch.full((1,), exposed, dtype=torch.float64, device=trainer.strategy.root_device)
        # Read when the next log step starts its own (``start`` delivers the pending one first) or when
        # training ends, when it has long arrived: read now, on the host, the step would wait for the
        # slowest rank to reach this point (on the digits recipe, 2 ms on each log step, and its median
        # step 0.5 ms slower).
        self._exchange.start(value, (trainer.global_step, metrics, stats is not None))

    def _gathered(self, tag: tuple[int, dict[str, float], bool], rows: torch.Tensor) -> None:
        step, metrics, measured = tag
        self._log({**metrics, "comm/exposed_ms_max": float(rows.max())} if measured else metrics, step)

    def _log(self, metrics: dict[str, float], step: int) -> None:
        for logger in self._loggers if metrics else ():
            logger.log_metrics(metrics, step=step)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A group of one rank communicates nothing: its means (0 ms, overlap 1.0) would say nothing true.
        measured = self._means(trainer)
        means = {f"comm/{name}_mean": value for name, value in measured.items()} if _communicated(measured) else {}
        tuned = trainer.strategy.tuned_comm_buffer_size
        if tuned is not None:
            means["comm/tuned_buffer_mb"] = float(tuned)  # the same on every rank
        if means:
            pl_module.log_dict(means, sync_dist=True)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._exchange is not None:
            self._exchange.poll(wait=True)  # the last log step's figures
            self._exchange = None
        means = self._means(trainer)
        last = self._model_stats(trainer)
        parts = []
        # A group of one rank communicates nothing: "0.000 MB in 0 buckets, overlap 1.00" says nothing.
        if last is not None and last.buckets:
            parts.append(f"{last.bytes / 2**20:.3f} MB in {last.buckets} bucket{'s' * (last.buckets != 1)} per step")
        if _communicated(means):
            parts.append(
                f"time {means['time_ms']:.3f} ms, exposed {means['exposed_ms']:.3f} ms, "
                f"overlap {means['overlap']:.2f} (rank 0, means over the steps after the first)"
            )
        tuned = trainer.strategy.tuned_comm_buffer_size
        if tuned is not None:
            parts.append(f"comm_buffer_size=auto -> {tuned:g} MB")
        local_sgd = trainer.strategy.local_sgd
        if local_sgd is not None and trainer.strategy.options.comm_stats and local_sgd.describe_traffic():
            parts.append(local_sgd.describe_traffic())  # the averages before the fit's final one
        if parts:
            rank_zero_info("[lit_dp] comm: " + "; ".join(parts))

    def _step_metrics(self, trainer: pl.Trainer) -> dict[str, float]:
        """Rank 0's figures of the last step (without the maximum over ranks) and the tuned size."""
        metrics: dict[str, float] = {}
        stats = self._model_stats(trainer) if trainer.strategy.options.comm_stats else None
        if stats is not None:
            metrics.update(stats.as_metrics())
        local_sgd = trainer.strategy.local_sgd
        sync = local_sgd.sync_stats() if local_sgd is not None and trainer.strategy.options.comm_stats else None
        if sync is not None:  # LocalSGD's last average: its bytes and time
            metrics.update(sync.as_metrics())
        tuned = trainer.strategy.tuned_comm_buffer_size
        if tuned is not None:
            metrics["comm/tuned_buffer_mb"] = float(tuned)
        return metrics

    @staticmethod
    def _model_stats(trainer: pl.Trainer) -> CommStats | None:
        model = trainer.strategy.model
        return model.comm_stats() if isinstance(model, DataParallel) else None

    @staticmethod
    def _means(trainer: pl.Trainer) -> dict[str, float]:
        model = trainer.strategy.model
        return model.comm_stats_mean() if isinstance(model, DataParallel) and trainer.strategy.options.comm_stats else {}


def _communicated(means: dict[str, float]) -> bool:
    """Whether the mean figures of ``CommStats.mean`` measured any communication."""
    return bool(means) and bool(means["time_ms"] or means["exposed_ms"])
