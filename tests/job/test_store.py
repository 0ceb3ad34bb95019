"""lit_dp's keys in the rendezvous store: one namespace per group, so that disjoint groups train at once."""

from __future__ import annotations

import copy

import pytest
import torch

from lit_dp.job.store import _describe_members
from tests.helpers.distributed import run_ranks

STEPS = 3


def test_a_groups_members_name_its_namespace():
    assert _describe_members([0, 1, 2, 3]) == "0-3"
    assert _describe_members([0, 2, 4]) == "0_2_4"
    assert _describe_members([0, 1, 4, 5, 7]) == "0-1_4-5_7"
    every_other = _describe_members(list(range(0, 1000, 2)))
    assert every_other.startswith("500_") and len(every_other) == 4 + 16  # a digest past 64 characters
    assert every_other != _describe_members(list(range(1, 1000, 2)))


def train_two_groups_at_once(rank):
    """Ranks [0, 1] train one model and ranks [2, 3] another, each inside Join with its hang watchdog (on by default)."""
    import torch.distributed as dist

    import lit_dp
    from lit_dp.job.store import group_store_prefix, rendezvous_store
    from tests.helpers.equivalence import assert_same_gradients, assert_same_parameters
    from tests.helpers.models import MODELS, batch, loss, reference_loss, shard

    lit_dp.init_parallel_env(timeout=150)
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both, in one order
    group = groups[rank // 2]
    group_rank, group_size = dist.get_rank(group), dist.get_world_size(group)
    torch.manual_seed(rank // 2)
    base = MODELS[("tied", "mixed")[rank // 2]]()
    reference = copy.deepcopy(base)
    if group_rank > 0:  # construction must broadcast the group's first rank's values: global rank 0, or 2
        with torch.no_grad():
            for param in base.parameters():
                param.add_(1.0)
    model = lit_dp.DataParallel(base, group=group)
    watchdog = model.watchdog
    assert watchdog is not None, "DataParallel starts a hang watchdog by default"
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    with model.join():
        for step in range(STEPS):
            inputs, targets = batch(step, group_size)
            loss(model, shard(inputs, group_rank), shard(targets, group_rank), group_rank, step).backward()
            reference_loss(reference, step, group_size).backward()
            assert_same_gradients(model, reference, f"rank {rank} step {step} vs one process on its group's batch")
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    assert_same_parameters(model, reference, f"rank {rank} after {STEPS} steps")
    store = rendezvous_store()
    counted = {
        "watchdogs": store.add(f"{group_store_prefix('watchdog', group)}/instances", 0),
        "join contexts": store.add(f"{group_store_prefix('join', group)}/contexts", 0),
        "watchdog keys": watchdog._prefix,
        "join context": model.join_state.context,
    }
    dist.barrier()  # rank 0 hosts the store: it stays until every rank has read its counts
    return counted


@pytest.mark.slow
def test_two_disjoint_groups_train_two_models_at_once_with_their_own_store_counters():
    """Each group's gradients equal one process's on its own batch; each group counts its own
    watchdogs and Join contexts (one of each per member), so both number theirs 0."""
    results = run_ranks(train_two_groups_at_once, 4, timeout=180, launcher="torchrun")
    for rank, result in results.items():
        members = "0-1" if rank < 2 else "2-3"
        assert result == {
            "watchdogs": 2,
            "join contexts": 2,
            "watchdog keys": f"lit_dp/watchdog/ranks_{members}/0",
            "join context": 0,
        }, f"rank {rank}"
