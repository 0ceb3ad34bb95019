"""Dense gradients of one bucket: small ones through a flat buffer, large ones in place.

The data path of one bucket launch (``start``) and its completion (``finish``); the reducer
decides when. The flat buffer also carries one flag per member, all-reduced with the
gradients (see ``lit_dp.reducer``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lit_dp.buckets import MB
from lit_dp.comm_hooks import CommHook

# Scaling while copying (one call per tensor) saves a pass over the bucket but costs a Python
# call per tensor; it pays off from about 10 KB per tensor on a CPU's memory bandwidth.
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
    """

    __slots__ = (
        "indices", "params", "in_place", "flat", "views", "reduced", "buffer", "gradients", "flags",
        "ring", "works", "fuse_scale", "hook", "future",
    )  # fmt: skip

    def __init__(
        self,
        indices: list[int],
        params: list[nn.Parameter],
        ring: dist.ProcessGroup,
        hook: tuple[CommHook, int, int] | None = None,
    ) -> None:
        self.indices = indices
        self.params = params
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
        self.reduced: list[torch.Tensor | None] = [None] * len(params)  # what each in-place member all-reduces
        self.ring = ring
        self.works: list[dist.Work] = []
        flat_bytes = numel * self.gradients.element_size()
        self.fuse_scale = flat_bytes >= FUSED_SCALE_MIN_BYTES_PER_TENSOR * len(self.flat)

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params)

    def start(self, used: bytearray, flag_used: bool, world_size: int) -> None:
        """Scale the gradients (zeros where absent), set the flags and start the all-reduces.

        A gradient that already is its bucket view (gradient-as-bucket-view mode) is not copied.
        A hook gets the gradients undivided: dividing is its job, as in torch DDP.
        """
        grads = [p.grad for p in self.params]
        present = [used[i] and grad is not None for i, grad in zip(self.indices, grads)]
        self.works = [self._start_in_place(k, grads[k], present[k], world_size) for k in self.in_place]
        if self.flat:
            self._fill_flat(grads, present, 1 if self.hook else world_size)
        if all(present):
            self.flags.fill_(1.0 if flag_used else 0.0)
        else:
            self.flags.copy_(torch.tensor([float(has_grad == flag_used) for has_grad in present]))
        if self.hook:
            self.works.append(dist.all_reduce(self.flags, group=self.ring, async_op=True))
            comm_hook, index, count = self.hook
            self.future = comm_hook.launch(index, count, self.gradients, self.params)
        else:
            self.works.append(dist.all_reduce(self.buffer, group=self.ring, async_op=True))

    def _start_in_place(self, k: int, grad: torch.Tensor | None, present: bool, world_size: int) -> dist.Work:
        if not present:
            reduced = torch.zeros_like(self.params[k], memory_format=torch.contiguous_format)
        elif grad.is_contiguous():
            # Autograd hands a parameter a gradient that aliases nothing else (it clones otherwise),
            # the same guarantee that lets it accumulate into .grad in place.
            reduced = grad.div_(world_size)
        else:
            reduced = grad.contiguous().div_(world_size)  # a copy: the gradient is not contiguous
        self.reduced[k] = reduced
        return dist.all_reduce(reduced, group=self.ring, async_op=True)

    def _fill_flat(self, grads: list[torch.Tensor | None], present: list[bool], world_size: int) -> None:
        """Copy the flat members' gradients in, divided by ``world_size`` (torch DDP also divides first)."""
        views = [self.views[k] for k in self.flat]
        flat_grads = [grads[k] for k in self.flat]
        if all(present[k] for k in self.flat) and not any(g is v for g, v in zip(flat_grads, views)):
            if self.fuse_scale:
                scale = 1.0 / world_size
                for view, grad in zip(views, flat_grads):
                    torch.mul(grad, scale, out=view)
                return
            torch._foreach_copy_(views, flat_grads)
        else:
            for k, view, grad in zip(self.flat, views, flat_grads):
                if not present[k]:
                    view.zero_()
                elif grad is not view:
                    view.copy_(grad)
        if world_size != 1:
            self.gradients.div_(world_size)

    def finish(self, as_view: bool, flag_used: bool) -> list[tuple[int, float]]:
        """Wait, write averages into ``.grad``; return (index, flag sum) of the parameters left alone.

        Left alone are those no rank used (``flag_used``) or that some rank missed (otherwise).
        """
        assert self.works, "finish() before start()"
        for work in self.works:
            work.wait()
        self.works = []
        if self.hook:
            comm_hook, index, _ = self.hook
            future, self.future = self.future, None
            comm_hook.collect(future, index, self.gradients)
        if flag_used:
            flags = self.flags.tolist()
            skipped = {k for k, total in enumerate(flags) if total == 0}
        elif bool(self.flags.any()):
            flags = self.flags.tolist()
            skipped = {k for k, total in enumerate(flags) if total != 0}
        else:
            flags, skipped = [], set()
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
        flat = [k for k in self.flat if k not in skipped]
        if as_view:
            for k in flat:
                if params[k].grad is not self.views[k]:
                    params[k].grad = self.views[k]
        elif flat and len(flat) == len(self.flat) and all(params[k].grad is not None for k in flat):
            torch._foreach_copy_([params[k].grad for k in flat], [self.views[k] for k in flat])
        else:
            for k in flat:
                if params[k].grad is None:
                    params[k].grad = self.views[k].clone()
                else:
                    params[k].grad.copy_(self.views[k])
        return [(self.indices[k], flags[k]) for k in sorted(skipped)]
