"""Known phases: a rank busy on purpose (a checkpoint write, validation, an evaluation on rank 0 only).

While some rank is in a known phase, the hang watchdog (``lit_dp.observability.watchdog``)
gives the others' waits its long deadline instead of ``hang_timeout``: rank 0 writing a
multi-GB checkpoint while the others wait in a barrier is not a hang. Phases are job-wide and
belong to the rank, not to a model (whichever of its models waits, the rank is busy): the
rendezvous store counts the ranks in a phase, and each process keeps its own open phases,
which nest. The Trainer and Fabric strategies mark validation and rank 0's checkpoint writes;
a hand-written loop marks its own with ``model.watchdog.phase(name)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from lit_dp.job.store import rendezvous_store

BUSY_RANKS = "lit_dp/watchdog/phases/active"  # store key: how many ranks are in a known phase now
_STORE_ERRORS = (RuntimeError, ValueError, dist.DistError)


class _Phases:
    """This process's open phases, innermost last; the rank counts once in the store while any is open."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.counted = False

    def enter(self, name: str) -> None:
        self.names.append(name)
        store = rendezvous_store()
        if store is not None and not self.counted:
            try:
                store.add(BUSY_RANKS, 1)
                self.counted = True
            except _STORE_ERRORS:
                pass  # no store to tell: nobody waits for this rank's collectives either

    def leave(self) -> None:
        if self.names:
            self.names.pop()
        if self.names or not self.counted:
            return
        self.counted = False
        store = rendezvous_store()
        if store is not None:
            try:
                store.add(BUSY_RANKS, -1)
            except _STORE_ERRORS:
                pass  # the job is ending


_PHASES = _Phases()


def enter_phase(name: str) -> None:
    """This rank is busy with ``name`` on purpose until ``leave_phase``."""
    _PHASES.enter(name)


def leave_phase() -> None:
    _PHASES.leave()


@contextmanager
def known_phase(name: str) -> Iterator[None]:
    enter_phase(name)
    try:
        yield
    finally:
        leave_phase()


def current_phase() -> str | None:
    """This rank's innermost open phase, for its report."""
    return _PHASES.names[-1] if _PHASES.names else None


def some_rank_busy(store: dist.Store) -> bool:
    """Whether some rank of the job is in a known phase now."""
    return store.add(BUSY_RANKS, 0) > 0
