"""Parameter broadcast on real gloo processes: rank 0's state everywhere; differing models named."""

from __future__ import annotations

from torch import nn

from tests.helpers.distributed import run_ranks


def different_models(rank):
    import lit_dp

    lit_dp.init_parallel_env()
    lit_dp.DataParallel(nn.Linear(4, 4 + rank))


def test_models_that_differ_between_ranks_fail_on_every_rank_by_name():
    failures = run_ranks(different_models, 2, expect_failure=True, timeout=60)
    assert sorted(failures) == [0, 1]
    for trace in failures.values():
        assert "ranks [1] differ from rank 0" in trace
        assert "weight: rank 0 has shape [4, 4] torch.float32, rank 1 has shape [5, 4] torch.float32" in trace


def broadcast_within_ranks_one_and_two(rank):
    """Global rank 0 stays out of the group [1, 2]: its default source is the group's first rank, 1."""
    import torch
    import torch.distributed as dist

    import lit_dp

    lit_dp.init_parallel_env()
    group = dist.new_group([1, 2])  # every rank of the world creates it
    if rank == 0:
        dist.barrier()  # rank 0 hosts the store the others' group keeps using
        return None
    module = nn.Linear(2, 2)
    with torch.no_grad():
        module.weight.fill_(rank)
    lit_dp.sync_params_buffers(module, group=group)
    by_default = module.weight[0, 0].item()
    with torch.no_grad():
        module.weight.fill_(rank)
    lit_dp.sync_params_buffers(module, group=group, src_rank=2)
    chosen = module.weight[0, 0].item()
    try:
        lit_dp.sync_params_buffers(module, group=group, src_rank=0)
    except ValueError as error:
        outside = str(error)
    with torch.no_grad():
        module.weight.fill_(rank)
    wrapped = lit_dp.DataParallel(module, group=group)
    dist.barrier()
    return by_default, chosen, outside, wrapped.module.weight[0, 0].item()


def test_a_subgroup_without_global_rank_zero_broadcasts_from_its_first_rank():
    results = run_ranks(broadcast_within_ranks_one_and_two, 3, timeout=120)
    outside = "src_rank=0 is invalid: expected one of the group's global ranks [1, 2]."
    assert results == {0: None, 1: (1.0, 2.0, outside, 1.0), 2: (1.0, 2.0, outside, 1.0)}
