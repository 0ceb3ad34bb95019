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
