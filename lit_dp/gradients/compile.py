"""Overlap under ``torch.compile``: graph breaks at bucket boundaries.

A compiled module runs its whole backward as one autograd node, so every gradient would
arrive when that node ends and no bucket could start early. torch DDP solves this with
dynamo's ``DDPOptimizer``: while a DDP module runs its forward, dynamo splits each graph it
compiles into pieces of about one bucket of parameters each (in reverse order, as gradients
are produced), so each piece's backward hands its gradients over, and its bucket starts,
while the earlier pieces' backward still runs.

Dynamo looks for the module whose forward is running through
``DistributedDataParallel._active_ddp_module`` and reads only its ``bucket_bytes_cap``; torch's
own composable ``replicate`` registers itself the same way. ``DataParallel`` does so around
its forward, and only the graph splitting is borrowed: the reducer is lit_dp's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import torch
from torch.nn.parallel import DistributedDataParallel


class HasBucketCap(Protocol):
    bucket_bytes_cap: int


@contextmanager
@torch.compiler.disable(recursive=False)
def bucket_graph_breaks(module: HasBucketCap) -> Iterator[None]:
    """Make graphs compiled inside break every ``module.bucket_bytes_cap`` bytes of parameters.

    Nested use restores the outer module, as torch DDP does.
    """
    outer = DistributedDataParallel._active_ddp_module
    DistributedDataParallel._active_ddp_module = module  # type: ignore[assignment]
    try:
        yield
    finally:
        DistributedDataParallel._active_ddp_module = outer
