"""Sparse gradients (``nn.Embedding(sparse=True)``): reduced alone, outside the dense buckets.

Gloo all-reduces sparse COO tensors natively; NCCL has no sparse all-reduce, so there the
indices and values are all-gathered and summed locally.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
import torch.distributed as dist
from torch import nn

import lit_dp.gradients.group as groups
from lit_dp.gradients.flags import fill_flags, members_present
from lit_dp.gradients.plan import StepPlan
from lit_dp.gradients.waiting import UNWATCHED, Waiter


class SparseBucket:
    """One parameter with a sparse gradient, with the same start/wait/write_back protocol as ``DenseBucket``."""

    __slots__ = ("indices", "params", "ring", "work", "gradient", "flags", "flag_work", "native", "waiter")
    alone = False  # its collectives run on a group of one rank too: Gloo's sparse all-reduce coalesces

    def __init__(
        self, indices: list[int], params: list[nn.Parameter], ring: dist.ProcessGroup, waiter: Waiter = UNWATCHED
    ) -> None:
        self.indices = indices
        self.params = params
        self.ring = ring
        self.native = groups.backend_name(ring) == "gloo"
        self.work: dist.Work | None = None
        self.flag_work: dist.Work | None = None
        self.gradient: torch.Tensor | None = None
        self.flags = torch.zeros(1, device=params[0].device)
        self.waiter = waiter  # the owner's policy for every wait (a deadline under the hang watchdog)

    @property
    def nbytes(self) -> int:
        return 0

    def sent_bytes(self) -> int:
        """The bytes of the sparse gradient's values and indices started last."""
        gradient = self.gradient
        return 0 if gradient is None else gradient.values().nbytes + gradient.indices().nbytes

    def futures(self) -> list[torch.futures.Future]:
        """Futures of the collectives started last: the values (Gloo only) and the flag."""
        return [work.get_future() for work in (self.work, self.flag_work) if work is not None]

    def start(self, plan: StepPlan, used: bytearray, complete: bool = False) -> None:
        """Start the sparse all-reduce (Gloo) and the flag's; ``used`` and ``complete`` as in ``DenseBucket.start``."""
        param = self.params[0]
        has_grad = complete or members_present(self.indices, self.params, used)[0]
        if has_grad:
            gradient = param.grad if param.grad.is_sparse else param.grad.to_sparse()
            gradient = gradient.coalesce() / plan.divisor
        else:
            # Laid out as an embedding's gradient (rows sparse, each row dense), or Gloo's sparse
            # all-reduce meets tensors of different layouts on the ranks that have one.
            gradient = torch.sparse_coo_tensor(
                torch.empty(1, 0, dtype=torch.long, device=param.device),
                torch.empty(0, *param.shape[1:], dtype=param.dtype, device=param.device),
                param.shape,
            )
        self.gradient = gradient
        fill_flags(self.flags, plan.flags, [has_grad])
        if self.native:
            self.work = dist.all_reduce(self.gradient, group=self.ring, async_op=True)
        self.flag_work = dist.all_reduce(self.flags, group=self.ring, async_op=True)

    def wait(self) -> None:
        assert self.gradient is not None and self.flag_work is not None, "wait() before start()"
        if self.native:
            assert self.work is not None
            groups.wait(self.waiter, self.work, self.ring)  # gloo writes the sparse sum into its input
        else:
            self.gradient = allgather_sparse_sum(self.gradient, self.ring)
        groups.wait(self.waiter, self.flag_work, self.ring)
        self.work = self.flag_work = None

    def write_back(self, as_view: bool, skipped: Collection[int]) -> None:
        reduced, self.gradient = self.gradient, None
        if not skipped:
            self.params[0].grad = reduced.coalesce()


def allgather_sparse_sum(gradient: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum sparse COO tensors over ``group`` with all-gathers (for backends without sparse all-reduce)."""
    gradient = gradient.coalesce()
    indices, values = gradient.indices(), gradient.values()
    world_size = group.size()
    count = torch.tensor([values.shape[0]], dtype=torch.long, device=values.device)
    counts = [torch.empty_like(count) for _ in range(world_size)]
    dist.all_gather(counts, count, group=group)
    sizes = [int(c.item()) for c in counts]
    longest = max(sizes)
    # all_gather needs equal shapes: pad to the longest, then cut each rank's part back.
    padded_indices = indices.new_zeros(indices.shape[0], longest)
    padded_indices[:, : indices.shape[1]] = indices
    padded_values = values.new_zeros((longest, *values.shape[1:]))
    padded_values[: values.shape[0]] = values
    all_indices = [torch.empty_like(padded_indices) for _ in range(world_size)]
    all_values = [torch.empty_like(padded_values) for _ in range(world_size)]
    dist.all_gather(all_indices, padded_indices, group=group)
    dist.all_gather(all_values, padded_values, group=group)
    return torch.sparse_coo_tensor(
        torch.cat([part[:, :n] for part, n in zip(all_indices, sizes)], dim=1),
        torch.cat([part[:n] for part, n in zip(all_values, sizes)]),
        gradient.shape,
    ).coalesce()


def sparse_gradient_parameters(module: nn.Module) -> set[int]:
    """Ids of parameters whose gradients are sparse: embeddings built with ``sparse=True``."""
    return {
        id(sub.weight)
        for sub in module.modules()
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse
    }
