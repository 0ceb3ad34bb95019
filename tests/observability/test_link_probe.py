"""The link probe on real gloo processes: every rank times each size, and the group works after it."""

from __future__ import annotations

from lit_dp.observability.link_probe import PROBE_BYTES
from tests.helpers.distributed import run_ranks


def probe_then_sum(rank):
    import torch
    import torch.distributed as dist

    import lit_dp
    from lit_dp.observability.link_probe import probe_link

    lit_dp.init_parallel_env()
    probe = probe_link(dist.group.WORLD, torch.device("cpu"))
    summed = torch.full((4,), float(rank + 1))
    dist.all_reduce(summed)
    return probe, summed.tolist()


def test_every_rank_times_each_size_and_the_group_sums_after_it():
    results = run_ranks(probe_then_sum, 2, timeout=90)
    assert sorted(results) == [0, 1]
    for rank, (probe, summed) in results.items():
        assert probe["bytes"] == list(PROBE_BYTES), f"rank {rank}: {probe}"
        assert all(ms > 0 for ms in probe["ms"]), f"rank {rank}: {probe}"
        # 8 MB is 128 times 64 KB: on any link more than a latency apart.
        assert probe["ms"][-1] > probe["ms"][0], f"rank {rank}: {probe}"
        assert summed == [3.0] * 4, f"rank {rank}: the probe left the group summing {summed}"
