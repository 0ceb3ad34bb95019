"""Sharding: each owner's updated parameters to every rank, in buckets, without copies.

After a sharded optimizer step only a parameter's owner holds its new value. ``ParameterGather``
moves each owner's parameters into one flat tensor per dtype (``param.data`` becomes a view
into it, as in ``ZeroRedundancyOptimizer(parameters_as_bucket_view=True)`` and Paddle's
``tensor_fusion``), so a bucket is a contiguous slice of that tensor: the owner broadcasts it
where the optimizer wrote it, the other ranks receive it where their module reads it, and
nothing is copied in or out, nor stored twice.

Buckets are launched all at once, asynchronously, in forward order (by the first parameter's
place in the module), so the first layers' parameters arrive first; ``wait_until`` waits for a
prefix of them, which lets a module's forward pre-hook wait only for the parameters it is
about to read (``lit_dp.ShardedOptimizer`` with ``sharding_overlap``). Broadcasts rather than
all-gathers: an owner's parameters are not split evenly, and on Gloo one broadcast per owner
is faster than its all-gather (docs/benchmarks.md, "Thresholds of the gradient path").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from lit_dp.gradients.buckets import assign_group_by_size
from lit_dp.gradients.waiting import UNWATCHED, Waiter


class ParameterGatherer(Protocol):
    """What may leave updated parameters in flight after an optimizer step (``lit_dp.ShardedOptimizer``
    with ``sharding_overlap``, which owns a ``ParameterGather``), as ``DataParallel`` waits for it."""

    def wait_for_parameters(self) -> None: ...


class ParameterGather:
    """Broadcasts each owner's parameters in buckets of at most ``bucket_bytes``.

    Args:
        params: the gathered parameters, in forward (registration) order.
        owners: the owning rank (in ``group``) of each.
        group: the ranks that share the parameters.
        bucket_bytes: bucket size limit (a bucket closes at the parameter that reaches it).
        waiter: how its waits are made (the model's: watched by the hang watchdog, when on).
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        owners: Sequence[int],
        group: dist.ProcessGroup,
        bucket_bytes: int,
        waiter: Waiter = UNWATCHED,
    ) -> None:
        self._group = group
        self._waiter = waiter
        self._buckets: list[tuple[int, torch.Tensor]] = []  # (owner, a rank of the group; slice), in launch order
        self._bucket_of: dict[int, int] = {}  # id(param) -> position of its bucket in launch order
        self._expected: list[tuple[nn.Parameter, int]] = []  # (param, data_ptr) once it lives in the flat storage
        self._works: list[dist.Work] = []
        self._waited = 0
        position = {id(param): index for index, param in enumerate(params)}
        pieces = []  # (first forward position, owner, slice, members)
        for (owner, _dtype, _device), members in _by_owner_dtype_device(params, owners).items():
            flat = _flatten_into_one_tensor(members)
            offsets = [0]
            for param in members:
                offsets.append(offsets[-1] + param.numel())
            for group_indices in assign_group_by_size(members, [False] * len(members), [bucket_bytes]):
                start, stop = offsets[group_indices[0]], offsets[group_indices[-1] + 1]
                chunk = [members[i] for i in group_indices]
                pieces.append((position[id(chunk[0])], owner, flat[start:stop], chunk))
            self._expected += [(param, param.data_ptr()) for param in members]
        for launch, (_, owner, piece, chunk) in enumerate(sorted(pieces, key=lambda item: (item[0], item[1]))):
            self._buckets.append((owner, piece))
            for param in chunk:
                self._bucket_of[id(param)] = launch

    def bucket_of(self, param: nn.Parameter) -> int | None:
        """The launch position of ``param``'s bucket; None for a parameter not gathered here."""
        return self._bucket_of.get(id(param))

    def start(self) -> None:
        """Launch every bucket's broadcast (after the owners' step)."""
        self.wait()
        for param, data_ptr in self._expected:
            if param.data_ptr() != data_ptr:
                raise RuntimeError(
                    "lit_dp.ShardedOptimizer: a parameter of shape "
                    f"{tuple(param.shape)} no longer lives in the flat storage the optimizer built for it (was the "
                    "model moved, cast or its parameters replaced after the optimizer was created?). Build the "
                    "ShardedOptimizer after the model is on its device and in its dtype."
                )
        self._works = [
            dist.broadcast(piece, group=self._group, group_src=owner, async_op=True) for owner, piece in self._buckets
        ]
        self._waited = 0

    def wait_until(self, position: int) -> None:
        """Wait for the buckets launched up to and including ``position``."""
        works = self._works
        while self._waited <= position and self._waited < len(works):
            self._waiter.wait(works[self._waited], "sharding's gather of the updated parameters")
            self._waited += 1

    def wait(self) -> None:
        """Wait for every bucket launched last."""
        self.wait_until(len(self._works) - 1)
        self._works, self._waited = [], 0


def _by_owner_dtype_device(
    params: Sequence[nn.Parameter], owners: Sequence[int]
) -> dict[tuple[int, torch.dtype, torch.device], list[nn.Parameter]]:
    groups: dict[tuple[int, torch.dtype, torch.device], list[nn.Parameter]] = {}
    for param, owner in zip(params, owners):
        groups.setdefault((owner, param.dtype, param.device), []).append(param)
    return groups


def _flatten_into_one_tensor(params: list[nn.Parameter]) -> torch.Tensor:
    """Move ``params`` into one flat tensor, each becoming a (contiguous) view into it."""
    flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
    with torch.no_grad():
        for param, piece in zip(params, flat.split([p.numel() for p in params])):
            view = piece.view(param.shape)
            view.copy_(param)
            param.data = view
    return flat
