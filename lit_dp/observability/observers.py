"""What watches one model's reducer: the observers its options ask for, built and subscribed in one place.

``DataParallel`` owns one ``ModelObservers`` and reads its members (its ``step_clock``,
``watchdog``, ``comm_stats()``, ...); this module decides which exist. The step clock comes
first, since it takes the timestamps the statistics, the hang watchdog, the straggler report and
the consistency check share; observers that compare ranks need other ranks, of a group torch
registered: the reducer's, or under torchft the replica group's own (its ranks train as one and
its collectives can hang; across groups torchft's timeouts and changing quorums take their place).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

import lit_dp.gradients.group as groups
from lit_dp.gradients.buckets import megabytes_to_bytes
from lit_dp.gradients.reducer import Reducer
from lit_dp.gradients.waiting import Waiter
from lit_dp.observability.autotune import BucketAutotuner
from lit_dp.observability.consistency import ReplicaConsistency
from lit_dp.observability.profile import CommProfile
from lit_dp.observability.stats import CommObserver, CommStats
from lit_dp.observability.step_clock import StepClock
from lit_dp.observability.straggler import StragglerReport, WindowReport
from lit_dp.observability.watchdog import HangWatchdog
from lit_dp.options import AUTO, Options
from lit_dp.options.comm_hooks import describe_comm_hook

if TYPE_CHECKING:
    from lit_dp.observability.trace import TraceWriter

log = logging.getLogger(__name__)


@dataclass
class ModelObservers:
    """The observers of one model's reducer; each None where its option leaves it off."""

    tuner: BucketAutotuner | None = None
    trace: TraceWriter | None = None
    clock: StepClock | None = None
    stats: CommObserver | None = None
    profile: CommProfile | None = None
    watchdog: HangWatchdog | None = None
    straggler: StragglerReport | None = None
    consistency: ReplicaConsistency | None = None

    @classmethod
    def subscribe(
        cls,
        reducer: Reducer,
        options: Options,
        device: torch.device,
        names: list[str],
        waiter: Waiter,
        *,
        ranks: dist.ProcessGroup | None,
        parameters: list[tuple[str, nn.Parameter]],
        buffers: Callable[[], Iterator[tuple[str, torch.Tensor]]],
        wait_for_parameters: Callable[[], None],
    ) -> ModelObservers:
        """Subscribe what ``options`` ask for to ``reducer``'s events, in the order they read each other.

        ``names``: the reducer's parameters' names (the trace's); ``ranks``: the ranks the hang
        watchdog, the straggler report and the consistency check compare (None: none to compare);
        ``parameters`` and ``buffers``: what the consistency check fingerprints; ``wait_for_parameters``: waits for updates still
        in flight before it reads them.
        """
        observers = cls()
        if options.comm_buffer_size == AUTO:
            last_bucket_bytes = megabytes_to_bytes("last_comm_buffer_size", options.last_comm_buffer_size)
            observers.tuner = BucketAutotuner(reducer, device, last_bucket_bytes)
        if options.trace.dir is not None:
            from lit_dp.observability.trace import TraceWriter  # on demand: `python -m lit_dp.observability.trace` must find it unimported

            observers.trace = TraceWriter(options.trace.dir, dist.get_rank(), options.trace.steps, names)
        group = ranks
        among_ranks = group is not None and group.size() > 1
        if among_ranks and not groups.is_registered(group):
            log.warning(
                "lit_dp.DataParallel: no hang watchdog, straggler report or replica-consistency check for %s, a "
                "process group torch did not register: they find the ranks through torch's group bookkeeping.",
                type(group).__name__,
            )
            among_ranks = False
        watched = options.hang_timeout is not None and among_ranks
        straggler = options.straggler.every_n_steps if among_ranks else None
        consistency = options.consistency.every_n_steps if among_ranks else None
        trace = observers.trace
        profiled = options.comm_stats or options.forecast.ranks is not None
        if profiled or trace is not None or watched or straggler or consistency:
            observers.clock = clock = StepClock(device, waiter, reducer.parameters)
            reducer.add_observer(clock)
        if profiled:
            # Its file is named by the rank: a replica group's ranks have no place across the groups before their
            # first quorum (-1), and write to their group's folder, each under its rank within the group.
            rank = reducer.group.rank()
            if rank < 0 and ranks is not None:
                rank = ranks.rank()
            observers.profile = CommProfile(
                [param.numel() * param.element_size() for param in reducer.parameters],
                rank,
                reducer.group.size(),
                groups.backend_name(reducer.group),
                device,
                {**profile_settings(options), "gradient_bits": 8 * reducer.parameters[0].element_size()},
            )
        if profiled or trace is not None:
            sinks = [sink.add for sink in (trace, observers.profile) if sink is not None]
            host_work = gradients_ready = None
            if profiled:  # the forecast's: the work a LocalSGD local step skips, where gradients are ready
                reducer.times_host_work = True
                host_work, gradients_ready = reducer.host_work_ms, reducer.gradients_ready_ms
            observers.stats = CommObserver(device, observers.clock, sinks, host_work, gradients_ready)
            reducer.add_observer(observers.stats)
        if watched:
            # The watchdog sets this model's waiter's deadlines itself (warm-up, then hang_timeout).
            observers.watchdog = HangWatchdog.start(
                reducer,
                options.hang_timeout,
                directory=options.trace.dir,
                device=device,
                clock=observers.clock,
                given=options.hang_timeout_given,
                group=group,
            )
        if straggler:
            observers.straggler = StragglerReport(observers.clock, group, waiter, device, straggler)
            reducer.add_observer(observers.straggler)
        if consistency:
            observers.consistency = ReplicaConsistency(
                parameters,
                buffers,
                group,
                waiter,
                device,
                consistency,
                options.consistency.action,
                observers.clock.optimizers if options.consistency.optimizer_state else None,
                wait_for_parameters,
            )
            reducer.add_observer(observers.consistency)
        log.debug(
            "lit_dp.DataParallel: observers: comm_stats=%s trace=%s autotune=%s hang watchdog=%s straggler report "
            "every %s steps, replica consistency every %s steps (%s)",
            observers.stats is not None,
            trace is not None,
            observers.tuner is not None,
            observers.watchdog is not None,
            straggler,
            consistency,
            options.consistency.action,
        )
        return observers

    def flush(self) -> None:
        """Resolve every finished step of the statistics (waiting for the device) and write the trace so far."""
        if self.stats is not None:
            self.stats.flush()
        if self.trace is not None:
            self.trace.write()


def profile_settings(options: Options) -> dict[str, Any]:
    """The options that shape a step's communication, as the profile records them for the forecast."""
    local_sgd = options.local_sgd
    return {
        "comm_buffer_size": options.comm_buffer_size,
        "last_comm_buffer_size": options.last_comm_buffer_size,
        "comm_hook": describe_comm_hook(options),
        "comm_dtype": options.comm_dtype,
        "gradient_as_bucket_view": options.gradient_as_bucket_view,
        "nrings": options.nrings,
        "sharding_stage": options.sharding.stage,
        "local_sgd_steps": local_sgd.steps,
        "local_sgd_warmup_steps": local_sgd.warmup_steps,
        "local_sgd_outer": local_sgd.outer,
        "fault_tolerance": options.fault_tolerance,
    }


class ObservedModel:
    """What a model's observers show its user (a mixin of ``DataParallel``, which holds ``_observers``)."""

    _observers: ModelObservers

    @property
    def watchdog(self) -> HangWatchdog | None:
        """The hang watchdog (``hang_timeout``); set its ``directory`` to choose where stacks go, and
        mark what this rank alone does on purpose with ``phase(name)``."""
        return self._observers.watchdog

    @property
    def step_clock(self) -> StepClock | None:
        """The step clock (``lit_dp.observability.step_clock``) its observers share; the Trainer
        strategy tells it where batches start and end. None when nothing observes the steps."""
        return self._observers.clock

    @property
    def straggler(self) -> StragglerReport | None:
        """The straggler report (``straggler_every_n_steps``): ``last``, ``summary()``; None when off."""
        return self._observers.straggler

    def straggler_report(self) -> WindowReport | None:
        """The latest window the ranks judged (``lit_dp.observability.straggler``): which rank is
        slowest, its lag and its cause, every rank's timings; None before the first, or when off."""
        return self._observers.straggler.last if self._observers.straggler is not None else None

    @property
    def consistency(self) -> ReplicaConsistency | None:
        """The replica-consistency check (``consistency_every_n_steps``); None when off."""
        return self._observers.consistency

    @property
    def autotuner(self) -> BucketAutotuner | None:
        """The bucket-size autotuner (``comm_buffer_size="auto"``), with its sweep once decided."""
        return self._observers.tuner

    def comm_stats(self) -> CommStats | None:
        """This rank's statistics for the last synchronised step whose measurements are complete.

        None before the first step or without ``comm_stats=True``/``trace_dir``. Never waits for
        the device: on CUDA the step before the last is returned while the last is in flight.
        """
        return self._observers.stats.last() if self._observers.stats is not None else None

    def comm_stats_mean(self) -> dict[str, float]:
        """Mean ``time_ms`` and ``exposed_ms`` over the steps so far (the first excluded), and their overlap."""
        return self._observers.stats.mean() if self._observers.stats is not None else {}

    @property
    def comm_profile(self) -> CommProfile | None:
        """The run's communication profile (``lit_dp.observability.profile``), what ``lit_dp.forecast``
        predicts from: ``comm_profile.record()``; None without ``comm_stats``."""
        return self._observers.profile

    def flush_comm_stats(self) -> None:
        """Resolve every finished step (waiting for the device) and write the trace collected so far."""
        self._observers.flush()
