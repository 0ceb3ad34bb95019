"""The link probe: on real gloo processes every rank times each size, and the group works after it; the order of its all-reduces."""

from __future__ import annotations

import torch

from lit_dp.observability.link_probe import PROBE_BYTES, probe_link
from tests.helpers.distributed import run_ranks


def probe_then_sum(rank):
    import torch.distributed as dist

    import lit_dp

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
        # 8 MB is 256 times 32 KB: on any link more than a latency apart.
        assert probe["ms"][-1] > probe["ms"][0], f"rank {rank}: {probe}"
        assert summed == [3.0] * 4, f"rank {rank}: the probe left the group summing {summed}"


class _RecordingGroup:
    """A group whose all-reduces only note their bytes, in order."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def allreduce(self, tensors):
        self.sizes.append(tensors[0].numel() * tensors[0].element_size())


def test_each_round_takes_every_size_in_turn_each_after_a_line_up():
    # A slow spell slows one try of each size, not every try of one; no rank times a peer still
    # ending the previous all-reduce.
    group = _RecordingGroup()
    sizes, repeats = (1024, 4096, 65536), 3
    probe = probe_link(group, torch.device("cpu"), wait=lambda work, what: None, sizes=sizes, repeats=repeats)
    one_round = [size for nbytes in sizes for size in (4, nbytes)]
    assert group.sizes == one_round * (repeats + 1)
    assert probe["bytes"] == list(sizes) and len(probe["ms"]) == len(sizes)
