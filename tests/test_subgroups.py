"""``DataParallel(module, process_group=g)`` on subgroups: two disjoint groups of a 4-rank world train
two different models at once (real gloo processes, one spawn).

Group A is global ranks 0 and 1, group B ranks 2 and 3, which does not hold global rank 0. In
each group, one after the other and both groups at the same time:

- construction takes the group's first rank's parameters (rank 3 starts from other values);
  gradients equal a single process on the group's concatenated batch (tolerances:
  ``tests.helpers.equivalence``), for the tied model in A and the channels_last one in B;
- torch's ``Join`` with uneven inputs inside the group gives torch DDP's parameters on the same group;
- LocalSGD, on the model's group by default, leaves the group's ranks equal after ``finish()``;
- sharding (stage 1) steps each parameter on its owner in the group and matches plain SGD on the
  whole batch.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.helpers.distributed import run_ranks
from tests.helpers.equivalence import TINY_MB, assert_same_gradients, assert_same_parameters
from tests.helpers.models import MODELS, batch, loss, reference_loss, shard

STEPS = 3
GROUP_MODELS = ("tied", "channels_last")


def group_of(rank: int):
    """Both groups are created on every rank (torch's rule); each rank returns its own."""
    import torch.distributed as dist

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    return rank // 2, groups[rank // 2]


def same_within_group(tensor: torch.Tensor, group) -> bool:
    import torch.distributed as dist

    every = [torch.empty_like(tensor) for _ in range(group.size())]
    dist.all_gather(every, tensor.contiguous(), group=group)
    return all(torch.equal(every[0], other) for other in every)


def flat_parameters(model: nn.Module) -> torch.Tensor:
    return torch.cat([param.detach().reshape(-1) for param in model.parameters()])


def train_in_group(rank: int, index: int, group) -> None:
    import lit_dp

    me = group.rank()
    name = GROUP_MODELS[index]
    torch.manual_seed(index)
    base = MODELS[name]()
    reference = copy.deepcopy(base)
    if me == 1:
        with torch.no_grad():
            for param in base.parameters():
                param.add_(1.0)  # construction must broadcast the group's first rank's values
    model = lit_dp.DataParallel(base, process_group=group, comm_buffer_size=TINY_MB, last_comm_buffer_size=TINY_MB)
    assert model.process_group is group
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    for step in range(STEPS):
        seed = 100 * index + step
        inputs, targets = batch(seed, 2)
        loss(model, shard(inputs, me), shard(targets, me), me, seed).backward()
        reference_loss(reference, seed, 2).backward()
        assert_same_gradients(model.module, reference, f"group {index} ({name}) step {step} rank {rank}")
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    assert_same_parameters(model.module, reference, f"group {index} ({name}) rank {rank}")


def join_in_group(rank: int, index: int, group) -> None:
    from torch.nn.parallel import DistributedDataParallel

    import lit_dp

    me = group.rank()
    torch.manual_seed(10 + index)
    base = MODELS["tied"]()
    ddp = DistributedDataParallel(copy.deepcopy(base), process_group=group)
    ours = lit_dp.DataParallel(base, process_group=group)
    for model in (ours, ddp):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with model.join():
            for step in range(STEPS - me):  # the group's second rank runs out a step early
                inputs, targets = batch(200 + step, 2)
                loss(model, shard(inputs, me), shard(targets, me), me, step).backward()
                optimizer.step()
                optimizer.zero_grad()
    assert_same_parameters(ours.module, ddp.module, f"Join in group {index}, rank {rank}, against DDP")


def local_sgd_in_group(rank: int, index: int, group) -> None:
    import lit_dp

    me = group.rank()
    torch.manual_seed(20 + index)
    model = lit_dp.DataParallel(MODELS["tied"](), process_group=group)
    local_sgd = lit_dp.LocalSGD(model, local_steps=2)  # the model's group, without being told
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        inputs, targets = batch(300 + step, 2)
        loss(model, shard(inputs, me), shard(targets, me), me, step).backward()
        optimizer.step()
        optimizer.zero_grad()
        local_sgd.step()
    local_sgd.finish()
    assert same_within_group(flat_parameters(model), group), f"LocalSGD in group {index}: rank {rank} differs"


def sharding_in_group(rank: int, index: int, group) -> None:
    import lit_dp

    me = group.rank()
    torch.manual_seed(30 + index)
    base = MODELS["tied"]()
    reference = copy.deepcopy(base)
    model = lit_dp.DataParallel(base, process_group=group, sharding_stage=1)
    optimizers = [
        lit_dp.ShardedOptimizer(torch.optim.SGD, model, lr=0.1),
        torch.optim.SGD(reference.parameters(), lr=0.1),
    ]
    for step in range(2):
        seed = 400 + step
        inputs, targets = batch(seed, 2)
        loss(model, shard(inputs, me), shard(targets, me), me, seed).backward()
        reference_loss(reference, seed, 2).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    assert_same_parameters(model.module, reference, f"sharding in group {index}, rank {rank}")


def two_groups_at_once(rank: int) -> None:
    import torch.distributed as dist

    import lit_dp

    lit_dp.init_parallel_env()
    index, group = group_of(rank)
    for phase in (train_in_group, join_in_group, local_sgd_in_group, sharding_in_group):
        phase(rank, index, group)
    # Rank 0 hosts the store every group's models use: it stays until the other group is done.
    dist.barrier()


@pytest.mark.slow
def test_two_disjoint_groups_train_two_models_at_once():
    run_ranks(two_groups_at_once, 4, timeout=420)
