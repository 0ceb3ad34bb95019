"""``fused_allreduce_gradients``: Paddle's manual gradient averaging after ``no_sync()``, in coalesced buckets."""

from __future__ import annotations

from collections.abc import Iterable

import torch.distributed as dist
from torch import nn

from lit_dp.gradients.buckets import assign_group_by_size, megabytes_to_bytes
from lit_dp.gradients.dense import DenseBucket
from lit_dp.gradients.plan import Participation, StepPlan
from lit_dp.options import DEFAULT_BUCKET_MB


def fused_allreduce_gradients(
    parameters: Iterable[nn.Parameter],
    group: dist.ProcessGroup | None = None,
    comm_buffer_size: float = DEFAULT_BUCKET_MB,
) -> None:
    """Average the dense gradients of ``parameters`` over ``group`` in coalesced buckets (large ones in place).

    For manual synchronisation after ``no_sync()``. Every rank must pass the same parameters.
    A gradient that is None on some ranks counts as zeros there; one None on every rank stays None.
    """
    params = list(dict.fromkeys(p for p in parameters if p.requires_grad))
    if not params or dist.get_world_size(group) < 2:
        return
    sparse = [position for position, p in enumerate(params) if p.grad is not None and p.grad.is_sparse]
    if sparse:
        raise ValueError(
            f"fused_allreduce_gradients: parameters at positions {sparse} have sparse gradients: "
            "expected dense gradients (lit_dp.DataParallel reduces sparse ones)."
        )
    ring = group or dist.group.WORLD
    groups = assign_group_by_size(params, [False] * len(params), [megabytes_to_bytes("comm_buffer_size", comm_buffer_size)])
    buckets = [DenseBucket(indices, [params[i] for i in indices], ring) for indices in groups]
    has_grad = bytearray(p.grad is not None for p in params)
    # "Used here" flags: a flag sum of 0 says no rank had a gradient.
    plan = StepPlan.decide(Participation.SYNC, find_unused_parameters=True, divisor=dist.get_world_size(group))
    for bucket in buckets:
        bucket.start(plan, has_grad)
    for bucket in buckets:
        bucket.wait()
        # A flag sum of 0: no rank had a gradient, so .grad stays None.
        no_gradient = {k for k, total in enumerate(bucket.flags.tolist()) if total == 0}
        bucket.write_back(as_view=False, skipped=no_gradient)
