"""Communication statistics: per-step records from 2 real gloo ranks, exposed-time arithmetic, hook time."""

from __future__ import annotations

import functools
import threading
import time

import pytest
import torch
from torch import nn

from lit_dp.observability.stats import BucketSpan, StepTimeline
from tests.helpers.distributed import run_ranks
from tests.helpers.observability import KB, STATS_STEPS, make_model, train_step


def test_statistics_on_two_ranks(two_ranks):
    results, _ = two_ranks
    for rank, result in results.items():
        assert [s.step for s in result["stats"]] == list(range(STATS_STEPS)), f"rank {rank}"
        for s in result["stats"][1:]:  # after the ready-order rebuild (step 0 may bucket differently)
            assert s.buckets == result["buckets"] > 2, f"rank {rank}: {s}"
        for s in result["stats"]:
            assert s.bytes == result["gradient_bytes"], f"rank {rank}: {s}"
            assert s.time_ms > 0 and 0 <= s.exposed_ms <= s.time_ms and 0 <= s.overlap <= 1, f"rank {rank}: {s}"
            assert s.overlap == pytest.approx(1 - s.exposed_ms / s.time_ms)


HOOK_DELAY_S = 0.05


def late_allreduce(delay_s: float, last_bucket_only: bool = False):
    """A communication hook whose all-reduce's result comes ``delay_s`` after it (only the last
    bucket's with ``last_bucket_only``)."""
    import torch.distributed as dist

    def hook(state: None, bucket) -> torch.futures.Future:
        gradients = bucket.buffer().div_(dist.get_world_size())
        work = dist.all_reduce(gradients, async_op=True)
        result: torch.futures.Future = torch.futures.Future()

        def finish_later() -> None:  # on its own thread, so the hook returns at once, as real ones do
            work.wait()
            if bucket.is_last() or not last_bucket_only:
                time.sleep(delay_s)
            result.set_result(gradients)

        threading.Thread(target=finish_later, daemon=True).start()
        return result

    return hook


def stats_with_a_slow_hook(rank: int) -> list[float]:
    """A hook whose result comes 50 ms after its all-reduce: communication time must include it."""
    import lit_dp

    lit_dp.init_parallel_env()
    wrapped = lit_dp.DataParallel(make_model(), comm_stats=True)
    wrapped.register_comm_hook(None, late_allreduce(HOOK_DELAY_S))
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.01)
    times = []
    for step in range(2):
        train_step(wrapped, optimizer, step)
        times.append(wrapped.comm_stats().time_ms)
    return times


def test_comm_time_includes_the_hooks_collectives():
    for rank, times in run_ranks(stats_with_a_slow_hook, 2, timeout=60).items():
        # Without the hook's future, only the flags' all-reduce (well under a millisecond) would count.
        assert all(ms >= 0.8 * HOOK_DELAY_S * 1e3 for ms in times), f"rank {rank}: {times}"


PAUSE_S = 0.05


class _Pause(torch.autograd.Function):
    """The identity, whose backward sleeps: the buckets launched before it complete meanwhile."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(PAUSE_S)
        return grad


def timelines_with_a_pause_in_backward(rank: int, last_bucket_late: bool = False) -> dict:
    import lit_dp

    lit_dp.init_parallel_env()
    torch.manual_seed(0)
    first, second, third = nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 4)
    model = nn.Sequential(first, nn.ReLU(), second, nn.ReLU(), third)
    first.register_forward_hook(lambda module, args, out: _Pause.apply(out))  # its gradients' bucket waits
    timelines = []
    wrapped = lit_dp.DataParallel(model, comm_buffer_size=4 * KB, last_comm_buffer_size=4 * KB, comm_stats=True)
    if last_bucket_late:
        wrapped.register_comm_hook(None, late_allreduce(PAUSE_S, last_bucket_only=True))  # pending at backward's end
    observer = wrapped._observers.stats
    observer._sinks.append(timelines.append)
    marked_on = set()
    mark = observer._clock.mark
    observer._clock.mark = lambda: marked_on.add(threading.get_ident()) or mark()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(3):
        train_step(wrapped, optimizer, step)
    wrapped.comm_stats()
    return {"timelines": timelines[1:], "marked_on": marked_on, "main": threading.get_ident()}


def test_on_cpu_the_training_thread_marks_each_bucket_complete_at_the_reducers_next_moment():
    # Gloo runs a future's callbacks on its worker thread, which must then take the interpreter lock before
    # its next all-reduce: the statistics put none there. The buckets of the last two layers' gradients,
    # launched before the pause, complete during it and are seen at the next moment (the first layer's
    # buckets ready, or backward's end): before backward ends, so they expose nothing.
    for rank, result in run_ranks(timelines_with_a_pause_in_backward, 2, timeout=60).items():
        assert result["marked_on"] == {result["main"]}, f"rank {rank}: marks taken on {result['marked_on']}"
        for timeline in result["timelines"]:
            early = [b for b in timeline.buckets if b.launch < timeline.backward_end - 0.8 * PAUSE_S]
            assert early and len(early) < len(timeline.buckets), f"rank {rank}: {timeline}"
            assert all(b.end <= timeline.backward_end for b in early), f"rank {rank}: {timeline}"
            assert timeline.stats().exposed_ms < 0.8 * PAUSE_S * 1e3, f"rank {rank}: {timeline}"
            # Their ends are only bounds: the forecast takes no link pace from them.
            assert all(b.end_bounded for b in early), f"rank {rank}: {timeline}"


def test_on_cpu_a_bucket_still_pending_when_backward_ends_has_its_end_measured_not_bounded():
    results = run_ranks(functools.partial(timelines_with_a_pause_in_backward, last_bucket_late=True), 2, timeout=60)
    for rank, result in results.items():
        for timeline in result["timelines"]:
            early = [b for b in timeline.buckets if b.launch < timeline.backward_end - 0.8 * PAUSE_S]
            last = max(timeline.buckets, key=lambda b: b.launch)
            assert early and all(b.end_bounded for b in early), f"rank {rank}: {timeline}"
            assert last.end >= timeline.backward_end + 0.8 * PAUSE_S, f"rank {rank}: {timeline}"
            assert not last.end_bounded, f"rank {rank}: {timeline}"


def test_exposed_time_is_communication_after_backward():
    """Two overlapping all-reduces and a later one; backward ends at 5."""
    buckets = (
        BucketSpan(0, 8, (0,), 1.0, 4.0), BucketSpan(1, 8, (1,), 3.0, 6.0), BucketSpan(2, 8, (2,), 7.0, 9.0),
    )  # fmt: skip
    stats = StepTimeline(step=3, start=0.0, backward_start=0.5, backward_end=5.0, reduced=9.5, buckets=buckets).stats()
    assert stats.time_ms == pytest.approx(7e3)  # [1, 6] and [7, 9]
    assert stats.exposed_ms == pytest.approx(3e3)  # [5, 6] and [7, 9]
    assert stats.overlap == pytest.approx(4 / 7)
    assert (stats.bytes, stats.buckets, stats.step) == (24, 3, 3)
