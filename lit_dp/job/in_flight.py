"""The tensors of collectives that may outlive the code that started them, kept until the backend lets go.

Gloo runs each collective on a worker thread of its own, which holds the collective's tensors
until it has finished with them: a little after the collective completed (after ``wait()``
returned) and, for one nobody waits for, whenever the other ranks arrive. If Python's last
reference to such a tensor is gone by then, the worker frees the tensor's Python object itself,
which takes the GIL; once the interpreter has begun to end it cannot, and the process aborts
("terminate called without an active exception", SIGABRT) after a run that succeeded (pytorch
issue 190489; ``destroy_process_group()`` does not stop Gloo's threads while anything still holds
the group). A run ends that way when a feature's exchange started at the last step is read at
the end of the run, or dropped unread (a fit that raised, a Fabric script that ends without
``teardown()``).

Those features hand the exchange's tensors to ``keep`` when they start it. A kept tensor is let
go once the backend has (its use count back at 1: Python's reference alone); at exit, before
the process group is destroyed, ``wait_before_exit`` waits for that with the GIL released, up
to a bound: a collective whose peers died never completes, and its worker never lets go.
"""

from __future__ import annotations

import atexit
import threading
import time

import torch

# How long the end of a process waits for the backend to let go of kept tensors: a collective
# still unfinished after it waits for a rank that is gone.
EXIT_WAIT_SECONDS = 2.0
_POLL_SECONDS = 0.001

_lock = threading.Lock()
_kept: list[tuple[torch.Tensor, ...]] = []


def keep(*tensors: torch.Tensor) -> None:
    """Hold ``tensors``, handed to a collective just started, until the backend lets go of them."""
    with _lock:
        _let_go_of_released()
        _kept.append(tensors)


def held() -> int:
    """How many collectives' tensors are still kept."""
    with _lock:
        _let_go_of_released()
        return len(_kept)


def wait_before_exit(timeout: float = EXIT_WAIT_SECONDS) -> None:
    """Wait, the GIL released, until the backend let go of every kept tensor or ``timeout`` passed.

    The GIL is released at least once: a Gloo worker already waiting for it to free what a
    collective of Lightning's or the user's left (not kept here) gets it before the interpreter ends."""
    deadline = time.monotonic() + timeout
    while True:
        time.sleep(_POLL_SECONDS)
        if not held() or time.monotonic() >= deadline:
            return


def _let_go_of_released() -> None:
    _kept[:] = [tensors for tensors in _kept if any(tensor._use_count() > 1 for tensor in tensors)]


# For a group this process did not create (no `destroy_parallel_env` at exit), at the latest.
atexit.register(wait_before_exit)
