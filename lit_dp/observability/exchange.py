"""A small all-gather the ranks start at a step's start and read once it completed, without blocking the host.

The straggler report and the replica-consistency check compare a few numbers per rank every N
steps. Each starts its all-gather in the reducer's ``step_started``, where every rank of the
group passes at the same synchronised step, a joined or replaying one included, and before the
step's buckets, so that all ranks issue the same collectives in the same order. The result is
read later: on the host (Gloo) after the step's buckets were waited for, when it has long
arrived; on CUDA once a copy to the host, queued behind the all-gather, has landed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import lit_dp.gradients.group as groups
from lit_dp.gradients.waiting import Waiter


class Exchange:
    """All-gathers one 1-D tensor per rank over ``group``; ``what`` names it in a hang's diagnosis."""

    def __init__(self, group: dist.ProcessGroup, waiter: Waiter, what: str) -> None:
        self._group = group
        self._waiter = waiter
        self._what = what
        # (tag, the work, its outputs) until read; on CUDA then (tag, None, [], the copy's event, the host copy)
        self._pending: tuple[Any, dist.Work | None, list[torch.Tensor], Any, torch.Tensor | None] | None = None

    def start(self, values: torch.Tensor, tag: Any) -> None:
        """Start gathering every rank's ``values`` (same length everywhere); ``tag`` comes back with the result."""
        if self._pending is not None:
            raise RuntimeError(f"lit_dp: {self._what} started before the last one was read")
        gathered = [torch.empty_like(values) for _ in range(self._group.size())]
        work = dist.all_gather(gathered, values, group=self._group, async_op=True)
        self._pending = (tag, work, gathered, None, None)

    def result(self, wait: bool = False) -> tuple[Any, torch.Tensor] | None:
        """``(tag, rows)``, one row per rank of the group, on the host, once arrived; None while
        nothing is pending or, on CUDA, the copy to the host is on its way (``wait``: wait for it).
        Host tensors are waited for: read after the step's buckets, they have arrived already."""
        if self._pending is None:
            return None
        tag, work, gathered, arrived, host = self._pending
        if work is not None:
            groups.wait(self._waiter, work, self._group, self._what)
            stacked = torch.stack(gathered)
            if stacked.device.type != "cuda":
                self._pending = None
                return tag, stacked
            # The current stream now waits for the all-gather; a copy queued behind it lands on
            # the host when the device gets there.
            host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)  # so that the copy does not block
            host.copy_(stacked, non_blocking=True)
            arrived = torch.cuda.Event()
            arrived.record()
            self._pending = tag, None, [], arrived, host
        assert arrived is not None and host is not None
        if wait:
            arrived.synchronize()
        elif not arrived.query():
            return None
        self._pending = None
        return tag, host
