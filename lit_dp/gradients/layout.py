"""The reducer's bucket layout: which parameters travel together, in launch order, as bucket objects.

Pure bookkeeping over ``assign_group_by_size`` (``lit_dp.gradients.buckets``): the reducer
decides when to (re)build, this module what the buckets are. A bucket holds parameters of one
dtype and device; sparse gradients get one of their own (``SparseBucket``); under sharding
stage 2 a dense bucket reduces each gradient to its owner (``ScatterBucket``); otherwise it is a
``DenseBucket``, numbered among the dense ones for a communication hook.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from lit_dp.gradients.buckets import assign_group_by_size
from lit_dp.gradients.dense import DenseBucket
from lit_dp.gradients.hooks import CommHook
from lit_dp.gradients.scatter import ScatterBucket
from lit_dp.gradients.sparse import SparseBucket
from lit_dp.gradients.waiting import Waiter

Bucket = DenseBucket | ScatterBucket | SparseBucket


def launch_order(
    params: Sequence[nn.Parameter], sparse: Sequence[bool], forward_order: list[int], limits: list[int]
) -> list[list[int]]:
    """Parameter indices per bucket, cut from ``forward_order`` with ``limits`` (the last bucket's
    first), in launch order: the first group in forward order completes last in backward."""
    groups = assign_group_by_size([params[i] for i in forward_order], [sparse[i] for i in forward_order], limits)
    return [[forward_order[pos] for pos in group] for group in reversed(groups)]


def build_buckets(
    params: Sequence[nn.Parameter],
    sparse: Sequence[bool],
    owners: Sequence[int] | None,
    forward_order: list[int],
    limits: list[int],
    rings: Sequence[dist.ProcessGroup],
    comm_hook: CommHook | None,
    as_view: bool,
    waiter: Waiter,
) -> tuple[list[Bucket], list[int], list[torch.Tensor | None]]:
    """The buckets in launch order; per parameter, its bucket's position and its view in a flat buffer.

    Bucket ``k`` is reduced on ring ``k mod len(rings)``; ``owners`` (sharding stage 2) gives each
    parameter's owning rank.
    """
    layout = launch_order(params, sparse, forward_order, limits)
    buckets: list[Bucket] = []
    bucket_of = [0] * len(params)
    view_of: list[torch.Tensor | None] = [None] * len(params)
    # A hook numbers the dense buckets only: torch's hooks do not apply to sparse gradients.
    dense_count = sum(not sparse[indices[0]] for indices in layout)
    dense_index = 0
    for position, indices in enumerate(layout):
        ring = rings[position % len(rings)]
        members = [params[i] for i in indices]
        bucket: Bucket
        if sparse[indices[0]]:
            bucket = SparseBucket(indices, members, ring)
        elif owners is not None:
            bucket = ScatterBucket(indices, members, ring, [owners[i] for i in indices])
        else:
            hook = None if comm_hook is None else (comm_hook, dense_index, dense_count)
            bucket = DenseBucket(indices, members, ring, as_view, hook)
            dense_index += 1
        bucket.waiter = waiter
        buckets.append(bucket)
        for slot, index in enumerate(indices):
            bucket_of[index] = position
            if isinstance(bucket, DenseBucket):
                view_of[index] = bucket.views[slot]
    return buckets, bucket_of, view_of
