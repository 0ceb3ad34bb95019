"""Sparse gradients: the NCCL path (all-gather and sum) equals Gloo's sparse all-reduce."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_ranks


def sparse_allgather_matches_allreduce(rank):
    import torch.distributed as dist

    import lit_dp
    from lit_dp.gradients.sparse import allgather_sparse_sum

    lit_dp.init_parallel_env()
    indices = torch.tensor([[rank, 3, 5 + rank]])
    gradient = torch.sparse_coo_tensor(indices, torch.randn(3, 4, generator=torch.Generator().manual_seed(rank)), (9, 4))
    gathered = allgather_sparse_sum(gradient, dist.group.WORLD)
    reduced = gradient.coalesce()
    dist.all_reduce(reduced)
    torch.testing.assert_close(gathered.to_dense(), reduced.to_dense())


@pytest.mark.slow
def test_sparse_allgather_path_equals_gloo_sparse_allreduce():
    run_ranks(sparse_allgather_matches_allreduce, 3)
