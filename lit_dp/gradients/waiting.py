"""How lit_dp waits for its own collectives: plainly, or with a deadline that names a hang.

Every wait of lit_dp's (a bucket's all-reduces, a communication hook's future, the broadcast of
the bucket order, a LocalSGD average, Join's exchanges, the Trainer's per-batch exchange of
uneven inputs) goes through the reducer's ``Waiter``. It waits as torch does until the hang
watchdog (``lit_dp.observability.watchdog``) calls ``watch``: from then on a wait on Gloo ends
after ``deadline`` seconds (Gloo's ``work.wait(timeout)`` raises) and calls ``on_hang``, which
diagnoses the hang and raises, instead of sitting until the process group's timeout. On NCCL a
wait only orders the GPU stream, so a deadline would synchronise the host at every bucket:
there waits stay plain and the watchdog's thread watches them. The module sits in
``gradients`` so that the buckets can use it without knowing the watchdog, which lives above.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist


class CollectiveHangError(RuntimeError):
    """A lit_dp collective waited longer than ``hang_timeout``; the message is the watchdog's
    diagnosis (which rank is where, and where their stacks were written)."""


class Waiter:
    """Waits for a ``dist.Work`` or a future. ``what`` names the collective for a diagnosis
    ("" for a bucket, which the watchdog finds among the launches it saw); ``waiting`` is what
    the calling thread waits for now, and since when (read by the watchdog's thread)."""

    def __init__(self) -> None:
        self.deadline: float | None = None
        self._timeout: timedelta | None = None
        self._on_hang: Callable[[str, float], NoReturn] | None = None
        self.waiting: tuple[str, float] | None = None

    def watch(self, deadline: float, on_hang: Callable[[str, float], NoReturn]) -> None:
        """From now on, a wait longer than ``deadline`` seconds calls ``on_hang(what, since)``."""
        self.deadline, self._timeout, self._on_hang = deadline, timedelta(seconds=deadline), on_hang

    def wait(self, work: dist.Work, what: str = "") -> None:
        if self._timeout is None:
            work.wait()
            return
        since = time.monotonic()
        self.waiting = (what, since)
        try:
            work.wait(self._timeout)
        except RuntimeError:
            if time.monotonic() - since < self.deadline or self._on_hang is None:  # type: ignore[operator]
                raise  # a failure of the collective (a peer gone), not the deadline
            self._on_hang(what, since)
        finally:
            self.waiting = None

    def wait_future(self, future: torch.futures.Future, what: str = "") -> Any:
        if self._timeout is not None and not future.done():
            arrived = threading.Event()
            future.add_done_callback(lambda _: arrived.set())
            since = time.monotonic()
            self.waiting = (what, since)
            try:
                if not arrived.wait(self.deadline) and self._on_hang is not None:
                    self._on_hang(what, since)
            finally:
                self.waiting = None
        return future.wait()


UNWATCHED = Waiter()  # for collectives outside a reducer (fused_allreduce_gradients); never watched
