"""The hang watchdog: a stuck rank is named with where it is, its stack lands in the log directory,
and every process of the job ends.

The completion logic of the waits is tested without processes, against fakes of the two
contracts it relies on (an NCCL work, a Gloo work's bounded wait). Real gloo processes with
``hang_timeout=2`` then show the whole protocol: one rank is made to sleep (it can still run
Python, so its watchdog thread answers) or to sit in a C call that holds the GIL (it cannot).
(The Trainer's case, a rank asleep in ``training_step``, and the launchers' cases:
``tests/strategies/test_hang_watchdog.py``.)
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import pickle
import signal
import time
from datetime import timedelta
from unittest import mock

import pytest
import torch
from torch import nn

import lit_dp
from lit_dp.gradients.waiting import CollectiveHangError, Waiter
from lit_dp.observability.hang_report import FLIGHT_RECORDER_PREFIX, behind_lines, describe_rank, furthest_bucket
from lit_dp.observability.watchdog import HANG_DIRECTORY, LONG_DEADLINE_SHARE, HangWatchdog
from tests.helpers.distributed import run_ranks
from tests.helpers.jobs import run_job

HANG_TIMEOUT = 2.0
# Where a wait's diagnosis goes: the whole job must end within this of the hang on a loaded
# 2-core machine (the protocol needs hang_timeout, a reply window of 3 s, a 1 s signal pause
# and a 5 s grace: about 11 s on a quiet machine).
ENDS_WITHIN = 45.0


# -- the completion logic, without processes -------------------------------------------------


class EnqueuedWork:
    """A work as NCCL's behaves (torch's ``Work.get_future`` documentation: "For GPU work,
    ``fut.done()`` returns true only whether the operation has been enqueued"; ``Work.wait``
    "is the same as calling synchronize(): Letting the current stream block on the completion
    of the NCCL work"): its future is done at once, ``wait()`` returns at once, and only
    ``is_completed()`` (NCCL's end events) says whether the device has finished."""

    def __init__(self) -> None:
        self.on_device = True
        self._future: torch.futures.Future = torch.futures.Future()
        self._future.set_result([])

    def get_future(self) -> torch.futures.Future:
        return self._future

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return not self.on_device


def never_called(what: str, since: float) -> None:
    raise AssertionError(f"the deadline of a device wait is the watchdog thread's to judge, not the wait's ({what})")


def test_on_nccl_a_collective_whose_future_is_done_is_pending_until_the_device_completes_it():
    waiter = Waiter()
    waiter.watch(10.0, never_called, bounded=False)
    work = EnqueuedWork()
    waiter.wait(work, "bucket 0")
    assert work.get_future().done(), "the fake must behave as NCCL's work: done at enqueue"
    now = time.monotonic()
    assert waiter.overdue(now + 5) is None
    stale = waiter.overdue(now + 11)
    assert stale is not None and stale.what == "bucket 0"
    work.on_device = False
    assert waiter.overdue(now + 11) is None
    assert waiter.oldest_in_flight() is None


class DeviceEvent:
    """A CUDA event as torch's behaves: recorded on a stream, ``query()`` is False until the
    device has run the stream up to it (here: until ``reached`` is set)."""

    recorded: list[DeviceEvent] = []

    def __init__(self) -> None:
        self.stream = None
        self.reached = False
        DeviceEvent.recorded.append(self)

    def record(self, stream: object) -> None:
        self.stream = stream

    def query(self) -> bool:
        return self.reached


def test_on_cuda_a_wait_leaves_an_event_which_says_when_the_device_completed_and_keeps_no_work(monkeypatch):
    DeviceEvent.recorded.clear()
    monkeypatch.setattr(torch.cuda, "Event", DeviceEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: f"current stream of {device}")
    waiter = Waiter()
    waiter.watch(10.0, never_called, bounded=False, device=torch.device("cuda", 0))
    work = EnqueuedWork()
    waiter.wait(work, "bucket 0")
    (event,) = DeviceEvent.recorded
    assert event.stream == "current stream of cuda:0"
    now = time.monotonic()
    work.on_device = False  # the work is no longer asked (it would hold its gradients): the event is
    assert waiter.overdue(now + 11).what == "bucket 0"
    event.reached = True
    assert waiter.overdue(now + 11) is None
    # A communication hook's future (done at enqueue on NCCL) is judged by an event after its wait too.
    future: torch.futures.Future = torch.futures.Future()
    future.set_result("reduced")
    assert waiter.wait_future(future, "comm hook") == "reduced"
    hook_event = DeviceEvent.recorded[-1]
    assert waiter.overdue(time.monotonic() + 11).what == "comm hook"
    hook_event.reached = True
    assert waiter.oldest_in_flight() is None
    # A work the device completed before the wait returned leaves no event.
    finished = EnqueuedWork()
    finished.on_device = False
    waiter.wait(finished, "bucket 1")
    assert len(DeviceEvent.recorded) == 2 and waiter.oldest_in_flight() is None


def test_only_the_oldest_collective_is_judged_and_its_clock_starts_when_the_one_before_completed():
    waiter = Waiter()
    waiter.watch(10.0, never_called, bounded=False, long_deadline=100.0)
    first, second = EnqueuedWork(), EnqueuedWork()
    waiter.wait(first, "first")
    waiter.wait(second, "second")
    start = time.monotonic()
    assert waiter.overdue(start + 11).what == "first"
    first.on_device = False
    assert waiter.overdue(start + 11) is None  # "second" waited behind "first": its clock starts now
    assert waiter.overdue(start + 22).what == "second"
    waiter.excuse(start + 12)  # some rank was in a known phase meanwhile: the long deadline
    assert waiter.overdue(start + 22) is None
    assert waiter.overdue(start + 112).what == "second"


class GlooWork:
    """A work as Gloo's behaves: ``wait(timeout)`` blocks, then raises "Operation timed out!"
    while the collective is pending; a failed collective is completed and raises."""

    def __init__(self, finishes_after: float, fails: bool = False) -> None:
        self._finishes_at = time.monotonic() + finishes_after
        self._fails = fails

    def is_completed(self) -> bool:
        return time.monotonic() >= self._finishes_at

    def wait(self, timeout: timedelta) -> bool:
        left = self._finishes_at - time.monotonic()
        if left > timeout.total_seconds():
            time.sleep(timeout.total_seconds())
            raise RuntimeError("Operation timed out!")
        time.sleep(max(0.0, left))
        if self._fails:
            raise RuntimeError("Connection reset by peer")
        return True


def test_a_bounded_wait_calls_the_hang_past_the_deadline_goes_on_when_excused_and_raises_the_verdict():
    calls = []

    def on_hang(what: str, since: float) -> None:
        calls.append(what)
        if len(calls) == 1:
            waiter.excuse(time.monotonic())  # excused: the wait goes on with the long deadline
            return
        raise CollectiveHangError("diagnosed")

    waiter = Waiter()
    waiter.watch(0.2, on_hang, bounded=True, long_deadline=0.6, slice_seconds=0.05)
    waiter.wait(GlooWork(finishes_after=0.1), "quick")
    with pytest.raises(CollectiveHangError, match="diagnosed"):
        waiter.wait(GlooWork(finishes_after=30), "stuck")
    assert calls == ["stuck", "stuck"]
    with pytest.raises(RuntimeError, match="Connection reset"):
        waiter.wait(GlooWork(finishes_after=0.1, fails=True), "failing")  # a failure is not a hang
    waiter.declare("the job was declared hung")
    with pytest.raises(CollectiveHangError, match="declared hung"):
        waiter.wait(GlooWork(finishes_after=30), "after the verdict")
    # A collective lit_dp only watches (the strategy's barrier at teardown) is not entered either.
    with pytest.raises(CollectiveHangError, match="declared hung"):
        with waiter.outside("barrier"):
            pytest.fail("a barrier after the verdict would block until the hard exit")


def test_the_summary_names_who_is_behind_who_is_silent_and_who_is_busy():
    reports = {
        0: {"step": 7, "launched": 4, "buckets": 6, "state": "waiting"},
        1: {"step": 7, "launched": 2, "buckets": 6, "state": "outside lit_dp's collectives"},
        2: {"step": 6, "launched": 5, "buckets": 6, "state": "outside lit_dp's collectives"},
    }
    lines = behind_lines([0, 1, 2, 3], reports, (7, 3))
    assert lines == [
        "Behind: rank 1 never launched bucket 3 of step 7; its last was bucket 2.",
        "Behind: rank 2 never launched bucket 3 of step 7; its last was bucket 5 of step 6.",
        "Silent: rank(s) [3] (see above).",
    ]
    assert behind_lines([0, 1], {0: reports[0], 1: {"step": 7, "launched": 4, "state": "waiting"}}, (7, 3)) == [
        "Every rank that answered launched that bucket: the collective itself is stuck (network or backend)."
    ]
    assert behind_lines([0, 1, 2], reports, None) == ["Not in lit_dp's collectives: rank(s) [1, 2]."]
    # On NCCL a rank's own wait cannot say which bucket is stuck: the furthest any rank launched.
    assert furthest_bucket(reports, 7) == (7, 4)
    assert furthest_bucket({**reports, 3: {"step": 8, "launched": -1, "buckets": 6}}, 7) == (7, 5)
    assert furthest_bucket({1: {"step": 6, "launched": 1, "buckets": 6}}, 7) is None
    busy = {"host": "h", "pid": 1, "step": 7, "launched": 2, "buckets": 6, "state": "outside", "phase": "eval"}
    assert "in phase 'eval'; at x.py:3" in describe_rank(1, {**busy, "where": "x.py:3"}, 3.0)


# -- the deadline against the process group's own timeout --------------------------------------


def watchdog_deadlines_under_a_30s_group(rank: int) -> dict[str, object]:
    """A group made with a 30 s timeout (as PADDLE_PG_TIMEOUT=30000 or torch's own init would):
    a given hang_timeout at or above it is refused, "auto" stays under it."""
    lit_dp.init_parallel_env(timeout=30)
    outcome: dict[str, object] = {}
    for given in (30, 3600):
        try:
            lit_dp.DataParallel(nn.Linear(6, 3), hang_timeout=given)
        except ValueError as error:
            outcome[f"refused {given}"] = str(error)
    outcome["kept"] = lit_dp.DataParallel(nn.Linear(6, 3), hang_timeout=20).watchdog.hang_timeout
    outcome["auto"] = lit_dp.DataParallel(nn.Linear(6, 3)).watchdog.hang_timeout
    return outcome


def test_a_given_hang_timeout_at_or_above_the_process_groups_timeout_is_refused_and_auto_stays_below_it():
    outcomes = run_ranks(watchdog_deadlines_under_a_30s_group, 2, timeout=120)
    for rank, outcome in outcomes.items():
        for given in (30, 3600):
            message = outcome.get(f"refused {given}", "")
            assert f"hang_timeout={given} is invalid: the process group's timeout is 30s" in message, (rank, outcome)
            assert "'auto'" in message and "None" in message and "longer process-group timeout" in message, message
        assert outcome["kept"] == 20 and outcome["auto"] == 15, (rank, outcome)


# -- the protocol, on real processes ------------------------------------------------------------


def sleep_or_hold_the_gil(rank: int, directory: str) -> None:
    """Rank 1 sleeps (answers), rank 2 holds the GIL in C (silent), at step 3."""
    lit_dp.init_parallel_env()
    torch.manual_seed(0)
    model = lit_dp.DataParallel(
        nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)), hang_timeout=HANG_TIMEOUT, comm_buffer_size=1e-4
    )
    model.watchdog.directory = directory
    for step in range(5):
        loss = model(torch.randn(4, 6)).square().mean()
        if step == 3 and rank == 1:
            with open(os.path.join(directory, "hang_started"), "w") as file:
                file.write(str(time.time()))
            time.sleep(HANG_TIMEOUT + 2)  # past the deadline: it answers, then ends when the sleep returns
        if step == 3 and rank == 2:
            # A C call that keeps the GIL: it can neither answer nor end itself. A read of a pipe no one
            # writes, which the kernel restarts after the stack signal's handler (faulthandler's
            # SA_RESTART), where a sleep would return and let the rank end itself before the kill.
            never_written, _ = os.pipe()
            ctypes.PyDLL(None).read(never_written, ctypes.create_string_buffer(1), 1)
        loss.backward()


@pytest.mark.slow
def test_a_sleeping_and_a_silent_rank_are_named_and_every_process_of_the_job_ends(tmp_path):
    ends = run_job(sleep_or_hold_the_gil, 3, tmp_path, str(tmp_path), timeout=150, TORCH_FR_BUFFER_SIZE="200")
    waiting, sleeper, silent = ends[0], ends[1], ends[2]
    assert waiting.ok is False and "CollectiveHangError" in waiting.payload, waiting
    message = waiting.payload
    assert "bucket 0 of synchronised step 3 waited" in message and "hang_timeout=2s" in message, message
    assert "rank 1 never launched bucket 0 of step 3" in message, message
    assert "rank 1 (" in message and "outside lit_dp's collectives" in message and "in sleep_or_hold_the_gil" in message
    assert "rank 2: did not answer" in message and "Silent: rank(s) [2]" in message, message
    # The sleeper learnt the verdict through the store and raised it once its sleep returned.
    assert sleeper.ok is False and "rank 1 ends, the job was declared hung" in sleeper.payload, sleeper
    # The silent rank was asked for its stack (written from C) and killed by a rank on its host.
    assert silent.exitcode == -signal.SIGKILL, silent
    assert "in sleep_or_hold_the_gil" in silent.stderr, silent.stderr
    hang_dir = tmp_path / HANG_DIRECTORY
    assert "sleep_or_hold_the_gil" in (hang_dir / "rank1.txt").read_text()
    assert (hang_dir / "summary_rank0.txt").read_text().strip() in message
    hang_started = float((tmp_path / "hang_started").read_text())
    assert max(end.ended_at for end in ends.values()) - hang_started < ENDS_WITHIN, ends
    # torch's flight recorder, on by TORCH_FR_BUFFER_SIZE: each answering rank's trace beside its stack.
    assert f"{HANG_DIRECTORY}/{FLIGHT_RECORDER_PREFIX}<R>" in message, message
    for rank in (0, 1):
        trace = pickle.loads((hang_dir / f"{FLIGHT_RECORDER_PREFIX}{rank}").read_bytes())
        assert any(entry["profiling_name"] == "gloo:all_reduce" for entry in trace["entries"]), trace


def leave_early_then_sleep(rank: int, directory: str) -> None:
    """Rank 0 joins after one step and waits in torch's Join loop; rank 1 sleeps before step 2."""
    lit_dp.init_parallel_env()
    model = lit_dp.DataParallel(nn.Linear(6, 3), hang_timeout=HANG_TIMEOUT)
    model.watchdog.directory = directory
    with model.join():
        for step in range(1 if rank == 0 else 3):
            if rank == 1 and step == 2:
                time.sleep(HANG_TIMEOUT + 4)  # the thread polls every 0.1 s, then diagnoses within 3 s
            model(torch.randn(4, 6)).sum().backward()


@pytest.mark.slow
def test_a_wait_in_torchs_join_loop_is_watched_by_the_thread_and_both_ranks_end(tmp_path):
    ends = run_job(leave_early_then_sleep, 2, tmp_path, str(tmp_path), timeout=90)
    summary = (tmp_path / HANG_DIRECTORY / "summary_rank0.txt").read_text()
    assert "the next step of the ranks still in (torch's Join loop)" in summary, summary
    assert "rank 1 (" in summary and "outside lit_dp's collectives" in summary, summary
    # The joined rank's main thread sat in torch's all-reduce, so its thread declared; neither
    # rank finished: each raised or, its main thread blocked, exited with status 1 after the grace.
    assert "ending rank 0" in ends[0].stderr, ends[0].stderr
    for rank, end in ends.items():
        assert end.ok is False or (end.ok is None and end.exitcode == 1), (rank, end)
    hang_started = max(end.ended_at for end in ends.values()) - ENDS_WITHIN
    assert (tmp_path / HANG_DIRECTORY / "rank1.txt").stat().st_mtime > hang_started, "ended long after the diagnosis"


def stuck_on_the_device_path(rank: int, directory: str) -> None:
    """As ``sleep_or_hold_the_gil``'s sleeper, with the watchdog built as on an NCCL group: its
    waits unbounded, judged by the thread from the works' completion. Gloo's ``get_backend`` is
    made to answer "nccl" for the watchdog only (the reducer must keep Gloo's reduction)."""
    lit_dp.init_parallel_env()
    built_as_on_gloo = HangWatchdog.__init__

    def built_as_on_nccl(*args, **kwargs) -> None:
        with mock.patch.object(torch.distributed, "get_backend", return_value="nccl"):
            built_as_on_gloo(*args, **kwargs)

    with mock.patch.object(HangWatchdog, "__init__", built_as_on_nccl):
        model = lit_dp.DataParallel(nn.Linear(6, 3), hang_timeout=HANG_TIMEOUT)
    model.watchdog.directory = directory
    for step in range(5):
        loss = model(torch.randn(4, 6)).sum()
        if step == 3 and rank == 1:
            time.sleep(HANG_TIMEOUT + 4)  # the thread polls every 0.1 s, then diagnoses within 3 s
        loss.backward()


@pytest.mark.slow
def test_on_an_nccl_group_the_watchdogs_thread_declares_the_hang_and_both_ranks_end(tmp_path):
    ends = run_job(stuck_on_the_device_path, 2, tmp_path, str(tmp_path), timeout=90)
    summary = (tmp_path / HANG_DIRECTORY / "summary_rank0.txt").read_text()
    # On NCCL a wait cannot tell which bucket it is for: the step, and the bucket from the reports.
    assert "on rank 0, a bucket of synchronised step 3 waited" in summary, summary
    assert "rank 1 never launched bucket 0 of step 3" in summary, summary
    assert "ending rank 0" in ends[0].stderr, ends[0].stderr  # the thread declared: the main thread sat in the wait
    for rank, end in ends.items():
        assert end.ok is False or (end.ok is None and end.exitcode == 1), (rank, end)


def warm_up_busy_then_stuck(rank: int, directory: str) -> None:
    """Two wrapped models (a GAN's pair) beside the user's own faulthandler timer: a slow first step,
    then rank 0 busy in a known phase, then rank 1 stuck. Only the last is a hang."""
    lit_dp.init_parallel_env()
    users_timer = open(os.path.join(directory, f"user_timer_rank{rank}.txt"), "w")
    faulthandler.dump_traceback_later(3.0, file=users_timer)  # fires during the slow first step
    models = [lit_dp.DataParallel(nn.Linear(6, 3), hang_timeout=HANG_TIMEOUT) for _ in range(2)]
    for model in models:
        model.watchdog.directory = directory
    for step in range(8):
        if step == 0 and rank == 1:
            time.sleep(2 * HANG_TIMEOUT)  # compiling, say: warm-up has the long deadline
        if step == 3 and rank == 0:
            with models[0].watchdog.phase("evaluation on rank 0"):
                time.sleep(2 * HANG_TIMEOUT)  # busy on purpose: the others wait with the long deadline
        if step == 6 and rank == 1:
            time.sleep(4 * HANG_TIMEOUT)  # a hang, after warm-up and outside any phase
        for model in models:
            model(torch.randn(4, 6)).sum().backward()


@pytest.mark.slow
def test_warm_up_and_a_known_phase_get_the_long_deadline_and_a_later_hang_is_still_caught(tmp_path):
    ends = run_job(warm_up_busy_then_stuck, 2, tmp_path, str(tmp_path), timeout=120, PADDLE_PG_TIMEOUT="60000")
    message = ends[0].payload
    assert ends[0].ok is False and "bucket 0 of synchronised step 6 waited" in message, ends[0]
    assert f"{LONG_DEADLINE_SHARE * 60:g}s during warm-up and known phases" in message, message
    # Rank 1 sleeps past the grace: its watchdog ends the process, with its stacks on stderr.
    assert ends[1].exitcode == 1 and "did not end within 5s of the verdict" in ends[1].stderr, ends[1]
    # Each model's watchdog keeps its own deadlines: the user's own faulthandler timer still fired.
    for rank in (0, 1):
        assert "warm_up_busy_then_stuck" in (tmp_path / f"user_timer_rank{rank}.txt").read_text()


def gradient_kept_after_zero_grad(rank: int, hang_timeout: float | None) -> list[bool]:
    """Whether a step's 4 MB gradient (all-reduced in place: its bucket's future holds it) is still
    alive once the optimizer stepped and ``zero_grad`` dropped it. Gloo's worker thread lets go of a
    finished collective's tensors a moment after its wait returns (later on a loaded machine), so
    this waits up to 5 s for that; what the watchdog kept, it kept until the next forward."""
    import gc
    import time
    import weakref

    lit_dp.init_parallel_env()
    model = lit_dp.DataParallel(nn.Linear(1024, 1024), hang_timeout=hang_timeout)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    kept = []
    for _ in range(3):
        model(torch.randn(4, 1024)).square().mean().backward()
        optimizer.step()
        gradient = weakref.ref(model.module.weight.grad)
        optimizer.zero_grad(set_to_none=True)
        deadline = time.monotonic() + 5.0
        while gradient() is not None and time.monotonic() < deadline:
            gc.collect()
            time.sleep(0.01)
        kept.append(gradient() is not None)
    return kept


def test_the_watchdog_keeps_no_step_s_gradients_past_the_step():
    # It kept the bucket launches, whose futures hold the gradients, until the next forward: a
    # whole step's gradients alive through the next one, and freed (unmapped) inside its forward.
    assert run_ranks(gradient_kept_after_zero_grad, 2, HANG_TIMEOUT * 100) == {0: [False] * 3, 1: [False] * 3}
