"""``CommStatsMonitor``: the reducer's communication figures in the Trainer's loggers."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lit_dp.data_parallel import DataParallel
from lit_dp.observability.stats import CommStats


class CommStatsMonitor(pl.Callback):
    """Logs ``PaddleDPStrategy``'s communication figures through the trainer's loggers (CSV, TensorBoard).

    Only with ``PaddleDPStrategy``: the strategy installs it when ``comm_stats=True`` or ``comm_buffer_size="auto"``, so a user
    turns statistics on with one strategy option and no callback to remember. It follows
    Lightning's ``LearningRateMonitor``: on the steps the trainer writes its logs
    (``log_every_n_steps``) it logs rank 0's last-step ``comm/*`` figures, plus
    ``comm/exposed_ms_max``, the largest exposed time over ranks (one all-reduce of one number,
    on those steps only), and ``comm/tuned_buffer_mb`` once the autotuner has chosen. At each
    epoch end it logs the means so far over steps and ranks (``comm/*_mean``, also in
    ``trainer.callback_metrics``); when training ends, rank 0 prints its own.
    """

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # The steps on which the trainer writes its own logs; every rank decides alike.
        if trainer.global_step % trainer.log_every_n_steps != 0 and not trainer.should_stop:
            return
        metrics = self._step_metrics(trainer)
        if metrics and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        means = {f"comm/{name}_mean": value for name, value in self._means(trainer).items()}
        tuned = trainer.strategy.tuned_comm_buffer_size
        if tuned is not None:
            means["comm/tuned_buffer_mb"] = float(tuned)  # the same on every rank
        if means:
            pl_module.log_dict(means, sync_dist=True)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        means = self._means(trainer)
        last = self._model_stats(trainer)
        parts = []
        if last is not None:
            parts.append(f"{last.bytes / 2**20:.3f} MB in {last.buckets} bucket{'s' * (last.buckets != 1)} per step")
        if means:
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
        strategy = trainer.strategy
        metrics: dict[str, float] = {}
        if strategy.options.comm_stats:
            stats = self._model_stats(trainer)
            # Every rank takes part in the all-reduce, with -1 where no step is measured yet.
            # float64: rank 0's own value must not exceed the maximum by float32 rounding.
            value = stats.exposed_ms if stats is not None else -1.0
            exposed = torch.tensor([value], dtype=torch.float64, device=strategy.root_device)
            exposed_max = float(strategy.reduce(exposed, reduce_op="max").item())
            if stats is not None:
                metrics.update(stats.as_metrics())
                metrics["comm/exposed_ms_max"] = exposed_max
            sync = strategy.local_sgd.sync_stats() if strategy.local_sgd is not None else None
            if sync is not None:
                metrics.update(sync.as_metrics())
        tuned = strategy.tuned_comm_buffer_size
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
