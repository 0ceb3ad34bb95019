"""The monitors as a feature of both strategies (``lit_dp.strategies.feature``), the registry's last.

Under the Trainer it installs ``CommStatsMonitor`` (``comm_stats=True`` or
``comm_buffer_size="auto"``) and ``HealthMonitor`` (when the model has a step clock) in the
callbacks, once each. Under both doors, teardown resolves the last steps' statistics and writes
the Chrome trace collected so far (``trace_steps`` of a run shorter than its window). When
training ends (the Trainer: the last of the features' ``on_train_end``, after LocalSGD's final
sync and its consistency check; Fabric: at teardown) it says on rank 0 the straggler report's and
the consistency check's summaries, one ``[lit_dp]`` line each.
"""

from __future__ import annotations

import logging

from lightning.fabric.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lit_dp.data_parallel import DataParallel
from lit_dp.options import AUTO, Options
from lit_dp.strategies.feature import Feature, Run
from lit_dp.strategies.health import HealthMonitor, health_summaries
from lit_dp.strategies.monitor import CommStatsMonitor

log = logging.getLogger(__name__)


class Monitors(Feature):
    """The monitors' callbacks (the Trainer's) and the statistics' last flush (both doors)."""

    def __init__(self, comm_stats: bool) -> None:
        self._comm_stats = comm_stats  # CommStatsMonitor wanted
        self._models: list[DataParallel] = []  # set up since the last teardown (Fabric: one or more)
        self._no_trainer = False  # a loop of the user's (Fabric) trains them: no HealthMonitor ends the run

    @classmethod
    @override
    def build(cls, options: Options) -> Monitors:
        return cls(options.comm_stats or options.comm_buffer_size == AUTO)

    @override
    def setup(self, run: Run) -> None:
        model = run.model
        if model is None or not run.fitting:
            return
        if model not in self._models:
            self._models.append(model)
        trainer = run.trainer
        self._no_trainer = trainer is None
        if trainer is None:
            return
        if self._comm_stats and not any(isinstance(callback, CommStatsMonitor) for callback in trainer.callbacks):
            log.debug("CommStatsMonitor added to the callbacks")
            trainer.callbacks.append(CommStatsMonitor())
        if model.step_clock is not None and not any(isinstance(c, HealthMonitor) for c in trainer.callbacks):
            log.debug("HealthMonitor added to the callbacks (batches, straggler/*)")
            trainer.callbacks.append(HealthMonitor())

    @override
    def on_train_end(self) -> None:
        if self._no_trainer:  # a Fabric loop: said at teardown, Fabric having no end of training
            return
        for model in self._models:
            for summary in health_summaries(model):
                rank_zero_info(summary)

    @override
    def teardown(self) -> None:
        for model in self._models:
            model.flush_comm_stats()  # the trace of a run shorter than trace_steps
            if self._no_trainer:
                for summary in health_summaries(model):
                    rank_zero_info(summary)
        self._models = []
