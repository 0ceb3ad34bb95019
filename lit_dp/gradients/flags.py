"""The per-parameter flags every bucket all-reduces with its gradients: one protocol for all buckets.

Each member of a bucket has one flag. The step plan's ``FlagMeaning`` says what a 1 means on
this rank ("used here" with ``find_unused_parameters``, "missing here" without it; a rank
without a backward of its own sets none); the all-reduce sums them into a count of ranks, and
``lit_dp.gradients.unused`` reads the counts. The dense, scatter and sparse buckets all set
their flags here, so the protocol is written once.

Flags are set with fills, never copied from host memory: on CUDA a copy from pageable memory
would block the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from lit_dp.gradients.plan import FlagMeaning


def members_present(indices: Sequence[int], params: Sequence[nn.Parameter], used: bytearray) -> list[bool]:
    """Per member: its gradient was accumulated since the last synchronisation and is there."""
    return [bool(used[i]) and p.grad is not None for i, p in zip(indices, params)]


def fill_flags(flags: torch.Tensor, meaning: FlagMeaning, present: Sequence[bool] | None, one: float = 1.0) -> None:
    """Set one flag per member for ``meaning``; ``present`` None: every member has its gradient.

    ``one`` is what a flag of 1 is written as: an averaging all-reduce (NCCL's ``AVG``) divides
    the flags too, so they start at the world size there and still sum to a count of ranks.
    """
    with_gradient = one if meaning is FlagMeaning.USED else 0.0
    without_gradient = one if meaning is FlagMeaning.MISSING else 0.0
    flags.fill_(with_gradient)
    if present is None or with_gradient == without_gradient:
        return
    for position, has_gradient in enumerate(present):
        if not has_gradient:
            flags[position].fill_(without_gradient)
