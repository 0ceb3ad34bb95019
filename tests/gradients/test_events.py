"""What the reducer tells its observers, in what order, and the one request it takes between steps."""

from __future__ import annotations

import time

import torch
from torch import nn

from lit_dp.gradients.buckets import MB
from lit_dp.gradients.events import BucketLaunch, ReducerObserver
from lit_dp.gradients.plan import Participation, StepPlan
from lit_dp.gradients.reducer import Reducer
from lit_dp.gradients.waiting import Waiter
from tests.helpers.groups import one_rank_group


class Recorder(ReducerObserver):
    def __init__(self) -> None:
        self.moments: list[tuple] = []

    def step_started(self, step: int, plan: StepPlan) -> None:
        self.moments.append(("step_started", step))

    def backward_started(self, step: int) -> None:
        self.moments.append(("backward_started", step))

    def bucket_ready(self, step: int, position: int) -> None:
        self.moments.append(("bucket_ready", step, position))

    def bucket_launched(self, launch: BucketLaunch) -> None:
        self.moments.append(("bucket_launched", launch.step, launch.position, tuple(launch.indices), launch.nbytes))

    def backward_ended(self, step: int) -> None:
        self.moments.append(("backward_ended", step))

    def step_ended(self, step: int) -> None:
        self.moments.append(("step_ended", step))


def reducer_and_model(bucket_bytes: int) -> tuple[Reducer, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    params = list(model.parameters())
    reducer = Reducer(
        params,
        [name for name, _ in model.named_parameters()],
        [one_rank_group()],
        bucket_bytes=bucket_bytes,
        last_bucket_bytes=bucket_bytes,
        sparse=[False] * len(params),
        waiter=Waiter(),
    )
    return reducer, model


def step(reducer: Reducer, model: nn.Module) -> None:
    outputs = model(torch.randn(4, 8))
    reducer.prepare_for_backward(StepPlan.decide(Participation.SYNC, False, 1), outputs)
    outputs.square().mean().backward()
    model.zero_grad(set_to_none=True)


def test_every_moment_in_order_with_each_bucket_once():
    reducer, model = reducer_and_model(bucket_bytes=300)  # about one layer's weight and bias per bucket
    recorder = Recorder()
    reducer.add_observer(recorder)
    step(reducer, model)
    kinds = [moment[0] for moment in recorder.moments]
    buckets = len(reducer.bucket_indices)
    # Buckets complete in launch order here (registration order is backward's reverse): each is
    # ready, then launched at once.
    each_bucket = ["bucket_ready", "bucket_launched"] * buckets
    assert kinds == ["step_started", "backward_started", *each_bucket, "backward_ended", "step_ended"]
    ready = [moment[2] for moment in recorder.moments if moment[0] == "bucket_ready"]
    assert ready == list(range(buckets))
    launched = [moment for moment in recorder.moments if moment[0] == "bucket_launched"]
    assert [moment[2] for moment in launched] == list(range(buckets))
    assert sorted(i for moment in launched for i in moment[3]) == list(range(6))
    assert sum(moment[4] for moment in launched) == sum(p.numel() * 4 for p in model.parameters())
    assert reducer.step == 0


class UsedInReverse(nn.Module):
    """Registered a, b; used b then a: backward reaches a's gradients first."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.a(torch.tanh(self.b(inputs)))


def test_a_bucket_complete_before_an_earlier_one_is_ready_at_once_and_launched_in_turn():
    # Before the rebuild buckets follow registration: bucket 0 holds b (registered last), bucket 1
    # holds a, whose gradients backward computes first. Bucket 1 is ready first, and waits for 0.
    torch.manual_seed(0)
    model = UsedInReverse()
    reducer = Reducer(
        list(model.parameters()),
        [name for name, _ in model.named_parameters()],
        [one_rank_group()],
        bucket_bytes=288,  # a bucket closes once it holds a layer's weight (256 bytes) and bias (32)
        last_bucket_bytes=288,
        sparse=[False] * 4,
        waiter=Waiter(),
    )
    recorder = Recorder()
    reducer.add_observer(recorder)
    step(reducer, model)
    order = [(moment[0], moment[2]) for moment in recorder.moments if moment[0] in ("bucket_ready", "bucket_launched")]
    assert order == [("bucket_ready", 1), ("bucket_ready", 0), ("bucket_launched", 0), ("bucket_launched", 1)]


def test_requested_limits_apply_at_the_next_step_start_before_arming():
    reducer, model = reducer_and_model(bucket_bytes=300)
    step(reducer, model)  # the ready-order rebuild is agreed here
    one_bucket = reducer.partition(MB, MB)
    assert len(one_bucket) == 1 and len(reducer.bucket_indices) > 1  # a partition is only computed

    class AskForOneBucket(ReducerObserver):
        def step_started(self, step: int, plan: StepPlan) -> None:
            reducer.request_bucket_limits(MB, MB)

    reducer.add_observer(AskForOneBucket())
    recorder = Recorder()
    reducer.add_observer(recorder)
    step(reducer, model)
    assert reducer.bucket_indices == one_bucket
    assert [moment for moment in recorder.moments if moment[0] == "bucket_launched"][0][3] == tuple(one_bucket[0])


class Sleeper(ReducerObserver):
    """Sleeps in the moments named, as a slow observer would, and reads the reducer's host work when backward ends."""

    def __init__(self, reducer: Reducer, **seconds: float) -> None:
        self.reducer = reducer
        self.seconds = seconds
        self.read: list[float] = []
        self.ready: list[tuple[float | None, ...] | None] = []

    def _sleep(self, moment: str) -> None:
        time.sleep(self.seconds.get(moment, 0.0))

    def step_started(self, step: int, plan: StepPlan) -> None:
        self._sleep("step_started")

    def bucket_ready(self, step: int, position: int) -> None:
        self._sleep("bucket_ready")

    def bucket_launched(self, launch: BucketLaunch) -> None:
        self._sleep("bucket_launched")

    def backward_ended(self, step: int) -> None:
        self.read.append(self.reducer.host_work_ms())
        self.ready.append(self.reducer.gradients_ready_ms())

    def step_ended(self, step: int) -> None:
        self._sleep("step_ended")


def test_the_host_work_counts_arming_hooks_and_the_last_end_and_leaves_the_launches_out():
    reducer, model = reducer_and_model(bucket_bytes=300)
    buckets = len(reducer.bucket_indices)
    assert buckets >= 2
    sleeper = Sleeper(reducer, step_started=0.02, bucket_ready=0.01, bucket_launched=0.2, step_ended=0.03)
    reducer.add_observer(sleeper)
    step(reducer, model)
    assert sleeper.read == [0.0]  # not timed unless asked (the communication profile asks)
    reducer.times_host_work = True
    step(reducer, model)
    step(reducer, model)
    own = 20 + 10 * buckets  # ms slept where the reducer's own work runs: arming, and each bucket's hook
    launches = 200 * buckets  # ms slept in the launches, which the profile times on their own
    first, second = sleeper.read[1:]
    # Generous upper bounds: the reducer's own arithmetic is microseconds, a loaded machine slower.
    assert own <= first < own + 100 < launches, first  # the first timed step: no timed end before it
    assert own + 30 <= second < own + 30 + 100, second  # with the end of the step before: its step_ended
    assert reducer.host_work_ms() == 0.0  # outside a step


def test_each_gradient_s_ready_moment_is_timed_from_the_first():
    reducer, model = reducer_and_model(bucket_bytes=300)
    sleeper = Sleeper(reducer, bucket_ready=0.02)
    reducer.add_observer(sleeper)
    step(reducer, model)
    assert sleeper.ready == [None]  # not timed unless asked
    reducer.times_host_work = True
    step(reducer, model)
    ready = sleeper.ready[-1]
    assert ready is not None and len(ready) == len(reducer.parameters) and min(ready) == 0.0
    # Each bucket's observers sleep 20 ms when it is complete, before the next gradients arrive: a
    # later bucket's gradients are ready at least that much after an earlier one's.
    first, *later = reducer.bucket_indices
    for bucket in later:
        assert min(ready[i] for i in bucket) >= max(ready[i] for i in first) + 20, ready
    assert reducer.gradients_ready_ms() is None  # outside a step
