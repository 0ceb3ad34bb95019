"""Parameters without a gradient: found before backward, read from the all-reduced flags after it.

With ``find_unused_parameters`` the reducer walks the autograd graph from a forward's outputs
(``reached_parameters``); the parameters it cannot reach count as ready at once, contributing
zeros. After backward, every dense bucket's flags (all-reduced with its gradients, see
``lit_dp.gradients.reducer``) say per parameter how many ranks used it (``unused_members``:
none did, so its ``.grad`` stays untouched) or, without the option, how many got no gradient
(``PendingFlags``: read without blocking on CUDA; any count raises on every rank with
``missing_gradients_message``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lit_dp.gradients.dense import DenseBucket
from lit_dp.gradients.sparse import SparseBucket

UNUSED_PARAMETERS_HINT = (
    "If parameters are legitimately unused in some iterations, pass find_unused_parameters=True "
    "(strategy option `find_unused_parameters`)."
)


def reached_parameters(outputs: object) -> set[int]:
    """The ids of the leaf tensors (parameters) that a backward from ``outputs`` will reach."""
    stack = []
    reached: set[int] = set()
    for tensor in _tensors_in(outputs):
        if tensor.grad_fn is not None:
            stack.append(tensor.grad_fn)
        elif tensor.requires_grad:
            reached.add(id(tensor))
    seen = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            reached.add(id(variable))
        stack.extend(next_node for next_node, _ in node.next_functions if next_node is not None)
    return reached


def _tensors_in(value: object):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item)


def unused_members(buckets: Sequence[DenseBucket | SparseBucket], totals: list[float]) -> list[set[int]]:
    """Per bucket, the positions of the members no rank used (a flag sum of 0); ``totals``: the
    buckets' flags, concatenated."""
    skipped, offset = [], 0
    for bucket in buckets:
        count = len(bucket.indices)
        skipped.append({k for k in range(count) if totals[offset + k] == 0})
        offset += count
    return skipped


def missing_gradients_message(
    names: Sequence[str], world_size: int, missing: list[tuple[int, float]], used: bytearray, opening: str | None
) -> str:
    """The error every rank raises: the parameters some rank got no gradient for, and on how many ranks."""
    lines = [
        f"  {names[index]} (missing on {round(count)} of {world_size} ranks"
        f"{', including this one' if not used[index] else ''})"
        for index, count in missing
    ]
    details = (
        "lit_dp reducer: trainable parameters received no gradient in this backward while "
        "find_unused_parameters=False:\n" + "\n".join(lines[:20])
    )
    if opening is not None:
        return f"{opening}\n{details}"
    return f"{details}\n{UNUSED_PARAMETERS_HINT}"


class PendingFlags:
    """The flags of one backward on their way to the host, copied without blocking on CUDA."""

    __slots__ = ("buckets", "used", "_host", "_copied")

    def __init__(self, buckets: Sequence[DenseBucket | SparseBucket], used: bytearray) -> None:
        self.buckets = buckets
        self.used = used
        flags = torch.cat([bucket.flags for bucket in buckets])
        if flags.is_cuda:
            self._host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            self._host.copy_(flags, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        else:
            self._host, self._copied = flags, None

    def arrived(self) -> bool:
        return self._copied is None or self._copied.query()

    def missing(self) -> list[tuple[int, float]]:
        """(parameter index, flag sum) of the parameters some rank got no gradient for."""
        if self._copied is not None:
            self._copied.synchronize()  # returns at once once arrived()
        if not self._host.any():  # the usual case, decided without a Python loop over parameters
            return []
        indices = [index for bucket in self.buckets for index in bucket.indices]
        return [(index, total) for index, total in zip(indices, self._host.tolist()) if total != 0]
