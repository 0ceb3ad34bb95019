"""Dense gradients of one bucket: small ones through a flat buffer, large ones in place.

The data path of one bucket launch (``start``), its completion (``wait``) and the write-back of
the averages (``write_back``); the reducer decides when, and which members to leave alone. The
flat buffer also carries one flag per member, all-reduced with the gradients (see
``lit_dp.gradients.reducer``).
"""

from __future__ import annotations

from collections.abc import Collection

import torch
import torch.distributed as dist
from torch import nn

from lit_dp.gradients.buckets import MB
from lit_dp.gradients.hooks import CommHook
from lit_dp.gradients.waiting import UNWATCHED, Waiter

# Scaling while copying (one call per tensor) saves a pass over the bucket but costs a Python
# call per tensor; it pays off from about 64 KB per tensor on a CPU's memory bandwidth.
FUSED_SCALE_MIN_BYTES_PER_TENSOR = 64 * 1024

# A gradient at least this large is all-reduced where it lies, in a collective of its own,
# instead of travelling through the bucket buffer: that saves copying it in and out (two
# passes over its bytes) and its copy in the buffer, for the price of one more collective.
# On a 2-core CPU machine copying in and out costs about 0.45 ms per MB and a small gloo
# all-reduce about 2 ms, so the saving wins from about 4 MB. On GPUs memory bandwidth is ~100x
# the interconnect's, so only very large gradients gain (16 MB is an estimate, not measured).
IN_PLACE_MIN_BYTES = {"cpu": 4 * MB, "cuda": 16 * MB}


def in_place_min_bytes(device: torch.device) -> int:
    return IN_PLACE_MIN_BYTES.get(device.type, IN_PLACE_MIN_BYTES["cuda"])


class DenseBucket:
    """Gradients of one dtype and device, reduced together, launched as one unit.

    Small gradients travel in one flat buffer, [gradients | flags] (the flags of every member,
    large ones included); each large gradient (``in_place_min_bytes``) is all-reduced in place.

    With a communication hook (``hook``: the hook, this bucket's index among the dense buckets and
    their count) every gradient goes through the flat buffer, which holds gradients only, so the
    hook sees the whole bucket as torch's hooks expect; the flags travel in a small all-reduce
    of their own, never compressed.

    Args:
        as_view: the reducer keeps the flat members' ``.grad`` as views into the buffer
            (gradient-as-bucket-view mode), so a launch need not copy them in.
    """

    __slots__ = (
        "indices", "params", "in_place", "flat", "views", "flat_params", "flat_views", "reduced",
        "buffer", "gradients", "flags", "ring", "works", "fuse_scale", "as_view", "average_op", "alone",
        "hook", "future", "_launched_grads", "size", "waiter",
    )  # fmt: skip

    def __init__(
        self,
        indices: list[int],
        params: list[nn.Parameter],
        ring: dist.ProcessGroup,
        as_view: bool = False,
        hook: tuple[CommHook, int, int] | None = None,
    ) -> None:
        self.indices = indices
        self.params = params
        self.as_view = as_view
        self.hook = hook
        self.future: torch.futures.Future | None = None
        threshold = in_place_min_bytes(params[0].device)
        self.in_place = [] if hook else [k for k, p in enumerate(params) if p.numel() * p.element_size() >= threshold]
        self.flat = [k for k in range(len(params)) if k not in self.in_place]
        flat_numels = [params[k].numel() for k in self.flat]
        numel = sum(flat_numels)
        if hook:
            # Separate tensors: a hook may compress or even resize its buffer (batched PowerSGD pads it).
            self.buffer = self.gradients = torch.zeros(numel, dtype=params[0].dtype, device=params[0].device)
            self.flags = torch.zeros(len(params), dtype=params[0].dtype, device=params[0].device)
        else:
            self.buffer = torch.zeros(numel + len(params), dtype=params[0].dtype, device=params[0].device)
            self.gradients = self.buffer[:numel]
            self.flags = self.buffer[numel:]
        self.views: list[torch.Tensor | None] = [None] * len(params)
        for k, piece in zip(self.flat, self.gradients.split(flat_numels)):
            self.views[k] = piece.view_as(params[k])
        # The flat members and their views as lists, so a launch builds no list per member.
        self.flat_params = [params[k] for k in self.flat]
        self.flat_views = [self.views[k] for k in self.flat]
        self.reduced: list[torch.Tensor | None] = [None] * len(params)  # what each in-place member all-reduces
        self.ring = ring
        self.works: list[dist.Work] = []
        flat_bytes = numel * self.gradients.element_size()
        self.fuse_scale = flat_bytes >= FUSED_SCALE_MIN_BYTES_PER_TENSOR * len(self.flat)
        self.average_op = averaging_op(ring)
        self.size = dist.get_world_size(ring)
        self.waiter: Waiter = UNWATCHED  # the reducer's (a deadline under the hang watchdog)
        # A group of one rank (one device under the Lightning strategies) needs no collective:
        # skipping it keeps the one-device step as cheap as the bare model's, checks included.
        # A hook still runs there, as under torch DDP.
        self.alone = dist.get_world_size(ring) == 1 and hook is None
        # A group whose members change from step to step (torchft's replicas, lit_dp.fault_tolerance) never is.
        self.alone = self.alone and not getattr(ring, "changing_membership", False)
        # The flat members' gradients at launch when all were present, for the write-back.
        self._launched_grads: list[torch.Tensor] | None = None

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params)

    def sent_bytes(self) -> int:
        """The gradient bytes this bucket reduces (its flags not counted)."""
        return self.nbytes

    def futures(self) -> list[torch.futures.Future]:
        """Futures of the collectives started last (a hook's included); none for a group of one rank."""
        futures = [work.get_future() for work in self.works]
        if self.future is not None:  # a communication hook's: its collectives are the bucket's gradients
            futures.append(self.future)
        return futures

    def start(self, used: bytearray, flag_used: bool | None, world_size: int, complete: bool = False) -> None:
        """Scale the gradients (zeros where absent), set the flags and start the all-reduces.

        ``complete``: every member's gradient arrived in this backward (the reducer knows), so
        no member needs checking. A hook gets the gradients undivided: dividing is its job, as
        in torch DDP. ``world_size`` is the divisor: the group's size, or under ``lit_dp.join``
        the ranks still in, which an averaging all-reduce cannot divide by (it is summed then).
        ``flag_used=None``: every flag 0, this rank neither using nor missing a parameter (a rank
        that ran out of inputs, without ``find_unused_parameters``).
        """
        average = self.average_op if world_size == self.size else None
        # Flags are set with fills, never copied from host memory: on CUDA a copy from pageable
        # memory would block the host. An averaging all-reduce divides them too, so they start at
        # the world size and still sum to a count of ranks.
        one = float(world_size) if average is not None else 1.0
        self.flags.fill_(one if flag_used else 0.0)
        if complete:
            present = None
        else:
            present = [bool(used[i]) and p.grad is not None for i, p in zip(self.indices, self.params)]
            absent = 0.0 if flag_used or flag_used is None else one
            for k, has_grad in enumerate(present):
                if not has_grad:
                    self.flags[k].fill_(absent)
        if self.alone:
            return  # one rank: the gradients already are the averages; the flags keep the checks
        op = average or dist.ReduceOp.SUM
        self.works = [
            self._start_in_place(k, present is None or present[k], world_size, op) for k in self.in_place
        ]
        if self.flat:
            self._fill_flat(present, world_size, divide=average is None)
        if self.hook:
            self.works.append(dist.all_reduce(self.flags, op=op, group=self.ring, async_op=True))
            comm_hook, index, count = self.hook
            self.future = comm_hook.launch(index, count, self.gradients, self.params)
        else:
            self.works.append(dist.all_reduce(self.buffer, op=op, group=self.ring, async_op=True))

    def _start_in_place(self, k: int, present: bool, world_size: int, op: dist.ReduceOp) -> dist.Work:
        grad = self.params[k].grad
        if not present:
            reduced = torch.zeros_like(self.params[k], memory_format=torch.contiguous_format)
        else:
            # Autograd hands a parameter a gradient that aliases nothing else (it clones otherwise),
            # the same guarantee that lets it accumulate into .grad in place. A non-contiguous
            # gradient is reduced through a contiguous copy.
            reduced = grad if grad.is_contiguous() else grad.contiguous()
            if op != dist.ReduceOp.AVG:
                reduced.div_(world_size)
        self.reduced[k] = reduced
        return dist.all_reduce(reduced, op=op, group=self.ring, async_op=True)

    def _fill_flat(self, present: list[bool] | None, world_size: int, divide: bool) -> None:
        """Copy the flat members' gradients in, divided by ``world_size`` (torch DDP also divides first).

        ``present`` is None when every gradient arrived; in view mode they are already in place.
        """
        scale = divide and self.hook is None
        if present is None and not self.as_view:
            grads = [p.grad for p in self.flat_params]
            self._launched_grads = grads
            if self.fuse_scale and scale:
                factor = 1.0 / world_size
                for view, grad in zip(self.flat_views, grads):
                    torch.mul(grad, factor, out=view)
                return
            torch._foreach_copy_(self.flat_views, grads)
        elif present is not None:
            for k, view in zip(self.flat, self.flat_views):
                grad = self.params[k].grad
                if not present[k]:
                    view.zero_()
                elif grad is not view:
                    view.copy_(grad)
        if scale:
            self.gradients.div_(world_size)

    def wait(self) -> None:
        """Wait for this bucket's collectives (on CUDA: make the current stream wait for them)."""
        for work in self.works:
            self.waiter.wait(work)
        self.works = []
        if self.hook:
            comm_hook, index, _ = self.hook
            future, self.future = self.future, None
            comm_hook.collect(future, index, self.gradients)

    def write_back(self, as_view: bool, skipped: Collection[int]) -> None:
        """Write the averages into ``.grad``, except for the members at positions ``skipped``."""
        if self.alone:
            return
        params = self.params
        for k in self.in_place:
            reduced, self.reduced[k] = self.reduced[k], None
            param = params[k]
            if k in skipped or param.grad is reduced:
                continue
            if param.grad is None:
                param.grad = reduced
            else:
                param.grad.copy_(reduced)
        launched, self._launched_grads = self._launched_grads, None
        if launched is not None and not skipped:
            torch._foreach_copy_(launched, self.flat_views)
            return
        for k, view in zip(self.flat, self.flat_views):
            if k in skipped:
                continue
            grad = params[k].grad
            if as_view:
                if grad is not view:
                    params[k].grad = view
            elif grad is None:
                params[k].grad = view.clone()
            else:
                grad.copy_(view)


def averaging_op(group: dist.ProcessGroup) -> dist.ReduceOp | None:
    """NCCL averages inside the all-reduce (``ReduceOp.AVG``), saving a pass over the gradients;
    None where the backend only sums (Gloo), and the gradients are divided before."""
    return dist.ReduceOp.AVG if backend_of(group) == "nccl" else None


def backend_of(group: dist.ProcessGroup) -> str:
    """``dist.get_backend(group)``; a group built in Python outside torch.distributed's registry
    (torchft's replicas, ``lit_dp.fault_tolerance``) names its own backend."""
    try:
        return dist.get_backend(group)
    except ValueError:
        return group.name()
