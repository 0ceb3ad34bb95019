"""How lit_dp waits for its own collectives: plainly, or watched for a hang.

Every wait of lit_dp's (a bucket's collectives, a communication hook's future, the broadcast of
the bucket order, a LocalSGD average, sharding's gathers and norm, Join's exchanges, the
Trainer's per-batch exchange of uneven inputs) goes through the ``Waiter`` of the
``DataParallel`` it serves, and so do, through ``outside``, the collectives lit_dp only watches
(the strategy's ``barrier``, ``broadcast`` and ``reduce``, torch's Join loop). It waits as torch
does until the hang watchdog (``lit_dp.observability.watchdog``) calls ``watch``; from then on:

- **Bounded** (Gloo, and any backend whose work completes on the host): a wait is a loop of
  ``work.wait(slice)``; past the deadline it calls ``on_hang``, which diagnoses the hang and
  raises (or returns, when the hang is excused and the wait goes on); once the job has been
  declared hung (``verdict``) the wait raises ``CollectiveHangError`` at its next slice.
- **On the device** (NCCL): ``work.wait()`` only makes the current CUDA stream wait, and a
  work's future is complete as soon as the work is enqueued. torch's documentation of
  ``Work.get_future`` says so: "For GPU work, ``fut.done()`` returns true only whether the
  operation has been enqueued", and of ``Work.wait``: "calling wait() is the same as calling
  synchronize(): Letting the current stream block on the completion of the NCCL work. However,
  if timeout is set, it will block the CPU thread" (so a deadline on the wait itself would
  synchronise the host at every bucket). So each wait leaves an ``InFlight`` record, which the
  watchdog's thread polls without blocking: ``Work.is_completed()`` (which queries NCCL's end
  events, as torch's own NCCL watchdog does) while the main thread is inside the wait, then a
  CUDA event recorded on the current stream after it (which completes when the collective
  does: the stream waits for it), so that the work and the tensors it holds are not kept.
  Only the oldest record is judged: collectives on a stream complete in order, so a later one
  is late because of it, and its clock starts when the one before it completed.

Once ``time_waits`` was called (by the step clock, ``lit_dp.observability.step_clock``), every wait
also adds its length to ``waited``: the time this rank spent waiting for its peers and for
communication, which the straggler report calls its exposed wait. The watched path reads the
clock at the start of a wait anyway (``since``); the end is one more read.

A record's deadline is fixed when it starts (the watchdog's long deadline during warm-up), and a
wait during which a peer was seen in a known phase (``excused_since``: a checkpoint write, an
evaluation) gets the long deadline instead. The module sits in ``gradients`` so that the
buckets can use it without knowing the watchdog, which lives above.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


class CollectiveHangError(RuntimeError):
    """A lit_dp collective waited longer than ``hang_timeout`` (or this rank was named in such a
    diagnosis); the message is the watchdog's diagnosis (which rank is where, and where their
    stacks were written)."""


def _completed() -> bool:
    return True


def _inside() -> bool:
    return False


class InFlight:
    """One collective being waited for, or still in flight on the device after its wait.

    ``probe()`` says, without blocking, whether it completed; ``started`` is when its clock
    started (its wait, or the completion of the record before it, whichever is later).
    """

    __slots__ = ("what", "since", "started", "deadline", "probe")

    def __init__(self, what: str, since: float, deadline: float, probe: Callable[[], bool]) -> None:
        self.what = what
        self.since = since
        self.started = since
        self.deadline = deadline
        self.probe = probe


class Waiter:
    """Waits for a ``dist.Work`` or a future. ``what`` names the collective for a diagnosis
    ("" for a bucket, which the watchdog finds among the launches it saw); ``waiting`` is what
    the calling thread waits for now, and since when (read by the watchdog's thread)."""

    def __init__(self) -> None:
        self.deadline: float | None = None  # seconds; None: not watched
        self.long_deadline: float | None = None  # for waits overlapping a peer's known phase
        self.bounded = True
        self.slice = 1.0  # seconds a bounded wait blocks before it looks at the verdict and the clock
        self.device: torch.device | None = None  # where the collectives' results live (CUDA: events)
        self.waiting: tuple[str, float] | None = None
        # time.monotonic() when a peer was last seen in a known phase (``excuse``, from the watchdog's thread).
        self.excused_since = -float("inf")
        self.verdict: str | None = None  # the diagnosis, once the job was declared hung (``declare``)
        self._on_hang: Callable[[str, float], None] | None = None
        self._in_flight: deque[InFlight] = deque()
        self._lock = threading.Lock()
        # Seconds the waiting threads spent in waits (time.monotonic), summed once ``time_waits`` was called.
        self.waited = 0.0
        self._timed = False

    def watch(
        self,
        deadline: float,
        on_hang: Callable[[str, float], None],
        *,
        bounded: bool,
        long_deadline: float | None = None,
        device: torch.device | None = None,
        slice_seconds: float = 1.0,
    ) -> None:
        """From now on a wait longer than ``deadline`` seconds is a hang.

        ``bounded``: the wait itself carries the deadline and calls ``on_hang(what, since)``
        past it (on the main thread); otherwise ``overdue`` tells the watchdog's thread.
        ``on_hang`` raises, or returns when the hang is excused (the wait goes on).
        """
        self.deadline, self._on_hang, self.bounded = deadline, on_hang, bounded
        self.long_deadline = max(deadline, long_deadline or deadline)
        self.device, self.slice = device, slice_seconds

    def time_waits(self) -> None:
        """From now on every wait adds its length to ``waited`` (the step clock asks)."""
        self._timed = True

    def end_warmup(self, deadline: float) -> None:
        """Warm-up is over: waits started from now on are hangs past ``deadline`` seconds."""
        self.deadline = deadline

    def excuse(self, now: float) -> None:
        """A peer was seen in a known phase at ``now``: a wait overlapping it gets the long deadline."""
        self.excused_since = now

    def declare(self, verdict: str) -> None:
        """The job was declared hung: every wait, and every wait being entered, raises ``verdict``."""
        self.verdict = verdict

    def wait(self, work: dist.Work, what: str = "") -> None:
        if self.deadline is None:
            if not self._timed:
                work.wait()
                return
            since = time.monotonic()
            try:
                work.wait()
            finally:
                self.waited += time.monotonic() - since
            return
        self._raise_verdict()
        since = time.monotonic()
        self.waiting = (what, since)
        try:
            if self.bounded:
                self._wait_bounded(work, what, since)
            else:
                record = self._start_record(what, since, work.is_completed)
                work.wait()
                self._after_wait(record, work.is_completed)
        finally:
            self.waiting = None
            self.waited += time.monotonic() - since

    def wait_future(self, future: torch.futures.Future, what: str = "") -> Any:
        if self.deadline is None:
            if not self._timed:
                return future.wait()
            since = time.monotonic()
            try:
                return future.wait()
            finally:
                self.waited += time.monotonic() - since
        self._raise_verdict()
        since = time.monotonic()
        self.waiting = (what, since)
        try:
            if self.bounded:
                self._wait_for_callback(future, what, since)
                return future.wait()
            record = self._start_record(what, since, future.done)
            value = future.wait()
            self._after_wait(record, None)
            return value
        finally:
            self.waiting = None
            self.waited += time.monotonic() - since

    @contextmanager
    def outside(self, what: str) -> Iterator[None]:
        """Watch a collective whose wait is not lit_dp's (the strategy's ``barrier``, torch's Join
        loop): the watchdog's thread judges it, and on CUDA the device's completion after it; its
        length counts in ``waited`` (unwatched too, once waits are timed)."""
        record = self.enter(what)
        since = record.since if record is not None else time.monotonic() if self._timed else None
        try:
            yield
        finally:
            self.leave(record)
            if since is not None:
                self.waited += time.monotonic() - since

    def enter(self, what: str) -> InFlight | None:
        """The calling thread enters a wait lit_dp cannot bound itself (``outside``, as two calls)."""
        if self.deadline is None:
            return None
        # After the verdict a collective would block until the hard exit (a strategy's barrier
        # at teardown): the verdict is raised at once instead.
        self._raise_verdict()
        since = time.monotonic()
        self.waiting = (what, since)
        return self._start_record(what, since, _inside)

    def leave(self, record: InFlight | None) -> None:
        self.waiting = None
        if record is not None:
            self._after_wait(record, None)

    def overdue(self, now: float) -> InFlight | None:
        """The oldest record not completed, if it is past its deadline (for the watchdog's thread)."""
        with self._lock:
            head = self._retire(now)
        if head is not None and now - head.started > self._limit(head.deadline, head.started):
            return head
        return None

    def oldest_in_flight(self) -> InFlight | None:
        """The oldest record not completed (for a report)."""
        with self._lock:
            return self._retire(time.monotonic())

    def past_deadline(self, since: float, deadline: float, now: float) -> bool:
        return now - since > self._limit(deadline, since)

    def _limit(self, deadline: float, since: float) -> float:
        long = self.long_deadline or deadline
        return max(deadline, long) if self.excused_since >= since else deadline

    def _wait_bounded(self, work: dist.Work, what: str, since: float) -> None:
        deadline = self.deadline
        assert deadline is not None
        step = timedelta(seconds=self.slice)
        while True:
            try:
                work.wait(step)
                return
            except RuntimeError:
                if work.is_completed():
                    # Completed since the slice ran out: this returns, or raises the collective's
                    # own failure (a peer gone), which is not the deadline.
                    work.wait(step)
                    return
            self._check(what, since, deadline)

    def _wait_for_callback(self, future: torch.futures.Future, what: str, since: float) -> None:
        deadline = self.deadline
        assert deadline is not None
        if future.done():
            return
        arrived = threading.Event()
        future.add_done_callback(lambda _: arrived.set())
        while not arrived.wait(self.slice):
            self._check(what, since, deadline)

    def _raise_verdict(self) -> None:
        if self.verdict is not None:
            raise CollectiveHangError(self.verdict)

    def _check(self, what: str, since: float, deadline: float) -> None:
        """Between slices of a bounded wait: raise the verdict, or call ``on_hang`` past the deadline."""
        self._raise_verdict()
        if self.past_deadline(since, deadline, time.monotonic()) and self._on_hang is not None:
            self._on_hang(what, since)

    def _start_record(self, what: str, since: float, probe: Callable[[], bool]) -> InFlight:
        assert self.deadline is not None
        record = InFlight(what, since, self.deadline, probe)
        with self._lock:
            self._retire(since)
            self._in_flight.append(record)
        return record

    def _after_wait(self, record: InFlight, completed: Callable[[], bool] | None) -> None:
        """The calling thread's wait returned: keep the record until the device says it completed.

        ``completed``: the work's own answer (``Work.is_completed``), or None where there is none
        that reflects the device (a future, a collective issued by others)."""
        if completed is not None and completed():
            record.probe = _completed
        elif self.device is not None and self.device.type == "cuda":
            # The current stream now waits for the collective: an event after it completes with it,
            # and holds no tensor (a kept work would hold its gradients until the next look).
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            record.probe = event.query
        else:
            record.probe = completed or _completed

    def _retire(self, now: float) -> InFlight | None:
        """Drop completed records from the front (under the lock); the new front's clock starts now."""
        records = self._in_flight
        while records and records[0].probe():
            records.popleft()
            if records:
                records[0].started = max(records[0].started, now)
        return records[0] if records else None


UNWATCHED = Waiter()  # for collectives outside a reducer (fused_allreduce_gradients); never watched
