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

from typing import Protocol

import torch
from torch.nn.parallel import DistributedDataParallel


class HasBucketCap(Protocol):
    bucket_bytes_cap: int


class bucket_graph_breaks:  # noqa: N801 - used as a context manager, like contextlib's
    """Make graphs compiled inside break every ``module.bucket_bytes_cap`` bytes of parameters.

    Nested use restores the outer module, as torch DDP does. A class rather than a
    ``contextlib.contextmanager`` generator: dynamo of torch 2.8 (the floor) fails on a generator it is
    told not to trace (``torch.compiler.disable``) when it inlines contextlib's helper around it.
    """

    def __init__(self, module: HasBucketCap) -> None:
        self._module = module
        self._outer: HasBucketCap | None = None

    @torch.compiler.disable
    def __enter__(self) -> None:
        self._outer = DistributedDataParallel._active_ddp_module
        DistributedDataParallel._active_ddp_module = self._module  # type: ignore[assignment]

    @torch.compiler.disable
    def __exit__(self, *exc_info: object) -> None:
        DistributedDataParallel._active_ddp_module = self._outer  # type: ignore[assignment]
