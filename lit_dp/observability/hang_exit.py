"""How the processes of a job declared hung end, whatever they are doing and whoever launched them.

The hang watchdog (``lit_dp.observability.watchdog``) decides; this module acts on one process:

- a process that can run Python gets ``CollectiveHangError`` raised in its main thread
  (``raise_in_main_thread``: Python delivers it at the next bytecode, so the training loop's own
  error handling runs) and, if it is still alive ``grace`` seconds later (its main thread is
  blocked in C, or swallowed the error), its stacks are written to stderr and it exits with
  status 1 (``exit_after``);
- a process that cannot (C code holding the GIL, so no Python thread of it runs) is asked for
  its stacks by a peer on its host with ``STACK_SIGNAL``, which its ``faulthandler`` answers
  from C, then killed (``end_processes``). Each process registers that handler, and its
  identity (host, pid, start time: a reused pid is never signalled), when its watchdog starts.

Nothing here is process-global state that another user could clobber (no
``faulthandler.dump_traceback_later``): the timers are threads, one per watchdog.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

from lit_dp.gradients.waiting import CollectiveHangError

# A real-time signal no library we know of uses: on it faulthandler writes every thread's stack
# from C, which works while another thread holds the GIL. None where the platform has none.
STACK_SIGNAL = signal.SIGRTMIN + 7 if hasattr(signal, "SIGRTMIN") else None

_stack_signal_registered = False


def register_stack_signal() -> None:
    """Let a peer ask this process for its stacks (``STACK_SIGNAL``), answered from C; once per process."""
    global _stack_signal_registered
    if _stack_signal_registered or STACK_SIGNAL is None:
        return
    try:
        faulthandler.register(STACK_SIGNAL, file=sys.stderr, all_threads=True, chain=False)
    except (AttributeError, OSError, RuntimeError, ValueError):  # a stderr without a file descriptor
        return
    _stack_signal_registered = True


def this_process() -> dict[str, Any]:
    """What a peer needs to signal this process, and only this one."""
    return {"host": socket.gethostname(), **_identity(os.getpid())}


def _identity(pid: int) -> dict[str, Any]:
    """A process's pid and start time (``/proc``), so that a reused pid is never signalled."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            started = file.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        started = None
    return {"pid": pid, "started": started}


def end_processes(registered: list[dict[str, Any]]) -> list[int]:
    """Ask the processes of ``registered`` (``this_process`` of each) on this host for their stacks,
    then kill them; returns the pids signalled. Processes elsewhere, or gone, are left alone."""
    host = socket.gethostname()
    pids = [
        process["pid"]
        for process in registered
        if process["host"] == host
        and process["started"] is not None
        and _identity(process["pid"])["started"] == process["started"]
    ]
    if not pids or STACK_SIGNAL is None:
        return []
    for pid in pids:
        _signal(pid, STACK_SIGNAL)
    time.sleep(1.0)  # faulthandler writes from C at once; this is for a loaded machine
    for pid in pids:
        _signal(pid, signal.SIGKILL)
    return pids


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except OSError:
        pass  # gone already


class _Verdict(CollectiveHangError):
    """The verdict raised in the main thread from another thread: Python instantiates the class
    without arguments, so the message is the one set last."""

    message = ""

    def __init__(self, *args: object) -> None:
        super().__init__(*(args or (self.message,)))


def raise_in_main_thread(message: str) -> None:
    """Raise ``CollectiveHangError(message)`` in the main thread, at its next bytecode."""
    _Verdict.message = message
    main = threading.main_thread().ident
    if main is not None and threading.current_thread() is not threading.main_thread():
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(main), ctypes.py_object(_Verdict))


def exit_after(grace: float, rank: int, verdict: str = "the job was declared hung") -> None:
    """In ``grace`` seconds, unless the process has ended: its stacks to stderr, then exit status 1.

    ``verdict`` says why the job ends: a hang, or replicas that diverged
    (``lit_dp.observability.consistency``), which ends every rank the same way."""
    timer = threading.Timer(grace, _hard_exit, args=(rank, grace, verdict))
    timer.daemon = True
    timer.name = f"lit_dp: exit of rank {rank}"
    timer.start()


def _hard_exit(rank: int, grace: float, verdict: str) -> None:
    try:
        print(
            f"lit_dp: rank {rank} did not end within {grace:g}s of the verdict ({verdict}); its stacks follow, "
            "then it exits with status 1.",
            file=sys.stderr,
            flush=True,
        )
        faulthandler.dump_traceback(sys.stderr, all_threads=True)
        sys.stdout.flush()
    finally:
        os._exit(1)
