"""What the reducer tells its observers, in what order, and the one request it takes between steps."""

from __future__ import annotations

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
    assert kinds == ["step_started", "backward_started", *["bucket_launched"] * buckets, "backward_ended", "step_ended"]
    launched = [moment for moment in recorder.moments if moment[0] == "bucket_launched"]
    assert [moment[2] for moment in launched] == list(range(buckets))
    assert sorted(i for moment in launched for i in moment[3]) == list(range(6))
    assert sum(moment[4] for moment in launched) == sum(p.numel() * 4 for p in model.parameters())
    assert reducer.step == 0


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
