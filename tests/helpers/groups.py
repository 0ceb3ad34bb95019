"""A process group of one rank in this process, for tests of code that needs a group but no peers."""

from __future__ import annotations

import torch.distributed as dist


def one_rank_group() -> dist.ProcessGroup:
    """The default group, one Gloo rank, over an in-process store (the autouse fixture destroys it)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.group.WORLD
