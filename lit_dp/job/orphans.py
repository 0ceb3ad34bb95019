"""No orphans: a rank started by lit_dp's launcher ends with the process that started it.

Under Lightning's script launcher the launching process is rank 0 and starts ranks 1..N-1 of
its node as its subprocesses. When it died before its own handlers could act (SIGTERM during
start-up, before the fit installs them; SIGKILL or the OOM killer at any time), nothing told the
other ranks: a rank waiting in the rendezvous for the store rank 0 hosted, or in a collective,
waited out its timeout (30 minutes by default), re-parented to init, and a user who stopped a job
just started found a rank of it running minutes later.

lit_dp's launchers give each rank they start the launching process's pid in ``LAUNCHER_PID``
(``launcher_environment``), and ``bind_to_launcher``, which ``import lit_dp`` runs, binds a
process that has it to that launcher:

- on Linux, with ``prctl(PR_SET_PDEATHSIG, SIGKILL)``: the kernel kills the rank as its parent
  exits, however it exits, and nothing has to run in the rank for that (a rank blocked in C code
  goes as surely). SIGKILL rather than SIGTERM: without rank 0 the rank cannot finish the job
  nor save anything (rank 0 writes the checkpoints), and during a fit SIGTERM is only recorded,
  to stop at a step boundary the missing rank 0 never reaches (``lit_dp.strategies.preemption``).
  Then the rank checks that its parent is still the launcher: one that died before the binding
  (while the rank was importing torch) is caught too. The signal is sent when the thread that
  started the rank ends: Lightning starts them from the thread that calls ``fit``.
- elsewhere (macOS has no parent-death signal), a daemon thread polls the parent's pid every
  ``POLL_SECONDS`` and ends the rank once it has changed.

The variable is removed once read: what the rank starts itself (DataLoader workers, a
subprocess) is not bound to the rank's parent. Under torchrun, SLURM or Paddle's launcher the
launcher ends its workers itself, and the variable is not set.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

LAUNCHER_PID = "LIT_DP_LAUNCHER_PID"
POLL_SECONDS = 1.0
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# The status of a rank that finds its launcher gone: a process killed by SIGKILL reports 137 in a shell.
GONE_STATUS = 128 + signal.SIGKILL


def launcher_environment(environment: dict[str, str]) -> dict[str, str]:
    """``environment`` for a rank this process starts, bound to this process (``bind_to_launcher``)."""
    return {**environment, LAUNCHER_PID: str(os.getpid())}


@contextmanager
def binding_started_ranks() -> Iterator[None]:
    """Within it, the ranks this process starts with a copy of its environment (as Lightning's
    script launchers do) are bound to this process; this process's own environment is left as it was."""
    os.environ[LAUNCHER_PID] = str(os.getpid())
    try:
        yield
    finally:
        os.environ.pop(LAUNCHER_PID, None)


def bind_to_launcher() -> None:
    """In a rank a lit_dp launcher started (``LAUNCHER_PID`` set): end this process with its launcher
    (see the module docstring). Elsewhere nothing; a malformed value is refused, naming it."""
    raw = os.environ.pop(LAUNCHER_PID, None)
    if raw is None:
        return
    try:
        launcher = int(raw)
    except ValueError:
        raise ValueError(f"{LAUNCHER_PID}={raw!r} is invalid: expected the pid of the process that started this rank "
                         "(lit_dp's launchers set it; unset it to run this process on its own).") from None
    if not _parent_death_signal(signal.SIGKILL):
        threading.Thread(target=_watch_parent, args=(launcher,), daemon=True, name="lit_dp-launcher-watch").start()
    if os.getppid() != launcher:  # gone before the binding: no parent-death signal will come
        _end(launcher)


def _parent_death_signal(signum: int) -> bool:
    """``prctl(PR_SET_PDEATHSIG, signum)`` for this process; False where the platform has none."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0


def _watch_parent(launcher: int) -> None:
    while os.getppid() == launcher:
        time.sleep(POLL_SECONDS)
    _end(launcher)


def _end(launcher: int) -> None:
    print(f"[lit_dp] local rank {os.environ.get('LOCAL_RANK', '?')} (pid {os.getpid()}): the process that started it "
          f"(pid {launcher}) is gone; ending it", file=sys.stderr, flush=True)
    os._exit(GONE_STATUS)
