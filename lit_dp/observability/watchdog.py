"""The hang watchdog: a lit_dp collective waiting longer than ``hang_timeout`` ends the job with a diagnosis.

Without it, a rank stuck in data loading, a deadlock or a slow filesystem leaves the others in
an all-reduce until the process group's timeout (30 minutes), which then says nothing of who
was where. With it (``hang_timeout``, default 300 s), the first rank whose wait for one of
lit_dp's collectives (a bucket, its flags, a communication hook's future, the broadcast of the
bucket order, a LocalSGD average, the Trainer's per-batch exchange of uneven inputs) passes
the deadline raises the alarm in the rendezvous store, and every rank that can still run
Python answers with where it is: its synchronised step, the last bucket it launched, whether
it is waiting in a collective, and the innermost frames of its main thread. Each also writes
the Python stack of every thread (``faulthandler``) to ``<directory>/lit_dp_hang/rank<R>.txt``.
The waiting ranks then raise ``CollectiveHangError`` carrying the table, for instance::

    rank 1 never launched bucket 0 of step 41; its last was bucket 2 of step 40.

A rank that does not answer is named as outside lit_dp's collectives and unable to run
Python (C code holding the GIL) or gone. For that case ``faulthandler``'s own C thread, which
needs no GIL, writes its stack to the rank's stderr once it has started no synchronised step
(nor validation step, under the Trainer) for between 1.5 and 2 times ``hang_timeout``: no file
is created up front, and the job's log holds it.

Mechanics (their cost per step is measured by ``benchmarks/watchdog.py``, results in
docs/benchmarks.md): the position is a few attribute writes per bucket (the reducer's observer
events); the reducer's ``Waiter`` (``lit_dp.gradients.waiting``) gets the deadline, so on Gloo
a wait is ``work.wait(timeout)`` instead of ``work.wait()`` and a communication hook's future
is waited on through a done-callback and an event; a daemon thread polls the store for alarms
every few seconds. Waits that cannot carry a deadline, NCCL's (a wait there only orders the GPU
stream; a deadline would synchronise the host at every bucket) and torch's Join loop, are
watched by that thread: past the deadline it raises the alarm itself, prints the diagnosis and
ends the process, as torch's own NCCL watchdog does, since nothing can interrupt a main thread
blocked in C.
"""

from __future__ import annotations

import faulthandler
import json
import os
import socket
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import torch.distributed as dist
from typing_extensions import override

from lit_dp.gradients.events import BucketLaunch, ReducerObserver
from lit_dp.gradients.plan import Participation, StepPlan
from lit_dp.gradients.reducer import Reducer
from lit_dp.gradients.waiting import CollectiveHangError
from lit_dp.job.store import group_store_prefix, rendezvous_store
from lit_dp.observability.hang_report import behind_lines, describe_rank, main_thread_position

HANG_DIRECTORY = "lit_dp_hang"
_STORE_ERRORS = (RuntimeError, ValueError, dist.DistError)
class HangWatchdog(ReducerObserver):
    """Watches ``reducer``'s collectives (as its observer, and through its waiter) and answers alarms.

    Start it with ``HangWatchdog.start``; ``directory`` is where ``lit_dp_hang/`` goes (the
    strategies point it at the run's log directory; default: the working directory).
    """

    def __init__(self, reducer: Reducer, hang_timeout: float, store: dist.Store, directory: str | None) -> None:
        self.directory = directory or os.getcwd()
        # Weak: the reducer holds this watchdog (observer, waiter); a cycle would keep its process
        # group, and so rank 0's rendezvous port, alive after the group is destroyed.
        self._reducer = weakref.ref(reducer)
        self._timeout = hang_timeout
        self._timed = dist.get_backend(reducer.group) != "nccl"
        # The store is looked up at each use, never kept: holding it would keep rank 0's
        # rendezvous port open after the group is destroyed (a second fit could not bind it).
        self._world = weakref.ref(dist.group.WORLD)
        self._rank = dist.get_rank()
        self._ranks = dist.get_process_group_ranks(reducer.group)
        # Every rank starts one watchdog per DataParallel, in the same order: the n-th gets the same number everywhere.
        namespace = group_store_prefix("watchdog", reducer.group)
        instance = (store.add(f"{namespace}/instances", 1) - 1) // len(self._ranks)
        self._prefix = f"{namespace}/{instance}"
        self._poll_seconds = min(5.0, max(0.1, hang_timeout / 20))
        # Answering takes one poll and a store write; the margin is for a loaded machine.
        self._reply_seconds = min(30.0, max(3.0, hang_timeout / 10))
        self._step = -1
        self._participation: Participation | None = None  # of the step being synchronised
        self._launched = -1
        self._launches: list[tuple[BucketLaunch, float]] = []
        self._untimed: tuple[str, float] | None = None  # a wait only the thread can watch
        self._answer_lock = threading.Lock()
        self._answered = False
        self._armed_at = -float("inf")
        self._stop = threading.Event()

    @classmethod
    def start(cls, reducer: Reducer, hang_timeout: float, directory: str | None = None) -> HangWatchdog | None:
        """Subscribe a watchdog to ``reducer`` and start its thread; None without a rendezvous store."""
        store = rendezvous_store()
        if store is None:
            return None
        watchdog = cls(reducer, hang_timeout, store, directory)
        reducer.add_observer(watchdog)
        thread = threading.Thread(
            target=_watch, args=(weakref.ref(watchdog), watchdog._stop, watchdog._poll_seconds), daemon=True
        )
        thread.name = f"lit_dp hang watchdog (rank {watchdog._rank})"
        thread.start()
        weakref.finalize(watchdog, watchdog._stop.set)
        return watchdog

    @property
    def hang_timeout(self) -> float:
        return self._timeout

    @property
    def bounds_waits(self) -> bool:
        """Whether the waits themselves should carry the deadline (``Waiter.watch(hang_timeout,
        watchdog.on_deadline)``): on Gloo; on NCCL a wait only orders the GPU stream, and this
        watchdog's thread watches the launches instead."""
        return self._timed

    @property
    def _store(self) -> dist.Store:
        store = rendezvous_store() if not self._stop.is_set() else None
        if store is None or dist.group.WORLD is not self._world():
            raise RuntimeError("lit_dp hang watchdog: the process group it watched is gone")
        return store

    def close(self) -> None:
        """Stop the thread and faulthandler's timer."""
        self._stop.set()
        if self._armed_at > -float("inf"):
            faulthandler.cancel_dump_traceback_later()
            self._armed_at = float("inf")

    def heartbeat(self) -> None:
        """This rank is alive (a step or a validation batch began): push faulthandler's timer back."""
        now = time.monotonic()
        if now - self._armed_at > self._timeout / 2:  # re-armed at most twice per hang_timeout
            self._arm_faulthandler(now)

    # -- the reducer's events: the position reported in a diagnosis ---------------------------

    @override
    def step_started(self, step: int, plan: StepPlan) -> None:
        self._step, self._launched, self._launches = step, -1, []
        self._participation = plan.participation
        self.heartbeat()

    @override
    def step_ended(self, step: int) -> None:
        self._participation = None

    @override
    def bucket_launched(self, launch: BucketLaunch) -> None:
        self._launched = launch.position
        self._launches.append((launch, time.monotonic()))

    # -- waits the main thread cannot bound itself --------------------------------------------

    @contextmanager
    def watching(self, what: str) -> Iterator[None]:
        """Watch a collective lit_dp does not wait for itself (the strategy's ``reduce``, ``barrier``, ...)."""
        self.untimed_wait_started(what)
        try:
            yield
        finally:
            self.untimed_wait_ended()

    def untimed_wait_started(self, what: str) -> None:
        """The main thread enters a wait with no deadline of ours (torch's Join loop): the thread watches it."""
        self._untimed = (what, time.monotonic())

    def untimed_wait_ended(self) -> None:
        self._untimed = None

    # -- the diagnosis -----------------------------------------------------------------------

    def on_deadline(self, what: str, since: float) -> NoReturn:
        """Raise the alarm, gather every rank's answer, write the summary, raise."""
        summary = self._diagnose(what, since)
        raise CollectiveHangError(summary)

    def _diagnose(self, what: str, since: float) -> str:
        waited = time.monotonic() - since
        what, waited_bucket = (what, None) if what else self._bucket_waited_for()
        try:
            self._store.add(f"{self._prefix}/alarm", 1)
            self._answer()
            reports = self._collect_reports()
        except _STORE_ERRORS as error:
            reports = {self._rank: self._report()}
            what += f" (the rendezvous store stopped answering: {error})"
        lines = [
            (
                f"lit_dp hang watchdog: on rank {self._rank}, {what} waited {waited:.1f}s, longer than "
                f"hang_timeout={self._timeout:g}s (strategy option hang_timeout). Where each rank is:"
            )
        ]
        lines += [f"  {describe_rank(rank, reports.get(rank), self._reply_seconds)}" for rank in self._ranks]
        lines += behind_lines(self._ranks, reports, waited_bucket)
        folder = os.path.join(self.directory, HANG_DIRECTORY)
        lines.append(
            f"Stacks: {folder}/rank<R>.txt for the ranks that answered; a rank that could not run Python gets its "
            "stack on its stderr from faulthandler's own thread."
        )
        summary = "\n".join(lines)
        try:
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, f"summary_rank{self._rank}.txt"), "w") as file:
                file.write(summary + "\n")
            self._finish_together()
        except (OSError, *_STORE_ERRORS):
            pass  # the summary still travels in the error
        return summary

    def _bucket_waited_for(self) -> tuple[str, tuple[int, int] | None]:
        for launch, _ in self._launches:
            if not all(future.done() for future in launch.futures):
                return f"bucket {launch.position} of synchronised step {launch.step}", (launch.step, launch.position)
        return f"a bucket of synchronised step {self._step}", None

    def _answer(self) -> None:
        """Publish this rank's position and write its stacks, once (from either thread)."""
        with self._answer_lock:
            if self._answered:
                return
            self._answered = True
        # Python runs here, so faulthandler's timer (for a rank that cannot) would only add noise.
        faulthandler.cancel_dump_traceback_later()
        self._armed_at = float("inf")
        report = self._report()
        report["stack"] = self._write_stacks(report)
        self._store.set(f"{self._prefix}/report/{self._rank}", json.dumps(report))
        self._store.add(f"{self._prefix}/reported", 1)

    def _report(self) -> dict[str, Any]:
        reducer = self._reducer()
        waiting = (reducer.waiter.waiting if reducer is not None else None) or self._untimed
        if waiting is not None:
            what = waiting[0] or self._bucket_waited_for()[0]
            state = f"waiting for {what} for {time.monotonic() - waiting[1]:.1f}s"
        elif self._participation is Participation.SHADOW:
            state = "joined (out of inputs), shadowing the others' steps"
        else:
            state = "outside lit_dp's collectives (data loading or user code)"
        return {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "step": self._step,
            "launched": self._launched,
            "buckets": len(reducer.bucket_bytes) if reducer is not None else 0,
            "state": state,
            "where": main_thread_position(),
        }

    def _write_stacks(self, report: dict[str, Any]) -> str | None:
        folder = os.path.join(self.directory, HANG_DIRECTORY)
        path = os.path.join(folder, f"rank{self._rank}.txt")
        try:
            os.makedirs(folder, exist_ok=True)
            with open(path, "w") as file:
                file.write(f"rank {self._rank}: {json.dumps(report)}\n\n")
                file.flush()
                faulthandler.dump_traceback(file, all_threads=True)
        except OSError:
            return None
        return path

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

    # -- the thread's side -----------------------------------------------------------------------

    def _poll(self) -> None:
        if not self._answered and self._store.add(f"{self._prefix}/alarm", 0) > 0:
            self._answer()
        stale = self._stale_untimed_wait()
        if stale is not None:
            summary = self._diagnose(*stale)
            print(f"{summary}\nlit_dp: ending rank {self._rank} (its main thread is blocked in C).", file=sys.stderr)
            sys.stderr.flush()
            os._exit(1)

    def _stale_untimed_wait(self) -> tuple[str, float] | None:
        now = time.monotonic()
        untimed = self._untimed
        if untimed is not None and now - untimed[1] > self._timeout:
            return untimed
        if not self._timed:
            for launch, launched_at in list(self._launches):
                if now - launched_at > self._timeout and not all(f.done() for f in launch.futures):
                    return f"bucket {launch.position} of synchronised step {launch.step}", launched_at
        return None

    def _arm_faulthandler(self, now: float) -> None:
        if self._stop.is_set():
            return
        try:
            faulthandler.dump_traceback_later(2 * self._timeout, repeat=False, file=sys.stderr, exit=False)
        except (AttributeError, OSError, RuntimeError, ValueError):  # a stderr without a file descriptor
            self._armed_at = float("inf")
            return
        self._armed_at = now


def _watch(watchdog_ref: weakref.ref[HangWatchdog], stop: threading.Event, poll_seconds: float) -> None:
    while not stop.wait(poll_seconds):
        watchdog = watchdog_ref()
        if watchdog is None:
            return
        try:
            watchdog._poll()
        except _STORE_ERRORS:
            return  # the store is gone: the job is over
        del watchdog
