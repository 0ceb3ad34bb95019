"""The hang watchdog as the strategies wire it into a run (docs/reliability.md, "Stuck ranks").

``lit_dp.DataParallel`` starts the watchdog (``lit_dp.observability.watchdog``) and bounds the
reducer's own waits. What only a strategy knows is wired here, by a feature
(``lit_dp.strategies.feature``) of the Trainer's strategy and of Fabric's: the run's log
directory, where the stacks go (the Trainer's); validation and rank 0's checkpoint writes as
known phases (``lit_dp.observability.phases``: while some rank is in one, the others' waits get
the long deadline, since they wait for it, not for a hang); the strategy's own collectives
(``reduce``, ``barrier``, ``broadcast``, ``all_gather``), whose waits have no deadline of
lit_dp's, so the watchdog's thread watches them (the model's waiter also counts how long they
wait, with or without a watchdog: the straggler report's exposed wait, a rank that meets a slow
peer in ``self.log(..., sync_dist=True)`` waits there, not in the buckets); and the thread's end
at teardown.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from typing_extensions import override

from lit_dp.gradients.waiting import Waiter
from lit_dp.observability.phases import enter_phase, leave_phase
from lit_dp.observability.watchdog import HangWatchdog
from lit_dp.strategies.feature import Feature, Run

log = logging.getLogger(__name__)


class StrategyWatchdog(Feature):
    """The wrapped models' hang watchdogs, as the strategies use them.

    Every hook does nothing before ``setup`` and where the model has no watchdog
    (``hang_timeout=None``, one rank). Under Fabric each model set up brings its own; the last
    one's watches the strategy's collectives, and teardown stops every one's thread.
    """

    def __init__(self) -> None:
        self._watchdogs: list[HangWatchdog] = []  # the wrapped models', from setup to teardown
        self._waiter: Waiter | None = None  # the model's set up last, from setup to teardown
        self._validating = False  # inside the validation phase

    @override
    def setup(self, run: Run) -> None:
        """Take the model's watchdog, its stacks pointed at the run's log directory, and its waiter."""
        model = run.model
        if model is None:
            return
        self._waiter = model.waiter
        watchdog = model.watchdog
        if watchdog is None or watchdog in self._watchdogs:
            return
        self._watchdogs.append(watchdog)
        if run.trainer is not None:
            watchdog.directory = run.trainer.log_dir or run.trainer.default_root_dir
            log.debug("hang watchdog: stacks of a hang go to %s", watchdog.directory)

    @override
    def teardown(self) -> None:
        self.on_validation_end()  # a validation that raised
        self._waiter = None
        for watchdog in self._watchdogs:
            log.debug("hang watchdog: stopping its thread")
            watchdog.close()
        self._watchdogs = []

    @override
    def on_validation_start(self) -> None:
        """Validation is a known phase: a rank that evaluates longer is not a hang of the others."""
        if self._watchdogs and not self._validating:
            enter_phase("validation")
            self._validating = True

    @override
    def on_validation_end(self) -> None:
        if self._validating:
            leave_phase()
        self._validating = False

    @contextmanager
    @override
    def saving(self) -> Iterator[None]:
        """Rank 0's checkpoint write as a known phase (what this rank does while the others wait for it)."""
        if not self._watchdogs:
            yield
            return
        with self._watchdogs[-1].phase("saving a checkpoint"):
            yield

    @contextmanager
    @override
    def collective(self, name: str) -> Iterator[None]:
        """Inside: a wait the watchdog's thread bounds (the main thread has no deadline of its own
        for it), timed by the model's waiter."""
        if self._waiter is None:
            yield
            return
        with self._waiter.outside(f"strategy.{name}"):  # what HangWatchdog.watching does, also without a watchdog
            yield
