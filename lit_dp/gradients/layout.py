"""The reducer's bucket layout: which parameters travel together, in launch order, as bucket objects.

Pure bookkeeping over ``assign_group_by_size`` (``lit_dp.gradients.buckets``): the reducer
decides when to (re)build, this module what the buckets are. A bucket holds parameters of one
dtype and device; sparse gradients get one of their own (``SparseBucket``); under sharding
stage 2 a dense bucket reduces each gradient to its owner (``ScatterBucket``); otherwise it is a
``DenseBucket``, numbered among the dense ones for a communication hook.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from lit_dp.gradients.bucket import Bucket
from lit_dp.gradients.buckets import assign_group_by_size
from lit_dp.gradients.dense import DenseBucket
from lit_dp.gradients.hooks import CommHook
from lit_dp.gradients.scatter import ScatterBucket
from lit_dp.gradients.sparse import SparseBucket
from lit_dp.gradients.waiting import Waiter


def launch_order(
    params: Sequence[nn.Parameter], sparse: Sequence[bool], forward_order: list[int], limits: Sequence[int]
) -> list[list[int]]:
    """Parameter indices per bucket, cut from ``forward_order`` with ``limits`` (the last bucket's
    first), in launch order: the first group in forward order completes last in backward."""
    groups = assign_group_by_size([params[i] for i in forward_order], [sparse[i] for i in forward_order], limits)
    return [[forward_order[pos] for pos in group] for group in reversed(groups)]


@dataclass(frozen=True)
class BucketLayout:
    """The buckets of one layout, in launch order, and where each parameter is.

    Attributes:
        buckets: the bucket objects, in launch order.
        bucket_of: per parameter, its bucket's position.
        view_of: per parameter, its view in a dense bucket's flat buffer (None for in-place,
            sparse and scattered members).
        limits: the byte limits it was cut with: ``(last bucket, every other bucket)``.
        alone: every bucket skips its collectives (``trivially_alone``: one rank, no hook), so
            their flags would never leave this rank and none are set.
    """

    buckets: list[Bucket]
    bucket_of: list[int]
    view_of: list[torch.Tensor | None]
    limits: tuple[int, int]
    alone: bool = False

    def forward_order(self) -> list[int]:
        """The parameter order this layout was cut from (buckets are in launch order, members in forward order)."""
        return [index for bucket in reversed(self.buckets) for index in bucket.indices]


@dataclass(frozen=True)
class BucketFactory:
    """What every layout of one reducer shares: its parameters, their kinds and owners, the rings,
    the view mode and the wait policy. ``build`` cuts a layout from an order and limits.

    Bucket ``k`` is reduced on ring ``k mod len(rings)``; ``owners`` (sharding stage 2) gives each
    parameter's owning rank.
    """

    params: Sequence[nn.Parameter]
    sparse: Sequence[bool]
    owners: Sequence[int] | None
    rings: Sequence[dist.ProcessGroup]
    as_view: bool
    waiter: Waiter

    def build(self, forward_order: list[int], limits: tuple[int, int], comm_hook: CommHook | None) -> BucketLayout:
        params, sparse = self.params, self.sparse
        cut = launch_order(params, sparse, forward_order, limits)
        buckets: list[Bucket] = []
        bucket_of = [0] * len(params)
        view_of: list[torch.Tensor | None] = [None] * len(params)
        # A hook numbers the dense buckets only: torch's hooks do not apply to sparse gradients.
        dense_count = sum(not sparse[indices[0]] for indices in cut)
        dense_index = 0
        for position, indices in enumerate(cut):
            ring = self.rings[position % len(self.rings)]
            members = [params[i] for i in indices]
            bucket: Bucket
            if sparse[indices[0]]:
                bucket = SparseBucket(indices, members, ring, self.waiter)
            elif self.owners is not None:
                bucket = ScatterBucket(indices, members, ring, [self.owners[i] for i in indices], self.waiter)
            else:
                hook = None if comm_hook is None else (comm_hook, dense_index, dense_count)
                bucket = DenseBucket(indices, members, ring, self.as_view, hook, self.waiter)
                dense_index += 1
            buckets.append(bucket)
            for slot, index in enumerate(indices):
                bucket_of[index] = position
                if isinstance(bucket, DenseBucket):
                    view_of[index] = bucket.views[slot]
        return BucketLayout(buckets, bucket_of, view_of, limits, alone=all(bucket.alone for bucket in buckets))
