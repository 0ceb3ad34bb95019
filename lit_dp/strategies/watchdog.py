"""The hang watchdog as ``PaddleDPStrategy`` wires it into a fit (docs/reliability.md, "Stuck ranks").

``lit_dp.DataParallel`` starts the watchdog (``lit_dp.observability.watchdog``) and bounds the
reducer's own waits. What only the Trainer strategy knows is wired here: the run's log
directory, where the stacks go; validation and rank 0's checkpoint writes as known phases
(``lit_dp.observability.phases``: while some rank is in one, the others' waits get the long
deadline, since they wait for it, not for a hang); and the strategy's own collectives
(``reduce``, ``barrier``, ``broadcast``, ``all_gather``), whose waits have no deadline of
lit_dp's, so the watchdog's thread watches them; the model's waiter also counts how long they
wait, with or without a watchdog (the straggler report's exposed wait: a rank that meets a slow
peer in ``self.log(..., sync_dist=True)`` waits there, not in the buckets).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import lightning.pytorch as pl

from lit_dp.data_parallel import DataParallel
from lit_dp.gradients.waiting import Waiter
from lit_dp.observability.phases import enter_phase, leave_phase
from lit_dp.observability.watchdog import HangWatchdog

log = logging.getLogger(__name__)


class StrategyWatchdog:
    """The wrapped model's hang watchdog, as ``PaddleDPStrategy`` uses it while fitting.

    Every call does nothing outside a fit and where the model has no watchdog (``hang_timeout=None``,
    one rank). The strategy calls ``setup`` and ``teardown`` from its own, ``validation_started``
    and ``validation_ended`` from its validation hooks, ``phase`` around what rank 0 does alone
    (a checkpoint write) and ``watching`` around each of its collectives.
    """

    def __init__(self) -> None:
        self._watchdog: HangWatchdog | None = None  # the wrapped model's, from setup to teardown
        self._waiter: Waiter | None = None  # the wrapped model's, from setup to teardown
        self._validating = False  # inside the validation phase

    def setup(self, trainer: pl.Trainer, model: DataParallel) -> None:
        """Take ``model``'s watchdog, its stacks pointed at the run's log directory, and its waiter."""
        self._watchdog, self._waiter = model.watchdog, model.waiter
        if self._watchdog is None:
            return
        self._watchdog.directory = trainer.log_dir or trainer.default_root_dir
        log.debug("hang watchdog: stacks of a hang go to %s", self._watchdog.directory)

    def teardown(self) -> None:
        self.validation_ended()  # a validation that raised
        self._waiter = None
        if self._watchdog is None:
            return
        log.debug("hang watchdog: stopping its thread")
        self._watchdog.close()
        self._watchdog = None

    def validation_started(self) -> None:
        """Validation is a known phase: a rank that evaluates longer is not a hang of the others."""
        if self._watchdog is not None and not self._validating:
            enter_phase("validation")
            self._validating = True

    def validation_ended(self) -> None:
        if self._validating:
            leave_phase()
        self._validating = False

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """``name`` as a known phase (what this rank does while the others wait for it)."""
        if self._watchdog is None:
            yield
            return
        with self._watchdog.phase(name):
            yield

    @contextmanager
    def watching(self, what: str) -> Iterator[None]:
        """Inside: a wait the watchdog's thread bounds (the main thread has no deadline of its own
        for it), timed by the model's waiter."""
        if self._waiter is None:
            yield
            return
        with self._waiter.outside(what):  # what HangWatchdog.watching does, also without a watchdog
            yield
