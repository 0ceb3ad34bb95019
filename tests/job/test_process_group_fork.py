"""Fork launchers after the launching process used lit_dp's own process group.

A Gloo group must be destroyed in the process that created it: a forked child has none of its
worker threads, and dropping its last reference there waits for them forever. So nothing lit_dp
keeps may hold a group past ``destroy_process_group()`` for a child to inherit.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from lit_dp import ParallelEnv, fabric, get_rings, init_parallel_env
from tests.helpers.distributed import launch_forking

# Ranks that hang stay asleep in a destructor; after this many seconds they are killed and named.
TIMEOUT = 30.0


def use_and_destroy_one_rank_group() -> weakref.ref:
    """What a one-device run leaves behind: lit_dp's group of one rank (two rings), used, then
    destroyed with ``dist.destroy_process_group()`` as Lightning and this suite's conftest do."""
    init_parallel_env(parallel_env=ParallelEnv({"FLAGS_nccl_nrings": "2"}), backend="gloo", one_process_group=True)
    rings = get_rings()
    assert len(rings) == 2
    for ring in rings:
        dist.all_reduce(torch.ones(2), group=ring)
    world = weakref.ref(rings[0])
    del rings
    dist.destroy_process_group()
    return world


def test_destroy_process_group_frees_the_group_in_this_process():
    world = use_and_destroy_one_rank_group()
    gc.collect()
    assert world() is None, "the destroyed group is still referenced: a forked child would inherit it"


def train(run: Fabric) -> str:
    torch.manual_seed(0)
    net = nn.Linear(4, 1)
    model, optimizer = run.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for _ in range(2):
        run.backward(model(torch.randn(2, 4)).sum())
        optimizer.step()
        optimizer.zero_grad()
    assert model._forward_module.comm_hook.name.endswith("allreduce_hook")
    return "trained"


def fork_ranks_after_using_gloo() -> str:
    use_and_destroy_one_rank_group()
    strategy = fabric.PaddleDPStrategy(ddp_comm_hook=allreduce_hook, start_method="fork")
    return Fabric(strategy=strategy, accelerator="cpu", devices=2).launch(train)


@pytest.mark.slow
def test_fork_ranks_with_a_comm_hook_after_the_parent_used_gloo():
    assert launch_forking(fork_ranks_after_using_gloo, timeout=TIMEOUT) == "trained"
