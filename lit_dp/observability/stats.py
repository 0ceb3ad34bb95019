"""Per-step communication statistics of the reducer, measured on every rank.

For each synchronised step the reducer tells a ``CommObserver`` six moments
(``lit_dp.gradients.events``): the step
starts (the forward armed the reducer), the first gradient is ready (backward is under way), a
bucket's last gradient is ready, its all-reduce was launched, backward ended (the autograd
engine ran the reducer's end-of-backward callback: the last gradient is ready) and every bucket
was reduced. From them:

- ``bytes``: gradient bytes all-reduced (the parameters' own bytes; the reducer's per-parameter
  flags are not counted);
- ``buckets``: buckets launched;
- ``time_ms``: communication time, the time during which at least one bucket's all-reduce was in
  flight (from its launch to its completion; overlapping all-reduces count once);
- ``exposed_ms``: the part of that time after backward ended, i.e. what communication added to
  the step once the last gradient was ready;
- ``overlap``: the share of communication time hidden under backward, ``1 - exposed / time``.

The step's moments are the step clock's (``lit_dp.observability.step_clock``), which takes them
once for every observer; the buckets' ready moments, launches and completions are this
observer's own. The per-bucket timeline of each step goes to the sinks it is given: the trace
writer, and the run's communication profile (``lit_dp.observability.profile``), which the
forecast (``python -m lit_dp.forecast``) reads.
Clocks (``lit_dp.observability.clocks``). On CPU, host time (``time.monotonic``); a bucket
completes when the training thread first sees its futures done: it looks at every moment the
reducer tells (each bucket ready and launched, backward's end, each bucket's wait returning), so an
all-reduce that ends during backward is marked at the next of them (its end then only a bound,
``BucketSpan.end_bounded``) and one waited for when its wait returns. A callback on the future
would mark it sooner, but Gloo runs callbacks on its own thread, which must then take the
interpreter lock from the training thread before it goes on to the next collective: on 2 CPU
ranks of the digits recipe with 3 buckets that cost 1.4 to 1.8 ms of a 5.6 ms step. On CUDA every
moment is a ``torch.cuda.Event`` recorded on the current stream; a bucket's completion event is
recorded in its future's callback, which runs on a stream made to wait on the communicator's
stream, so the event fires when the all-reduce does. Nothing synchronises the host: events are
read lazily, once ``query()`` says they completed, when statistics are asked for or at the next
step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from typing_extensions import override

from lit_dp.gradients.events import BucketLaunch, ReducerObserver
from lit_dp.gradients.plan import StepPlan
from lit_dp.observability.clocks import CudaClock, HostClock, clock_for
from lit_dp.observability.step_clock import StepClock, StepMarks


@dataclass(frozen=True)
class CommStats:
    """The communication of one synchronised step on one rank (see the module docstring)."""

    step: int
    bytes: int
    buckets: int
    time_ms: float
    exposed_ms: float
    overlap: float

    def as_metrics(self) -> dict[str, float]:
        """The ``comm/*`` names the Lightning strategy logs."""
        return {
            "comm/bytes": float(self.bytes),
            "comm/buckets": float(self.buckets),
            "comm/time_ms": self.time_ms,
            "comm/exposed_ms": self.exposed_ms,
            "comm/overlap": self.overlap,
        }


@dataclass(frozen=True)
class BucketSpan:
    """One bucket's all-reduce in host seconds: launch (the collective was enqueued) to completion,
    and when its last gradient was ready (None: never in backward; it was launched at backward's
    end, or in a step without one). ``end_bounded``: on the host clock, the all-reduce was seen done at a
    look before backward ended, so ``end`` only bounds its completion from above (see the module docstring)."""

    index: int
    bytes: int
    indices: tuple[int, ...]  # the reducer's parameter indices
    launch: float
    end: float
    ready: float | None = None
    end_bounded: bool = False


@dataclass(frozen=True)
class StepTimeline:
    """One synchronised step's moments, in host seconds (``time.monotonic``'s clock)."""

    step: int
    start: float
    backward_start: float
    backward_end: float
    reduced: float
    buckets: tuple[BucketSpan, ...]
    host_work_ms: float | None = None  # the reducer's own host work (``Reducer.host_work_ms``), if timed
    gradients_ready_ms: tuple[float | None, ...] | None = None  # ``Reducer.gradients_ready_ms``, if timed

    def stats(self) -> CommStats:
        spans = sorted((bucket.launch, bucket.end) for bucket in self.buckets)
        total = exposed = 0.0
        run_start, run_end = spans[0] if spans else (0.0, 0.0)
        for launch, end in [*spans[1:], (float("inf"), float("inf"))]:
            if launch > run_end:  # a gap: close the current run of overlapping all-reduces
                total += run_end - run_start
                exposed += max(0.0, run_end - max(run_start, self.backward_end))
                run_start, run_end = launch, end
            else:
                run_end = max(run_end, end)
        return CommStats(
            step=self.step,
            bytes=sum(bucket.bytes for bucket in self.buckets),
            buckets=len(self.buckets),
            time_ms=total * 1e3,
            exposed_ms=exposed * 1e3,
            overlap=1.0 - exposed / total if total > 0 else 1.0,
        )


class _StepRecord:
    """One step: the step clock's marks, and the buckets' (completion marks filled in as the all-reduces complete)."""

    __slots__ = ("marks", "buckets", "ready", "host_work_ms", "gradients_ready_ms", "ended_in_backward")

    def __init__(self, marks: StepMarks) -> None:
        self.marks = marks
        # (position, bytes, parameter indices, launch mark, one completion slot per collective, ready mark or None)
        self.buckets: list[tuple[int, int, list[int], Any, list[Any], Any]] = []
        self.ready: dict[int, Any] = {}  # position -> ready mark, until the bucket launches
        self.host_work_ms: float | None = None
        self.gradients_ready_ms: tuple[float | None, ...] | None = None
        self.ended_in_backward: set[int] = set()  # positions seen done by backward's end, on the host clock


class CommObserver(ReducerObserver):
    """Records the reducer's moments and resolves them into ``CommStats`` and ``StepTimeline``s.

    Args:
        device: the parameters' device; CUDA selects event timing.
        clock: the step clock, subscribed before this observer, whose marks it reads.
        timeline_sinks: called with each resolved step's timeline (the trace writer's ``add``).
        host_work: the reducer's ``host_work_ms``, read into each timeline when backward ends; None: not timed.
        gradients_ready: the reducer's ``gradients_ready_ms``, read alike; None: not timed.
    """

    def __init__(
        self,
        device: torch.device,
        clock: StepClock,
        timeline_sinks: Sequence[Callable[[StepTimeline], None]] = (),
        host_work: Callable[[], float] | None = None,
        gradients_ready: Callable[[], tuple[float | None, ...] | None] | None = None,
    ) -> None:
        self._clock = clock_for(device)
        self._step_clock = clock
        self._sinks = list(timeline_sinks)
        self._host_work = host_work
        self._gradients_ready = gradients_ready
        self._current: _StepRecord | None = None
        self._pending: deque[_StepRecord] = deque()
        self._last: CommStats | None = None
        self._totals = [0, 0.0, 0.0]  # steps, time_ms, exposed_ms (steps after the first)
        # On the host clock: (completion slots, slot, future) of the collectives not yet seen complete.
        self._unseen: list[tuple[list[Any], int, torch.futures.Future]] = []

    # The reducer's moments ------------------------------------------------------------------

    @override
    def step_started(self, step: int, plan: StepPlan) -> None:
        self._resolve()
        marks = self._step_clock.current
        self._current = _StepRecord(marks) if marks is not None and marks.step == step else None

    @override
    def bucket_ready(self, step: int, position: int) -> None:
        record = self._current
        if record is not None:
            record.ready[position] = self._clock.mark()
        self._see_completed()

    @override
    def bucket_launched(self, launch: BucketLaunch) -> None:
        record = self._current
        if record is None or not launch.futures:  # nothing is sent in a group of one rank
            return
        slots: list[Any] = [None] * len(launch.futures)
        ready = record.ready.pop(launch.position, None)
        record.buckets.append((launch.position, launch.nbytes, launch.indices, self._clock.mark(), slots, ready))
        if isinstance(self._clock, CudaClock):
            for slot, future in enumerate(launch.futures):
                future.then(_completion_callback(slots, slot, self._clock.mark))
            return
        self._unseen += [(slots, slot, future) for slot, future in enumerate(launch.futures)]
        self._see_completed()

    @override
    def backward_ended(self, step: int) -> None:
        record = self._current
        if record is not None and self._host_work is not None:
            record.host_work_ms = self._host_work()  # every hook has run
        if record is not None and self._gradients_ready is not None:
            record.gradients_ready_ms = self._gradients_ready()
        self._see_completed()
        if record is not None and isinstance(self._clock, HostClock):
            pending = {id(slots) for slots, _, _ in self._unseen}
            record.ended_in_backward = {bucket[0] for bucket in record.buckets if id(bucket[4]) not in pending}

    @override
    def bucket_waited(self, step: int, position: int) -> None:
        self._see_completed()

    def _see_completed(self) -> None:
        """On the host clock, mark now each collective whose future is done since the last look."""
        if not self._unseen:
            return
        now = self._clock.mark()
        unseen = []
        for slots, slot, future in self._unseen:
            if future.done():
                slots[slot] = now
            else:
                unseen.append((slots, slot, future))
        self._unseen = unseen

    @override
    def step_ended(self, step: int) -> None:
        self._see_completed()
        record = self._current
        if record is None:
            return
        self._pending.append(record)
        self._current = None
        if isinstance(self._clock, HostClock):
            # Every bucket was waited for and seen complete: resolve now, so a trace ending at
            # this step is written without waiting for another step.
            self._resolve()

    # Reading ---------------------------------------------------------------------------------

    def last(self) -> CommStats | None:
        """The latest step whose measurements are complete (no host synchronisation)."""
        self._resolve()
        return self._last

    def mean(self) -> dict[str, float]:
        """Mean ``time_ms`` and ``exposed_ms`` over the resolved steps after the first, and the
        ``overlap`` of their sums (the share of all communication time that was hidden)."""
        self._resolve()
        steps, time_ms, exposed_ms = self._totals
        if not steps:
            return {}
        overlap = 1.0 - exposed_ms / time_ms if time_ms > 0 else 1.0
        return {"time_ms": time_ms / steps, "exposed_ms": exposed_ms / steps, "overlap": overlap}

    def flush(self) -> None:
        """Resolve every finished step, waiting for the device if needed."""
        if self._pending and isinstance(self._clock, CudaClock):
            torch.cuda.synchronize()
        self._resolve()

    def _resolve(self) -> None:
        clock = self._clock
        while self._pending:
            record = self._pending[0]
            step = record.marks
            marks = [step.start, step.backward_start, step.backward_end, step.reduced]
            marks += [bucket[3] for bucket in record.buckets]
            marks += [bucket[5] for bucket in record.buckets if bucket[5] is not None]
            marks += [slot for bucket in record.buckets for slot in bucket[4]]
            if not all(clock.done(mark) for mark in marks):
                return
            self._pending.popleft()
            self._account(self._timeline(record))

    def _timeline(self, record: _StepRecord) -> StepTimeline:
        step = record.marks

        def host(mark: Any) -> float:
            return self._clock.to_host(mark, step.start, step.start_host)

        spans = []
        for position, nbytes, indices, launch, slots, ready in record.buckets:
            launched = host(launch)
            # A tiny all-reduce can finish before the launch mark is taken, right after it was enqueued.
            end = max(launched, max(host(slot) for slot in slots))
            ready_at = None if ready is None else host(ready)
            bounded = position in record.ended_in_backward
            spans.append(BucketSpan(position, nbytes, tuple(indices), launched, end, ready_at, bounded))
        return StepTimeline(
            step=step.step,
            start=step.start_host,
            backward_start=host(step.backward_start),
            backward_end=host(step.backward_end),
            reduced=host(step.reduced),
            buckets=tuple(spans),
            host_work_ms=record.host_work_ms,
            gradients_ready_ms=record.gradients_ready_ms,
        )

    def _account(self, timeline: StepTimeline) -> None:
        stats = timeline.stats()
        self._last = stats
        if stats.step > 0:  # the first step runs in registration-order buckets, before the rebuild
            totals = self._totals
            totals[0] += 1
            totals[1] += stats.time_ms
            totals[2] += stats.exposed_ms
        for sink in self._sinks:
            sink(timeline)


def _completion_callback(
    slots: list[Any], slot: int, mark: Callable[[], Any]
) -> Callable[[torch.futures.Future], None]:
    def on_complete(_future: torch.futures.Future) -> None:
        slots[slot] = mark()

    return on_complete


@dataclass(frozen=True)
class SyncStats:
    """One LocalSGD average on one rank: its step, the bytes this rank all-reduced (the payload as it
    travels: in a ``sync_dtype``, encoded, scales included), its time from the first launch to the
    parameters replaced, and the part of it spent waiting for the collectives once the first were all
    launched, and applying the result (``exposed_ms``: without ``sync_delay`` nothing overlaps an
    average, so it is most of ``time_ms``; with it, the wait for a wire format's exchange of chunks
    at the start and the wait when the sync is applied)."""

    step: int
    bytes: int
    time_ms: float
    exposed_ms: float

    def as_metrics(self) -> dict[str, float]:
        """The ``local_sgd/*`` names the Lightning strategy logs."""
        return {
            "local_sgd/sync_bytes": float(self.bytes),
            "local_sgd/sync_time_ms": self.time_ms,
            "local_sgd/sync_exposed_ms": self.exposed_ms,
        }


class SyncRecorder:
    """``lit_dp.LocalSGD``'s averages: three marks each (start, all launched, done), resolved when read
    (on CUDA once the events completed, without a host synchronisation)."""

    def __init__(self, device: torch.device) -> None:
        self._clock = clock_for(device)
        self._pending: deque[tuple[int, int, Any, Any, tuple[Any, Any] | None, Any]] = deque()
        self._last: SyncStats | None = None
        self._totals = [0, 0, 0.0, 0.0, 0]  # averages, bytes, time_ms, exposed_ms, the largest average's bytes

    def mark(self) -> Any:
        return self._clock.mark()

    def record(self, step: int, nbytes: int, began: Any, launched: Any, exposed_before: tuple[Any, Any] | None = None) -> None:
        """The average after optimizer step ``step`` ended now; exposed from ``launched`` on, and between the
        two marks of ``exposed_before`` (a wait at its start, when it was applied later)."""
        self._pending.append((step, nbytes, began, launched, exposed_before, self._clock.mark()))
        self._resolve()

    def last(self) -> SyncStats | None:
        self._resolve()
        return self._last

    def summary(self, steps: int) -> dict[str, float]:
        """Over the resolved averages: their count, mean and largest bytes, time and exposed time, and the
        bytes per step over ``steps`` steps; {} before the first."""
        self._resolve()
        count, nbytes, time_ms, exposed_ms, largest = self._totals
        if not count:
            return {}
        return {
            "syncs": float(count),
            "bytes_per_sync": nbytes / count,
            "max_bytes_per_sync": float(largest),
            "time_ms": time_ms / count,
            "exposed_ms": exposed_ms / count,
            "bytes_per_step": nbytes / steps if steps else 0.0,
        }

    def state_dict(self) -> list[float]:
        """The totals of the resolved averages, for a checkpoint: a resumed run's summary counts the whole run."""
        self._resolve()
        return list(self._totals)

    def load_state_dict(self, totals: list[float]) -> None:
        self._totals = [int(totals[0]), int(totals[1]), float(totals[2]), float(totals[3]), int(totals[4])]

    def _resolve(self) -> None:
        clock = self._clock
        while self._pending and clock.done(self._pending[0][-1]):
            step, nbytes, began, launched, exposed_before, ended = self._pending.popleft()
            exposed = clock.elapsed_ms(launched, ended) + (clock.elapsed_ms(*exposed_before) if exposed_before else 0.0)
            self._last = SyncStats(step, nbytes, clock.elapsed_ms(began, ended), exposed)
            totals = self._totals
            totals[0] += 1
            totals[1] += nbytes
            totals[2] += self._last.time_ms
            totals[3] += self._last.exposed_ms
            totals[4] = max(totals[4], nbytes)
