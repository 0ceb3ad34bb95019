"""A rank that died, named: which rank, its pid and exit status, beside its peers' collective error.

When a rank dies (an OOM kill, a segfault, ``kill -9``), its peers see only their transport's
view of it, e.g. Gloo's ``Connection reset by peer``. Under Lightning's script launcher the
launching process is rank 0 and the parent of the other local ranks, so it can say more: when
``fit`` fails, ``LostRanks.note`` adds a note to the exception (``BaseException.add_note``,
printed under the traceback's last line) for each child rank that has exited, with its exit
status, and a rank whose parent (the launching rank) is gone says so. Under torchrun or SLURM
the launcher's own summary names the failed rank.

Lightning's script launcher also watches the ranks it started, from a thread in rank 0 that
SIGKILLs the whole job within 5 s of one dying: on a loaded machine that came before rank 0's
own error, and cut the note naming the dead rank. ``LostRanks.watch`` gives rank 0
``OBSERVER_GRACE_SECONDS`` after a death to report it first; past that, Lightning's thread ends
the job as before (rank 0 stuck where no transport error reaches it).

The other way round, when rank 0 fails, ``end_started_ranks`` ends the child ranks it started
that are still running a moment later: they cannot finish the job without it, and one waiting
for it where no transport error reaches it (in the rendezvous, whose store rank 0 never hosted)
would otherwise wait out the process group's timeout, 30 minutes by default.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from typing import Any

from typing_extensions import override

from lit_dp.gradients.waiting import CollectiveHangError
from lit_dp.strategies.feature import Feature
from lit_dp.strategies.lightning_private import (
    child_process_observers,
    observed_processes,
    observer_check,
    replace_observer_check,
)

log = logging.getLogger(__name__)

# How long a failed rank 0 waits for the rank whose socket closed to be reaped: a process killed
# by a signal closes its sockets as it exits, a moment before its parent can see its status.
EXIT_GRACE_SECONDS = 1.0
# How long Lightning's child-process observer waits, once it has seen a rank die, before it ends
# the job: rank 0's collective fails within seconds of a peer's death, and its report (the note
# naming that rank) takes a second more, even on a loaded machine.
OBSERVER_GRACE_SECONDS = 30.0
# How long a failed rank 0 lets the ranks it started end on their own (a rank that hits the same
# error, or loses its connection to rank 0, prints its error and exits within seconds, even on a
# loaded machine) before it ends those still running.
STARTED_RANKS_GRACE_SECONDS = 15.0


class LostRanks(Feature):
    """A feature of the Trainer's strategy (``lit_dp.strategies.feature``): a failed fit's error
    names the ranks that died (``note``), and a failed rank 0 ends the ranks it started."""

    def __init__(self) -> None:
        self._parent = os.getppid()

    @override
    def setup_environment(self, strategy: Any) -> None:
        """The ranks are started: in the process that started them under Lightning's script
        launcher, its observer thread waits ``OBSERVER_GRACE_SECONDS`` after a death."""
        if _started_ranks(strategy.launcher):
            _defer_lightnings_observer(OBSERVER_GRACE_SECONDS)

    @override
    def on_exception(self, exception: BaseException, strategy: Any) -> None:
        if not isinstance(exception, Exception):  # a stop (Preempted, Ctrl-C): nothing died
            return
        self.note(exception, strategy.launcher, strategy.node_rank, strategy.num_processes, strategy.global_rank)
        if not isinstance(exception, CollectiveHangError):  # a hang's verdict ends every rank itself, at once
            end_started_ranks(exception, strategy.launcher, strategy.node_rank, strategy.num_processes)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Pickled into a spawned rank: its parent is the process that spawned it.
        self.__dict__.update(state)
        self._parent = os.getppid()

    def note(self, exception: BaseException, launcher: Any, node_rank: int, num_processes: int, global_rank: int) -> None:
        """Add to ``exception`` a note per rank of this job known to have died (see the module docstring)."""
        try:
            self._note(exception, launcher, node_rank, num_processes, global_rank)
        except Exception:  # noqa: BLE001 - a diagnosis that fails must not replace the error it would explain
            log.debug("lit_dp: could not tell which rank died", exc_info=True)

    def _note(self, exception: BaseException, launcher: Any, node_rank: int, num_processes: int, global_rank: int) -> None:
        # Lightning's script launcher keeps the `Popen` of local ranks 1..n-1. Under its spawn/fork
        # launcher the parent runs no rank, and torch's own error already names the process.
        children = _started_ranks(launcher)
        deadline = time.monotonic() + EXIT_GRACE_SECONDS
        while children and not any(_exit_status(child) for child in children) and time.monotonic() < deadline:
            time.sleep(0.05)
        if any(_exit_status(child) for child in children):
            _stop_lightnings_observer()
        for local_rank, child in enumerate(children, start=1):
            status = _exit_status(child)
            if status:
                rank = node_rank * num_processes + local_rank
                exception.add_note(
                    f"lit_dp: rank {rank} (pid {child.pid}, started by this process) died: {_describe_status(status)}; "
                    "the error above is how its peers saw it. Its output went where this process's goes."
                )
        if global_rank != 0 and os.getppid() != self._parent:
            exception.add_note(
                f"lit_dp: the process that started this rank (pid {self._parent}, rank 0 under Lightning's script "
                "launcher) is gone; its output or log says why."
            )


def _defer_lightnings_observer(grace: float) -> None:
    """Lightning's observer sees a rank's death ``grace`` seconds late (see the module docstring)."""
    for thread in child_process_observers():
        check = observer_check(thread)
        children = observed_processes(thread)
        first_seen: list[float] = []

        def patient_check(check=check, children=children, first_seen=first_seen) -> bool:
            if not first_seen and any(_exit_status(child) for child in children):
                first_seen.append(time.monotonic())
            if first_seen and time.monotonic() - first_seen[0] < grace:
                return False
            return check()

        replace_observer_check(thread, patient_check)


def _stop_lightnings_observer() -> None:
    """Once this rank has seen a death it reports it and ends the others itself
    (``end_started_ranks``), so Lightning's thread must not end this process mid-report."""
    for thread in child_process_observers():
        replace_observer_check(thread, lambda: True)


def end_started_ranks(exception: BaseException, launcher: Any, node_rank: int, num_processes: int) -> None:
    """On a failed rank 0 under Lightning's script launcher: SIGKILL to each rank it started that is
    still running after ``STARTED_RANKS_GRACE_SECONDS``, with a note on ``exception`` naming it."""
    children = _started_ranks(launcher)
    deadline = time.monotonic() + STARTED_RANKS_GRACE_SECONDS
    while any(child.poll() is None for child in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    for local_rank, child in enumerate(children, start=1):
        if child.poll() is None:
            child.kill()
            child.wait()
            exception.add_note(
                f"lit_dp: rank {node_rank * num_processes + local_rank} (pid {child.pid}, started by this process) was "
                f"still running {STARTED_RANKS_GRACE_SECONDS:g} s after this rank failed, and was ended: without rank 0 "
                "it could not finish."
            )


def _started_ranks(launcher: Any) -> list[subprocess.Popen]:
    """The local ranks 1..n-1 Lightning's script launcher started (none under its spawn/fork launcher)."""
    return [child for child in getattr(launcher, "procs", None) or [] if isinstance(child, subprocess.Popen)]


def _exit_status(process: Any) -> int | None:
    """The child's exit status once it has exited with a failure; None while it runs or after a clean exit."""
    status = process.poll()
    return status or None


def _describe_status(status: int) -> str:
    if status < 0:
        name = signal.Signals(-status).name if -status in signal.valid_signals() else f"signal {-status}"
        return f"killed by {name} (exit status {status}; {128 - status} in a shell)"
    return f"exited with status {status}"
