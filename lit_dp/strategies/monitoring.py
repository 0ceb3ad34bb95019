"""The monitors as a feature of both strategies (``lit_dp.strategies.feature``), the registry's last.

Under the Trainer it installs ``CommStatsMonitor`` (``comm_stats=True`` or
``comm_buffer_size="auto"``) and ``HealthMonitor`` (when the model has a step clock) in the
callbacks, once each. Under both doors, teardown resolves the last steps' statistics and writes
the Chrome trace collected so far (``trace_steps`` of a run shorter than its window). When
training ends (the Trainer: the last of the features' ``on_train_end``, after LocalSGD's final
sync and its consistency check; Fabric: at teardown) it says on rank 0 the straggler report's and
the consistency check's summaries, one ``[lit_dp]`` line each.

Under the Trainer, when training ends, every rank probes the link (``lit_dp.observability.link_probe``:
all ranks are there, between training and what follows it) and its host's resume after an idle wait
(``lit_dp.observability.resume_probe``, half a second), and writes its communication profile
(``lit_dp.observability.profile``, with ``comm_stats`` or ``forecast.ranks``) in the Trainer's log
folder, where ``python -m lit_dp.forecast`` finds it; with ``forecast.ranks`` rank 0 then prints
the forecast, one line per setting (``lit_dp.forecast.end_of_run_lines``). Fabric has no log
folder of the strategy's: there the forecast lines come at teardown, from the profile in memory.
"""

from __future__ import annotations

import dataclasses
import logging

from lightning.fabric.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lit_dp.data_parallel import DataParallel
from lit_dp.forecast import NoRunError, end_of_run_lines, predict
from lit_dp.observability.link_probe import probe_link
from lit_dp.observability.resume_probe import probe_resume
from lit_dp.observability.profile import Profile
from lit_dp.options import AUTO, Options
from lit_dp.options.forecast import ForecastOptions
from lit_dp.strategies.feature import Feature, Run
from lit_dp.strategies.health import HealthMonitor, health_summaries
from lit_dp.strategies.monitor import CommStatsMonitor

log = logging.getLogger(__name__)


class Monitors(Feature):
    """The monitors' callbacks (the Trainer's) and the statistics' last flush (both doors)."""

    def __init__(self, comm_stats: bool, forecast: ForecastOptions | None = None) -> None:
        self._comm_stats = comm_stats  # CommStatsMonitor wanted
        self._forecast = forecast or ForecastOptions()
        self._run: Run | None = None
        self._models: list[DataParallel] = []  # set up since the last teardown (Fabric: one or more)
        self._no_trainer = False  # a loop of the user's (Fabric) trains them: no HealthMonitor ends the run

    @classmethod
    @override
    def build(cls, options: Options) -> Monitors:
        return cls(options.comm_stats or options.comm_buffer_size == AUTO, options.forecast)

    @override
    def setup(self, run: Run) -> None:
        model = run.model
        if model is None or not run.fitting:
            return
        if model not in self._models:
            self._models.append(model)
        self._run = run
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
        trainer = self._run.trainer if self._run is not None else None
        # Every rank asks: Lightning's log_dir broadcasts rank 0's folder.
        folder = (trainer.log_dir or trainer.default_root_dir) if trainer is not None and self._profiled() else None
        for model in self._models:
            for summary in health_summaries(model):
                rank_zero_info(summary)
            profile = self._profile(model)
            group = model.process_group
            # Every rank is here. Under torchft the reducer's group crosses replica groups only inside a
            # quorum of the Manager's.
            if profile is not None and model.options.fault_tolerance is None and group is not None and group.size() > 1:
                # Its waits count into the model's waiter, as lit_dp's all do: after the straggler window was read.
                profile = profile.with_extra(link_probe=probe_link(group, model.device, model.waiter.wait))
            if profile is not None and group is not None and group.size() > 1:  # one rank has nothing to forecast
                # This rank's host alone, no collective: under torchft too.
                profile = profile.with_extra(resume_probe=probe_resume())
            if profile is not None and folder is not None:
                path = profile.write(folder)
                log.debug("communication profile written to %s", path)
            self._say_forecast(profile, folder)

    @override
    def teardown(self) -> None:
        for model in self._models:
            model.flush_comm_stats()  # the trace of a run shorter than trace_steps
            if self._no_trainer:
                for summary in health_summaries(model):
                    rank_zero_info(summary)
                self._say_forecast(self._profile(model), None)
        self._models = []

    def _profiled(self) -> bool:
        return any(model.comm_profile is not None for model in self._models)

    def _profile(self, model: DataParallel) -> Profile | None:
        """The model's profile, with the step clock's last window and LocalSGD's traffic, where known."""
        if model.comm_profile is None:
            return None
        model.flush_comm_stats()
        profile = model.comm_profile.record()
        extra = {}
        report = model.straggler_report()
        if report is not None and profile.rank in report.ranks:
            extra["window"] = dataclasses.asdict(report.times_of(profile.rank))
        local_sgd = self._run.strategy.local_sgd if self._run is not None else None
        if local_sgd is not None and local_sgd.traffic():
            extra["local_sgd"] = local_sgd.traffic()
        return profile.with_extra(**extra)

    def _say_forecast(self, profile: Profile | None, folder: str | None) -> None:
        if self._forecast.ranks is None or profile is None or profile.rank != 0:
            return
        for line in forecast_lines(profile, self._forecast, folder):
            rank_zero_info(line)


def forecast_lines(profile: Profile, options: ForecastOptions, folder: str | None) -> list[str]:
    """The end-of-run forecast from ``profile`` (rank 0's) at ``options.ranks`` over ``options.bandwidths``
    (the run's own link without them), one line per setting; one line saying why where there is none."""
    try:
        forecast = predict(profile, ranks=list(options.ranks or ()), bandwidth=list(options.bandwidths or ()) or None)
    except NoRunError as error:
        return [f"[lit_dp] forecast: none: {error}"]
    return end_of_run_lines(forecast, folder)
