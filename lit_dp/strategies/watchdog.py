"""The hang watchdog as ``PaddleDPStrategy`` wires it into a fit (docs/reliability.md, "Stuck ranks").

``lit_dp.DataParallel`` starts the watchdog (``lit_dp.observability.watchdog``) and bounds the
reducer's own waits. What only the Trainer strategy knows is wired here: the run's log
directory, where the stacks go; a heartbeat from each validation batch, which starts no
synchronised step yet shows the rank is alive; and the strategy's own collectives (``reduce``,
``barrier``, ``broadcast``, ``all_gather``), whose waits have no deadline of lit_dp's, so the
watchdog's thread watches them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import lightning.pytorch as pl

from lit_dp.data_parallel import DataParallel
from lit_dp.observability.watchdog import HangWatchdog

log = logging.getLogger(__name__)


class StrategyWatchdog:
    """The wrapped model's hang watchdog, as ``PaddleDPStrategy`` uses it while fitting.

    Every call does nothing outside a fit and where the model has no watchdog (``hang_timeout=None``,
    one rank). The strategy calls ``setup`` and ``teardown`` from its own, ``heartbeat`` from
    ``validation_step`` and ``watching`` around each of its collectives.
    """

    def __init__(self) -> None:
        self._watchdog: HangWatchdog | None = None  # the wrapped model's, from setup to teardown

    def setup(self, trainer: pl.Trainer, model: DataParallel) -> None:
        """Take ``model``'s watchdog, its stacks pointed at the run's log directory."""
        self._watchdog = model.watchdog
        if self._watchdog is None:
            return
        self._watchdog.directory = trainer.log_dir or trainer.default_root_dir
        log.debug("hang watchdog: stacks of a hang go to %s", self._watchdog.directory)

    def teardown(self) -> None:
        if self._watchdog is None:
            return
        log.debug("hang watchdog: stopping its thread")
        self._watchdog.close()
        self._watchdog = None

    def heartbeat(self) -> None:
        """A validation batch began: the rank is alive though it starts no synchronised step."""
        if self._watchdog is not None:
            self._watchdog.heartbeat()

    @contextmanager
    def watching(self, what: str) -> Iterator[None]:
        """Inside: a wait the watchdog's thread bounds (the main thread has no deadline of its own for it)."""
        if self._watchdog is None:
            yield
            return
        with self._watchdog.watching(what):
            yield
