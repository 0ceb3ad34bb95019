"""``DataParallel`` itself: without a process group, its options, and how a step decides to synchronise."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lit_dp.gradients.events import BucketLaunch, ReducerObserver
from lit_dp.gradients.plan import StepPlan
from tests.helpers.distributed import run_ranks


def test_world_size_one_runs_the_module_unchanged():
    module = nn.Linear(3, 2)
    with pytest.warns(UserWarning, match="world size is 1"):
        wrapped = __import__("lit_dp").DataParallel(module)
    x = torch.randn(4, 3)
    torch.testing.assert_close(wrapped(x), module(x))
    assert wrapped.reducer is None
    with wrapped.no_sync():
        wrapped(x).sum().backward()
    assert module.weight.grad is not None


@pytest.mark.parametrize(("option", "value"), [("comm_buffer_size", 0), ("last_comm_buffer_size", -1)])
def test_bucket_size_options_are_validated(option, value):
    with warnings.catch_warnings(), pytest.raises(ValueError, match=f"{option}={value} is invalid"):
        warnings.simplefilter("ignore")
        __import__("lit_dp").DataParallel(nn.Linear(2, 2), **{option: value})


class CountCollectives(ReducerObserver):
    """The reducer's synchronised steps and the buckets it launched."""

    def __init__(self) -> None:
        self.steps = self.launches = 0

    def step_started(self, step: int, plan: StepPlan) -> None:
        self.steps += 1

    def bucket_launched(self, launch: BucketLaunch) -> None:
        self.launches += 1


def accumulate_the_way_scripts_written_for_ddp_do(rank, steps, accumulate):
    """nanoGPT's accumulation: ``require_backward_grad_sync`` set before each micro-step's forward."""
    import copy

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import lit_dp
    from tests.helpers.equivalence import assert_same_gradients
    from tests.helpers.models import MODELS, batch, loss, reference_loss, shard

    lit_dp.init_parallel_env()
    world_size = dist.get_world_size()
    torch.manual_seed(0)
    base = MODELS["tied"]()
    reference, ddp_model = copy.deepcopy(base), copy.deepcopy(base)
    ours, ddp = lit_dp.DataParallel(base), DistributedDataParallel(ddp_model)
    counter = CountCollectives()
    ours.reducer.add_observer(counter)
    for step in range(steps):
        for micro in range(accumulate):
            seed = step * accumulate + micro
            inputs, targets = batch(seed, world_size)
            for model in (ours, ddp):
                model.require_backward_grad_sync = micro == accumulate - 1
                loss(model, shard(inputs, rank), shard(targets, rank), rank, seed).backward()
            reference_loss(reference, seed, world_size).backward()
        assert_same_gradients(ours, ddp, f"step {step} rank {rank} vs DDP")
        assert_same_gradients(ours, reference, f"step {step} rank {rank} vs one process")
        for model in (ours, ddp, reference):
            model.zero_grad(set_to_none=True)
    return counter.steps, counter.launches, len(ours.reducer.bucket_indices)


def test_require_backward_grad_sync_accumulates_locally_with_one_collective_round_per_step():
    steps, accumulate = 3, 4
    for rank, (synchronised, launches, buckets) in run_ranks(
        accumulate_the_way_scripts_written_for_ddp_do, 2, steps, accumulate
    ).items():
        assert synchronised == steps, f"rank {rank}: {synchronised} synchronised backwards for {steps} steps"
        assert launches == steps * buckets, f"rank {rank}: {launches} bucket launches, expected {steps} x {buckets}"
