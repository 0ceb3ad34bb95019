"""Parameters without a gradient: found before backward, read from the flags after it.

With ``find_unused_parameters`` the reducer walks the autograd graph from a forward's outputs
(``reached_parameters``); the parameters it cannot reach count as ready at once, contributing
zeros. After backward, every bucket's flags (``lit_dp.gradients.flags``, all-reduced with its
gradients) say per parameter how many ranks used it (``unused_members``: none did, so its
``.grad`` stays untouched) or, without the option, how many got no gradient (``PendingFlags``:
read without blocking on CUDA; any count raises ``UnusedParametersError`` on every rank).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import torch

from lit_dp.gradients.dense import DenseBucket
from lit_dp.gradients.scatter import ScatterBucket
from lit_dp.gradients.sparse import SparseBucket

# How every front door turns the detection on; the Trainer strategy opens the message with
# Lightning's own sentence as well (its on_exception), which is what its users search for.
UNUSED_PARAMETERS_HINT = (
    "If parameters are legitimately unused in some iterations, turn on find_unused_parameters: "
    "lit_dp.DataParallel(..., find_unused_parameters=True), strategy='paddle_dp_find_unused_parameters_true' "
    "(Trainer or Fabric), PaddleDPStrategy(find_unused_parameters=True), or strategy.find_unused_parameters=true "
    "on a recipe's command line."
)
UNUSED_PARAMETERS_OPENING = "lit_dp reducer: trainable parameters received no gradient in this backward"


class UnusedParametersError(RuntimeError):
    """Some rank got no gradient for trainable parameters while ``find_unused_parameters=False``.

    Every rank raises it with the same text, naming the parameters and on how many ranks each
    was missing. ``parameters`` holds their names.
    """

    def __init__(self, names: Sequence[str], world_size: int, missing: list[tuple[int, float]], used: bytearray):
        self.parameters = [names[index] for index, _ in missing]
        lines = [
            f"  {names[index]} (missing on {round(count)} of {world_size} ranks"
            f"{', including this one' if not used[index] else ''})"
            for index, count in missing
        ]
        details = f"{UNUSED_PARAMETERS_OPENING} while find_unused_parameters=False:\n" + "\n".join(lines[:20])
        super().__init__(f"{details}\n{UNUSED_PARAMETERS_HINT}")


def reached_parameters(outputs: object) -> set[int]:
    """The ids of the leaf tensors (parameters) that a backward from ``outputs`` will reach."""
    stack = []
    reached: set[int] = set()
    for tensor in tensors_in(outputs):
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


def tensors_in(value: object) -> Iterator[torch.Tensor]:
    """The tensors in a forward's outputs: a tensor, or dicts, lists, tuples and dataclasses of them."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from tensors_in(getattr(value, field.name))


def unused_members(buckets: Sequence[DenseBucket | ScatterBucket | SparseBucket], totals: list[float]) -> list[set[int]]:
    """Per bucket, the positions of the members no rank used (a flag sum of 0); ``totals``: the
    buckets' flags, concatenated."""
    skipped, offset = [], 0
    for bucket in buckets:
        count = len(bucket.indices)
        skipped.append({k for k in range(count) if totals[offset + k] == 0})
        offset += count
    return skipped


class PendingFlags:
    """The flags of one backward on their way to the host, copied without blocking on CUDA."""

    __slots__ = ("buckets", "used", "_host", "_copied")

    def __init__(self, buckets: Sequence[DenseBucket | ScatterBucket | SparseBucket], used: bytearray) -> None:
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
