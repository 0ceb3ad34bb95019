"""Dense gradients of one bucket: small ones through a flat buffer, large ones in place.

The data path of one bucket launch (``start``), its completion (``wait``) and the write-back of
the averages (``write_back``); the reducer decides when, and the step plan
(``lit_dp.gradients.plan``) how this rank takes part. The flat buffer also carries one flag per
member, all-reduced with the gradients (``lit_dp.gradients.flags``).

Gradient layout contract (torch's reducer.cpp keeps the same, "Note [Gradient Layout Contract]"):

- A parameter that is non-overlapping and dense (contiguous, ``channels_last``, any order of
  dimensions) gets its gradient in its own strides: autograd's ``AccumulateGrad`` gives
  ``.grad`` the parameter's strides. So a flat member's view into the bucket buffer
  (``strides.shaped_like``) has the parameter's sizes *and strides* over its slice of the
  buffer, never merely a reshape: copying ``.grad`` in and the average back out pairs equal
  layouts (a plain copy, no strided gather), and under ``gradient_as_bucket_view`` the view
  that becomes ``.grad`` has the parameter's strides, as autograd's own would. A parameter
  that is not dense (an expanded or sliced tensor) gets a contiguous view.
- A member reduced in place is reduced through a one-dimensional alias of its gradient's own
  memory (``strides.flat_alias``): a reduction is elementwise, so any dense layout is reduced
  as it lies, without a contiguous copy, on any backend. A gradient whose strides are not the
  parameter's (one set by hand) is first copied into the parameter's layout.
- Every rank's parameter has the same strides (the same model), so element ``i`` of a bucket
  is the same parameter entry on every rank.
- A communication hook's ``GradBucket.gradients()`` are views made the same way.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
import torch.distributed as dist
from torch import nn

import lit_dp.gradients.group as groups
from lit_dp.gradients.bucket import DenseGradients
from lit_dp.gradients.buckets import MB
from lit_dp.gradients.flags import fill_flags, members_present
from lit_dp.gradients.hooks import CommHook
from lit_dp.gradients.plan import StepPlan
from lit_dp.gradients.strides import flat_alias, like_param, shaped_like, zeros_like_param
from lit_dp.gradients.waiting import UNWATCHED, Waiter

# Scaling while copying (one call per tensor) saves a pass over the bucket but costs a Python
# call per tensor, so it is used only where tensors are large on average.
FUSED_SCALE_MIN_BYTES_PER_TENSOR = 64 * 1024

# A gradient at least this large is all-reduced where it lies, in a collective of its own,
# instead of travelling through the bucket buffer: that saves copying it in and out (two
# passes over its bytes) and its copy in the buffer, for the price of one more collective.
# The CPU threshold is where the copies saved outweigh a small Gloo all-reduce on the machine
# in docs/benchmarks.md ("Thresholds of the gradient path"); on GPUs memory bandwidth is about
# 100x the interconnect's, so only very large gradients gain, and 16 MB is an estimate, not a
# measurement.
IN_PLACE_MIN_BYTES = {"cpu": 4 * MB, "cuda": 16 * MB}


def in_place_min_bytes(device: torch.device) -> int:
    return IN_PLACE_MIN_BYTES.get(device.type, IN_PLACE_MIN_BYTES["cuda"])


class DenseBucket(DenseGradients):
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
        "in_place",
        "flat",
        "views",
        "flat_params",
        "flat_views",
        "reduced",
        "buffer",
        "gradients",
        "flags",
        "fuse_scale",
        "as_view",
        "average_op",
        "alone",
        "hook",
        "future",
        "_launched_grads",
        "size",
    )

    def __init__(
        self,
        indices: list[int],
        params: list[nn.Parameter],
        ring: dist.ProcessGroup,
        as_view: bool = False,
        hook: tuple[CommHook, int, int] | None = None,
        waiter: Waiter = UNWATCHED,
    ) -> None:
        super().__init__(indices, params, ring, waiter)
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
            self.views[k] = shaped_like(piece, params[k])
        # The flat members and their views as lists, so a launch builds no list per member.
        self.flat_params = [params[k] for k in self.flat]
        self.flat_views = [self.views[k] for k in self.flat]
        self.reduced: list[torch.Tensor | None] = [None] * len(params)  # what each in-place member all-reduces
        flat_bytes = numel * self.gradients.element_size()
        self.fuse_scale = flat_bytes >= FUSED_SCALE_MIN_BYTES_PER_TENSOR * len(self.flat)
        self.average_op = averaging_op(ring)
        self.size = ring.size()
        # A group of one rank (one device under the Lightning strategies) needs no collective:
        # skipping it keeps the one-device step as cheap as the bare model's, checks included.
        # A hook still runs there, as under torch DDP, and so does a group written in Python.
        self.alone = groups.trivially_alone(ring) and hook is None
        # The flat members' gradients at launch when all were present, for the write-back.
        self._launched_grads: list[torch.Tensor] | None = None

    def futures(self) -> list[torch.futures.Future]:
        """Futures of the collectives started last (a hook's included); none for a group of one rank."""
        futures = super().futures()
        if self.future is not None:  # a communication hook's: its collectives are the bucket's gradients
            futures.append(self.future)
        return futures

    def start(self, plan: StepPlan, used: bytearray, complete: bool = False) -> None:
        """Scale the gradients (zeros where absent), set the flags and start the all-reduces.

        ``used``: which parameters accumulated a gradient since the last synchronisation (what
        this rank sends; the reducer hands zeros' marks for a ``SHADOW`` step). ``complete``:
        every member's gradient arrived in this backward (the reducer knows), so no member needs
        checking. A hook gets the gradients undivided: dividing is its job, as in torch DDP. The
        plan's divisor is the group's size, or under ``lit_dp.join`` the ranks still in, which an
        averaging all-reduce cannot divide by (it is summed then).
        """
        if self.alone:
            return  # one rank: the gradients already are the averages; the reducer checks on the host
        divisor = plan.divisor
        average = self.average_op if divisor == self.size else None
        present = None if complete else members_present(self.indices, self.params, used)
        fill_flags(self.flags, plan.flags, present, one=float(divisor) if average is not None else 1.0)
        op = average or dist.ReduceOp.SUM
        self.works = [self._start_in_place(k, present is None or present[k], divisor, op) for k in self.in_place]
        if self.flat:
            self._fill_flat(present, divisor, divide=average is None)
        if self.hook:
            self.works.append(dist.all_reduce(self.flags, op=op, group=self.ring, async_op=True))
            comm_hook, index, count = self.hook
            self.future = comm_hook.launch(index, count, self.gradients, self.params)
        else:
            self.works.append(dist.all_reduce(self.buffer, op=op, group=self.ring, async_op=True))

    def _start_in_place(self, k: int, present: bool, divisor: int, op: dist.ReduceOp) -> dist.Work:
        param = self.params[k]
        if not present:
            reduced = zeros_like_param(param)
        else:
            # Autograd hands a parameter a gradient that aliases nothing else (it clones otherwise),
            # the same guarantee that lets it accumulate into .grad in place.
            reduced = like_param(param.grad, param)
            if op != dist.ReduceOp.AVG:
                reduced.div_(divisor)
        self.reduced[k] = reduced
        return dist.all_reduce(flat_alias(reduced), op=op, group=self.ring, async_op=True)

    def _fill_flat(self, present: list[bool] | None, divisor: int, divide: bool) -> None:
        """Copy the flat members' gradients in, divided by ``divisor`` (torch DDP also divides first).

        ``present`` is None when every gradient arrived; in view mode they are already in place.
        """
        scale = divide and self.hook is None
        if present is None and not self.as_view:
            grads = [p.grad for p in self.flat_params]
            self._launched_grads = grads
            if self.fuse_scale and scale:
                factor = 1.0 / divisor
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
            self.gradients.div_(divisor)

    def wait(self) -> None:
        """Wait for this bucket's collectives (on CUDA: make the current stream wait for them), then the hook's."""
        super().wait()
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
    return dist.ReduceOp.AVG if groups.backend_name(group) == "nccl" else None
