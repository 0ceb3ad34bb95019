"""Sharding stage 2: a bucket's gradients are reduced to their owners, each rank keeps only its own.

``ScatterBucket`` has ``DenseBucket``'s protocol (``start``, ``wait``, ``write_back``, ``flags``),
so the reducer launches it in the same fixed order, while backward still runs, and rebuilds it
in ready order or with tuned sizes like any other bucket. What changes is the data path:

- The flat buffer is laid out by owner, ``[owner 0's members | owner 1's | ...]``, so each
  owner's gradients are one contiguous segment, and one collective delivers each segment to
  its owner: ``reduce_scatter`` on NCCL (torch turns an uneven split into grouped
  ``ncclReduce`` calls), one ``reduce`` per owner on Gloo, whose own reduce-scatter is slower
  than the reduces (docs/benchmarks.md, "Thresholds of the gradient path"). Either way a rank
  sends each gradient byte towards one owner instead of to every rank: about half an
  all-reduce's traffic.
- The buffer is allocated when the bucket launches and freed at the write-back; the caller's
  own segment lives in a small persistent tensor (``own``), whose views become the owned
  parameters' ``.grad``. Gradients the rank does not own are set to None as soon as they are
  copied out, so after backward a rank holds 1/N of the gradients (plus, while buckets are in
  flight, their transient buffers).
- Large gradients (``in_place_min_bytes``) are reduced to their owner where autograd left
  them, as ``DenseBucket`` all-reduces them in place.
- The per-member flags (``lit_dp.gradients.flags``) cannot ride in an owner's segment, since
  every rank must read all of them: they go first, in a small all-reduce of their own, always
  summed.

Members keep the reducer's order in ``indices``, ``flags`` and the ``skipped`` positions; only
the buffer's layout is by owner.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch
import torch.distributed as dist
from torch import nn

import lit_dp.gradients.group as groups
from lit_dp.gradients.bucket import DenseGradients
from lit_dp.gradients.dense import averaging_op, in_place_min_bytes
from lit_dp.gradients.flags import fill_flags, members_present
from lit_dp.gradients.plan import StepPlan
from lit_dp.gradients.strides import flat_alias, like_param, shaped_like, zeros_like_param
from lit_dp.gradients.waiting import UNWATCHED, Waiter

# Backends whose reduce-scatter beats one reduce per owner (see the module docstring).
REDUCE_SCATTER_BACKENDS = frozenset({"nccl"})


class ScatterBucket(DenseGradients):
    """Gradients of one dtype and device, each reduced to the rank that owns it (sharding stage 2).

    Args:
        indices: the reducer's parameter indices, in its order.
        params: the parameters, in that order.
        ring: the communicator; owners are ranks within it.
        owners: the owning rank (in ``ring``) of each member.
    """

    __slots__ = (
        "owners",
        "rank",
        "in_place",
        "flat",
        "segments",
        "numels",
        "own",
        "own_views",
        "flags",
        "reduced",
        "buffer",
        "average_op",
        "alone",
        "reduce_scatter",
    )

    def __init__(
        self,
        indices: list[int],
        params: list[nn.Parameter],
        ring: dist.ProcessGroup,
        owners: Sequence[int],
        waiter: Waiter = UNWATCHED,
    ) -> None:
        super().__init__(indices, params, ring, waiter)
        self.owners = list(owners)
        self.rank = ring.rank()
        world_size = ring.size()
        threshold = in_place_min_bytes(params[0].device)
        self.in_place = [k for k, p in enumerate(params) if p.numel() * p.element_size() >= threshold]
        self.flat = [k for k in range(len(params)) if k not in self.in_place]
        # segments[r]: the flat members owned by rank r, in the reducer's order.
        self.segments = [[k for k in self.flat if self.owners[k] == r] for r in range(world_size)]
        self.numels = [sum(params[k].numel() for k in members) for members in self.segments]
        device, dtype = params[0].device, params[0].dtype
        self.own = torch.zeros(self.numels[self.rank], dtype=dtype, device=device)
        mine = self.segments[self.rank]
        self.own_views = dict(zip(mine, _shaped(self.own, [params[k] for k in mine])))
        self.flags = torch.zeros(len(params), dtype=dtype, device=device)
        self.reduced: list[torch.Tensor | None] = [None] * len(params)
        self.buffer: torch.Tensor | None = None
        self.average_op = averaging_op(ring)
        self.alone = groups.trivially_alone(ring)
        self.reduce_scatter = groups.backend_name(ring) in REDUCE_SCATTER_BACKENDS

    def start(self, plan: StepPlan, used: bytearray, complete: bool = False) -> None:
        """Set the flags and start their all-reduce, then reduce every gradient to its owner.

        ``used`` and ``complete`` as in ``DenseBucket.start``. Absent gradients contribute zeros.
        The flags' all-reduce always sums; the gradients are averaged in the collective where
        the backend can and the plan's divisor is the group's size, else divided first.
        """
        if self.alone:
            return  # one rank owns everything and already holds the averages; the reducer checks on the host
        present = None if complete else members_present(self.indices, self.params, used)
        fill_flags(self.flags, plan.flags, present)
        self.works = [dist.all_reduce(self.flags, group=self.ring, async_op=True)]
        average = self.average_op if plan.divisor == len(self.numels) else None
        op = average or dist.ReduceOp.SUM
        divisor = None if average is not None else plan.divisor
        for k in self.in_place:
            self.works.append(self._reduce_in_place(k, present is None or present[k], divisor, op))
        if self.flat:
            self._reduce_flat(present, divisor, op)

    def _reduce_in_place(self, k: int, present: bool, divisor: int | None, op: dist.ReduceOp) -> dist.Work:
        param = self.params[k]
        if present:
            reduced = like_param(param.grad, param)  # dense layouts as they lie (the contract in dense.py)
            if divisor is not None:
                reduced.div_(divisor)
        else:
            reduced = zeros_like_param(param)
        self.reduced[k] = reduced  # kept alive until the reduce completes
        owner = self.owners[k]
        if owner != self.rank:
            param.grad = None
        return dist.reduce(flat_alias(reduced), group_dst=owner, op=op, group=self.ring, async_op=True)

    def _reduce_flat(self, present: list[bool] | None, divisor: int | None, op: dist.ReduceOp) -> None:
        me = self.rank
        if self.reduce_scatter:
            # The caller's contribution travels in the buffer; the result lands in `own`.
            self.buffer = torch.empty(sum(self.numels), dtype=self.own.dtype, device=self.own.device)
            segments = list(self.buffer.split(self.numels))
        else:
            # Each owner reduces into its own segment in place: the caller's is `own` itself.
            others = [n for r, n in enumerate(self.numels) if r != me]
            self.buffer = torch.empty(sum(others), dtype=self.own.dtype, device=self.own.device)
            pieces = iter(self.buffer.split(others))
            segments = [self.own if r == me else next(pieces) for r in range(len(self.numels))]
        for owner, members in enumerate(self.segments):
            if owner == me and not self.reduce_scatter:
                views = [self.own_views[k] for k in members]
            else:
                views = _shaped(segments[owner], [self.params[k] for k in members])
            for k, view in zip(members, views):
                param = self.params[k]
                grad = param.grad
                if present is not None and not present[k]:
                    view.zero_()
                    if owner != me:
                        param.grad = None
                    continue
                if grad is not view:
                    view.copy_(grad)
                # The owner's .grad becomes a view into `own` at the write-back; the rest is gone.
                if owner != me or grad is not self.own_views[k]:
                    param.grad = None
        if divisor is not None:
            self.buffer.div_(divisor)
            if not self.reduce_scatter:
                self.own.div_(divisor)
        if self.reduce_scatter:
            self.works.append(dist.reduce_scatter(self.own, segments, op=op, group=self.ring, async_op=True))
            return
        for owner, segment in enumerate(segments):
            if self.numels[owner]:
                self.works.append(dist.reduce(segment, group_dst=owner, op=op, group=self.ring, async_op=True))

    def write_back(self, as_view: bool, skipped: Collection[int]) -> None:
        """Give the owned members their averages as ``.grad``, except at positions ``skipped``.

        ``as_view`` changes nothing here: owned flat gradients always are views into ``own``.
        """
        self.buffer = None
        if self.alone:
            return
        me = self.rank
        for k in self.in_place:
            reduced, self.reduced[k] = self.reduced[k], None
            if self.owners[k] == me and k not in skipped:
                self.params[k].grad = reduced
        for k, view in self.own_views.items():
            if k not in skipped and self.params[k].grad is not view:
                self.params[k].grad = view


def _shaped(flat: torch.Tensor, params: list[nn.Parameter]) -> list[torch.Tensor]:
    """Consecutive pieces of ``flat``, one laid out like each parameter (the contract in dense.py)."""
    pieces = flat.split([p.numel() for p in params])
    return [shaped_like(piece, param) for piece, param in zip(pieces, params)]
