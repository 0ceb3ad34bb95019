"""The hang watchdog: a lit_dp collective waiting longer than ``hang_timeout`` ends the whole job with a diagnosis.

The first rank whose wait for one of lit_dp's collectives passes its deadline raises the alarm
in the rendezvous store; every rank that can still run Python answers with where it is (its
synchronised step, the last bucket it launched, what it waits for or has in flight on the
device, its known phase, the innermost frames of its main thread) and writes its stacks (and,
when torch's flight recorder is on, its trace) to ``<directory>/lit_dp_hang/``. The rank that
raised the alarm publishes the verdict, for instance::

    rank 1 never launched bucket 0 of step 41; its last was bucket 2 of step 40.

Then every process of the job ends (``lit_dp.observability.hang_exit``): a rank waiting in a
lit_dp collective raises ``CollectiveHangError``; the others get it raised in their main thread,
then a hard exit after a grace; a rank that cannot run Python is signalled by a peer on its host
for its stack, then killed. A rank that sees the alarm and then loses the store ends too.

Deadlines are per wrapper (each ``DataParallel`` has its own waiter and thread; nothing
process-global): the long one (``LONG_DEADLINE_SHARE`` of the process group's timeout, never
less than ``hang_timeout``) until this rank has completed its second synchronised step (every
rank then got through its first optimizer step) and for waits during which some rank was in a
known phase (``lit_dp.observability.phases``); ``hang_timeout`` otherwise. How a wait is judged
(bounded on Gloo; by the device's completion on NCCL, which completes a work's future at
enqueue) is the waiter's (``lit_dp.gradients.waiting``); this module's thread polls the store
every few seconds (the alarm, the phases) and, on NCCL, the waiter's records. See
docs/reliability.md ("Stuck ranks").
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from typing_extensions import override

from lit_dp.gradients.events import BucketLaunch, ReducerObserver
from lit_dp.gradients.plan import Participation, StepPlan
from lit_dp.gradients.reducer import Reducer
from lit_dp.gradients.waiting import CollectiveHangError, InFlight
from lit_dp.job.store import group_store_prefix, rendezvous_store
from lit_dp.observability.hang_exit import (
    end_processes,
    exit_after,
    raise_in_main_thread,
    register_stack_signal,
    this_process,
)
from lit_dp.observability.hang_report import (
    dump_flight_recorder,
    format_summary,
    furthest_bucket,
    main_thread_position,
    write_stacks,
)
from lit_dp.observability.phases import current_phase, known_phase, some_rank_busy
from lit_dp.observability.step_clock import StepClock

log = logging.getLogger(__name__)

HANG_DIRECTORY = "lit_dp_hang"
# The share of the process group's timeout a wait may last during warm-up and known phases: the
# rest leaves the diagnosis time to finish before the process group's own timeout fires.
LONG_DEADLINE_SHARE = 0.8
WARMUP_STEPS = 2  # synchronised steps taken with the long deadline
_NAMESPACE = "lit_dp/watchdog"  # where each process registers itself (per process, shared by its wrappers)
JOIN_SECONDS = 5.0  # a poll in progress (a store read) ends well within it
_STORE_ERRORS = (RuntimeError, ValueError, dist.DistError)
# The running watch threads and their stop events, stopped at exit (``_stop_watch_threads``).
_WATCH_THREADS: weakref.WeakKeyDictionary[threading.Thread, threading.Event] = weakref.WeakKeyDictionary()


class HangWatchdog(ReducerObserver):
    """Watches ``reducer``'s collectives (as its observer, and through its waiter) and answers alarms.

    Start it with ``HangWatchdog.start``; ``directory`` is where ``lit_dp_hang/`` goes (the
    strategies point it at the run's log directory; default: the working directory). It reads
    when steps started from ``clock`` (subscribed before it), which takes those timestamps once
    for every observer.
    """

    def __init__(
        self,
        reducer: Reducer,
        hang_timeout: float,
        store: dist.Store,
        directory: str | None,
        device: torch.device,
        clock: StepClock,
        given: bool = False,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        group = group if group is not None else reducer.group
        group_seconds = group_timeout(group, device)
        hang_timeout = deadline_below(hang_timeout, given, group_seconds)
        self.directory = directory or os.getcwd()
        # Weak: the reducer holds this watchdog (observer, waiter); a cycle would keep its process
        # group, and so rank 0's rendezvous port, alive after the group is destroyed.
        self._reducer = weakref.ref(reducer)
        self._waiter = reducer.waiter
        self._timeout = hang_timeout
        self._bounded = dist.get_backend(group) != "nccl"
        # The store is looked up at each use, never kept: holding it would keep rank 0's
        # rendezvous port open after the group is destroyed (a second fit could not bind it).
        self._world = weakref.ref(dist.group.WORLD)
        self._rank = dist.get_rank()
        self._ranks = dist.get_process_group_ranks(group)
        # Every rank starts one watchdog per DataParallel, in the same order: the n-th gets the same number everywhere.
        namespace = group_store_prefix("watchdog", group)
        instance = (store.add(f"{namespace}/instances", 1) - 1) // len(self._ranks)
        self._prefix = f"{namespace}/{instance}"
        self._poll_seconds = min(5.0, max(0.1, hang_timeout / 20))
        # Answering takes one poll and a store write; the margin is for a loaded machine.
        self._reply_seconds = min(30.0, max(3.0, hang_timeout / 10))
        # How long a rank's main thread gets to end by its own exception after the verdict.
        self._grace = min(30.0, max(5.0, hang_timeout / 10))
        self._long_timeout = max(hang_timeout, LONG_DEADLINE_SHARE * group_seconds)
        self._step = -1
        self._clock = clock  # its step starts name a bucket on NCCL
        self._participation: Participation | None = None  # of the step being synchronised
        self._launched = -1
        self._launches: list[BucketLaunch] = []  # of the step being synchronised
        self._untimed: InFlight | None = None  # torch's Join loop, entered and left in two calls
        self._lock = threading.Lock()
        self._answered = False
        self._alarmed_at = 0.0
        self._ending = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None  # started by `start`
        self._waiter.watch(
            self._long_timeout,
            self.on_deadline,
            bounded=self._bounded,
            long_deadline=self._long_timeout,
            device=device,
            slice_seconds=self._poll_seconds,
        )
        store.set(f"{_NAMESPACE}/process/{self._rank}", json.dumps(this_process()))
        register_stack_signal()

    @classmethod
    def start(
        cls,
        reducer: Reducer,
        hang_timeout: float,
        directory: str | None = None,
        device: torch.device | None = None,
        *,
        clock: StepClock,
        given: bool = False,
        group: dist.ProcessGroup | None = None,
    ) -> HangWatchdog | None:
        """Subscribe a watchdog to ``reducer``, set its waiter's deadlines and start its thread;
        None without a rendezvous store. ``given``: the user chose ``hang_timeout`` (it is kept,
        or refused when the process group would time out first); else it came from "auto".
        ``group``: the ranks it asks where they are (the reducer's group; under torchft, the
        replica group's own, whose collectives are the ones that can hang)."""
        store = rendezvous_store()
        if store is None:
            return None
        device = device or torch.device("cpu")
        watchdog = cls(reducer, hang_timeout, store, directory, device, clock, given, group)
        reducer.add_observer(watchdog)
        thread = _WatchThread(watchdog._stop, target=_watch, args=(weakref.ref(watchdog), watchdog._stop, watchdog._poll_seconds))
        thread.name = f"lit_dp hang watchdog (rank {watchdog._rank})"
        thread.start()
        watchdog._thread = thread
        _WATCH_THREADS[thread] = watchdog._stop
        weakref.finalize(watchdog, watchdog._stop.set)
        log.debug(
            "lit_dp hang watchdog: rank %d, hang_timeout=%gs after warm-up, %gs until then and while a rank is in "
            "a known phase; waits %s",
            watchdog._rank,
            hang_timeout,
            watchdog._long_timeout,
            "bounded on the host" if watchdog._bounded else "judged by the device's completion",
        )
        return watchdog

    @property
    def hang_timeout(self) -> float:
        return self._timeout

    @property
    def long_timeout(self) -> float:
        """The deadline during warm-up and while some rank is in a known phase (seconds)."""
        return self._long_timeout

    @property
    def _store(self) -> dist.Store:
        store = rendezvous_store() if not self._stop.is_set() else None
        if store is None or dist.group.WORLD is not self._world():
            raise RuntimeError("lit_dp hang watchdog: the process group it watched is gone")
        return store

    def close(self) -> None:
        """Stop the thread and wait for it (a verdict already reached still ends the process)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=JOIN_SECONDS)

    # -- known phases: a rank busy on purpose ------------------------------------------------

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """This rank is busy with ``name`` on purpose (a checkpoint write, an evaluation only it
        runs): meanwhile the others' waits get the long deadline. Job-wide, nestable."""
        with known_phase(name):
            yield

    # -- the reducer's events: the position reported in a diagnosis ---------------------------

    @override
    def step_started(self, step: int, plan: StepPlan) -> None:
        self._step, self._launched, self._launches = step, -1, []
        self._participation = plan.participation

    @override
    def step_ended(self, step: int) -> None:
        self._participation = None
        # The launches' futures hold the step's gradients: kept past the step, they kept a whole
        # step's gradients alive until the next forward, and freed them there.
        self._launches = []
        if step == WARMUP_STEPS - 1:
            # Every rank took part in this step's collectives, after its first optimizer step.
            self._waiter.end_warmup(self._timeout)
            log.debug("lit_dp hang watchdog: warm-up over at step %d, deadline %gs", step, self._timeout)

    @override
    def bucket_launched(self, launch: BucketLaunch) -> None:
        self._launched = launch.position
        self._launches.append(launch)

    # -- waits the main thread cannot bound itself --------------------------------------------

    @contextmanager
    def watching(self, what: str) -> Iterator[None]:
        """Watch a collective lit_dp does not wait for itself (the strategy's ``reduce``, ``barrier``, ...)."""
        with self._waiter.outside(what):
            yield

    def untimed_wait_started(self, what: str) -> None:
        """The main thread enters a wait with no deadline of ours (torch's Join loop): the thread watches it."""
        self._waiter.leave(self._untimed)
        self._untimed = None  # entering raises once the job was declared hung
        self._untimed = self._waiter.enter(what)

    def untimed_wait_ended(self) -> None:
        self._waiter.leave(self._untimed)
        self._untimed = None

    # -- the diagnosis -----------------------------------------------------------------------

    def on_deadline(self, what: str, since: float) -> None:
        """A bounded wait passed its deadline (main thread): return if some rank is in a known
        phase (the wait goes on), else raise the alarm, gather every rank's answer, publish the
        verdict and raise it."""
        if self._excused():
            return
        summary, silent = self._diagnose(what, since)
        self._end(summary, silent, from_main=True)
        raise CollectiveHangError(summary)

    def _excused(self) -> bool:
        """Whether some rank is in a known phase now (read afresh from the store)."""
        try:
            busy = some_rank_busy(self._store)
        except _STORE_ERRORS:
            return False
        if busy:
            self._waiter.excuse(time.monotonic())
        return busy

    def _diagnose(self, what: str, since: float) -> tuple[str, list[int]]:
        """Alarm, answers, verdict: the summary and the ranks that did not answer."""
        waited = time.monotonic() - since
        waited_bucket: tuple[int, int] | None = None
        bucket_step: int | None = None
        if not what:
            what, waited_bucket, bucket_step = self._bucket_waited_for(since)
        try:
            self._store.add(f"{self._prefix}/alarm", 1)
            self._answer()
            reports = self._collect_reports()
        except _STORE_ERRORS as error:
            reports = {self._rank: self._report()}
            what += f" (the rendezvous store stopped answering: {error})"
        if bucket_step is not None:
            waited_bucket = furthest_bucket(reports, bucket_step)
        opening = (
            f"lit_dp hang watchdog: on rank {self._rank}, {what} waited {waited:.1f}s, longer than "
            f"hang_timeout={self._timeout:g}s (strategy option hang_timeout; {self._long_timeout:g}s during "
            "warm-up and known phases). Where each rank is:"
        )
        folder = os.path.join(self.directory, HANG_DIRECTORY)
        summary = format_summary(opening, self._ranks, reports, waited_bucket, self._reply_seconds, folder)
        silent = [rank for rank in self._ranks if rank not in reports]
        try:
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, f"summary_rank{self._rank}.txt"), "w") as file:
                file.write(summary + "\n")
            self._store.set(f"{self._prefix}/verdict", json.dumps({"summary": summary, "silent": silent}))
            self._finish_together()
        except (OSError, *_STORE_ERRORS):
            pass  # the summary still travels in the error
        return summary, silent

    def _bucket_waited_for(self, since: float) -> tuple[str, tuple[int, int] | None, int | None]:
        """What a bucket wait (``what=""``) was for: on Gloo the first launch whose futures are not
        done; on NCCL, where futures are done at launch, the step the wait belonged to (the bucket
        is then named from the ranks' reports: the furthest any rank got)."""
        if self._bounded:
            for launch in self._launches:
                if not all(future.done() for future in launch.futures):
                    where = (launch.step, launch.position)
                    return f"bucket {launch.position} of synchronised step {launch.step}", where, None
            return f"a bucket of synchronised step {self._step}", None, None
        step = next((step for started, step in reversed(self._clock.starts) if started <= since), self._step)
        return f"a bucket of synchronised step {step}", None, step

    def _answer(self) -> None:
        """Publish this rank's position and write its stacks (and flight-recorder trace), once (from either thread)."""
        with self._lock:
            if self._answered:
                return
            self._answered = True
            self._alarmed_at = time.monotonic()
        report = self._report()
        folder = os.path.join(self.directory, HANG_DIRECTORY)
        report["stack"] = write_stacks(os.path.join(folder, f"rank{self._rank}.txt"), {"rank": self._rank, **report})
        report["flight_recorder"] = dump_flight_recorder(folder, self._rank)
        self._store.set(f"{self._prefix}/report/{self._rank}", json.dumps(report))
        self._store.add(f"{self._prefix}/reported", 1)

    def _report(self) -> dict[str, Any]:
        reducer = self._reducer()
        waiting = self._waiter.waiting
        if waiting is not None:
            what = waiting[0] or self._bucket_waited_for(waiting[1])[0]
            state = f"waiting for {what} for {time.monotonic() - waiting[1]:.1f}s"
        elif self._participation is Participation.SHADOW:
            state = "joined (out of inputs), shadowing the others' steps"
        else:
            state = "outside lit_dp's collectives (data loading or user code)"
        oldest = self._waiter.oldest_in_flight() if not self._bounded else None
        if oldest is not None and waiting is None:
            what = oldest.what or self._bucket_waited_for(oldest.since)[0]
            state += f"; {what} in flight on the device for {time.monotonic() - oldest.since:.1f}s"
        return {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "step": self._step,
            "launched": self._launched,
            "buckets": len(reducer.bucket_bytes) if reducer is not None else 0,
            "state": state,
            "phase": current_phase(),
            "where": main_thread_position(),
        }

    def _collect_reports(self) -> dict[int, dict[str, Any]]:
        deadline = time.monotonic() + self._reply_seconds
        while self._store.add(f"{self._prefix}/reported", 0) < len(self._ranks) and time.monotonic() < deadline:
            time.sleep(0.05)
        reports = {}
        for rank in self._ranks:
            key = f"{self._prefix}/report/{rank}"
            if self._store.check([key]):
                reports[rank] = json.loads(self._store.get(key))
        return reports

    def _finish_together(self) -> None:
        """Global rank 0 hosts the store: it waits (briefly) until every rank that raised the
        alarm has read the answers, so that its exit does not cut the others' diagnosis short."""
        diagnosed = self._store.add(f"{self._prefix}/diagnosed", 1)
        if self._rank != 0:
            return
        deadline = time.monotonic() + self._reply_seconds
        while diagnosed < self._store.add(f"{self._prefix}/alarm", 0) and time.monotonic() < deadline:
            time.sleep(0.05)
            diagnosed = self._store.add(f"{self._prefix}/diagnosed", 0)

    # -- the end of the job ----------------------------------------------------------------------

    def _end(self, summary: str, silent: list[int], from_main: bool) -> None:
        """End this process, once: the ranks on this host that cannot run Python first, then this
        one by ``CollectiveHangError`` in its main thread (raised by the caller ``from_main``, else
        delivered by Python) and, ``grace`` seconds later, by a hard exit if it is still alive."""
        with self._lock:
            if self._ending:
                return
            self._ending = True
        verdict = f"lit_dp hang watchdog: rank {self._rank} ends, the job was declared hung.\n{summary}"
        self._waiter.declare(verdict)  # a wait of this rank's raises it at its next slice
        registered = []
        for rank in silent:
            try:
                registered.append(json.loads(self._store.get(f"{_NAMESPACE}/process/{rank}")))
            except (*_STORE_ERRORS, json.JSONDecodeError):
                continue
        ended = end_processes(registered)
        if ended:
            log.debug("lit_dp hang watchdog: ended the silent processes %s on this host", ended)
        self._stop.set()
        exit_after(self._grace, self._rank)
        if not from_main:
            raise_in_main_thread(verdict)

    # -- the thread's side -----------------------------------------------------------------------

    def _poll(self) -> None:
        store, now = self._store, time.monotonic()
        if not self._answered and store.add(f"{self._prefix}/alarm", 0) > 0:
            self._answer()
        if self._answered:
            self._await_verdict(store, now)
            return
        if some_rank_busy(store):
            self._waiter.excuse(now)
        stale = self._waiter.overdue(now)
        if stale is not None and not self._excused():
            summary, silent = self._diagnose(stale.what, stale.since)
            print(f"{summary}\nlit_dp: ending rank {self._rank}.", file=sys.stderr, flush=True)
            self._end(summary, silent, from_main=False)

    def _await_verdict(self, store: dist.Store, now: float) -> None:
        key = f"{self._prefix}/verdict"
        if store.check([key]):
            verdict = json.loads(store.get(key))
            self._end(verdict["summary"], verdict["silent"], from_main=False)
        elif now - self._alarmed_at > 3 * self._reply_seconds:
            self._end("lit_dp hang watchdog: a rank raised the alarm but published no verdict.", [], from_main=False)

    def _store_lost(self) -> None:
        """The store is gone: after an alarm, the job is being ended; before, it is over."""
        if self._answered:
            self._end("lit_dp hang watchdog: the job was declared hung and its rendezvous store is gone.", [], False)


def deadline_below(hang_timeout: float, given: bool, group_seconds: float) -> float:
    """``hang_timeout``, which must be below the process group's timeout (``group_seconds``): past
    that the group's own timeout fires first and ends the job with no diagnosis. A given value is
    refused there, never changed; "auto"'s 300 s becomes half of a shorter group timeout (as it does
    for a shorter ``timeout`` option: PADDLE_PG_TIMEOUT, or a group the user created)."""
    if hang_timeout < group_seconds:
        return hang_timeout
    if not given:
        return group_seconds / 2
    raise ValueError(
        f"hang_timeout={hang_timeout:g} is invalid: the process group's timeout is {group_seconds:g}s, so it would "
        f"time out first, without the diagnosis; expected a hang_timeout below {group_seconds:g} (e.g. "
        f"{group_seconds / 2:g}), 'auto' (300, or half of a shorter group timeout), None (no watchdog), or a longer "
        "process-group timeout (the strategy's timeout option, PADDLE_PG_TIMEOUT in milliseconds, or "
        "init_process_group(timeout=...))."
    )


def group_timeout(group: dist.ProcessGroup, device: torch.device) -> float:
    """The process group's timeout in seconds (torch's default where the backend does not say)."""
    try:
        return group._get_backend(device).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return dist.default_pg_timeout.total_seconds()


class _WatchThread(threading.Thread):
    """The watch thread: a daemon with ``stop()``, the shape Lightning's test suites stop a thread
    left running by a run that was never torn down (a Fabric script ends without a teardown)."""

    def __init__(self, stop: threading.Event, **kwargs: Any) -> None:
        super().__init__(daemon=True, **kwargs)
        self._stop_event = stop

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=JOIN_SECONDS)


@atexit.register
def _stop_watch_threads() -> None:
    """At exit, before the interpreter ends: a watch thread left in a poll holds the model, its
    process group and a store connection while torch destroys them, which aborted a rank after a
    script had finished ("terminate called without an active exception")."""
    running = list(_WATCH_THREADS.items())
    for _, stop in running:
        stop.set()
    for thread, _ in running:
        thread.join(timeout=2.0)


def _watch(watchdog_ref: weakref.ref[HangWatchdog], stop: threading.Event, poll_seconds: float) -> None:
    while not stop.wait(poll_seconds):
        watchdog = watchdog_ref()
        if watchdog is None:
            return
        try:
            watchdog._poll()
        except _STORE_ERRORS:
            watchdog._store_lost()
            return
        del watchdog
