"""A small all-gather the ranks start at a step's start and read once it completed, without blocking the host.

The straggler report and the replica-consistency check compare a few numbers per rank every N
steps. Each starts its all-gather in the reducer's ``step_started``, where every rank of the
group passes at the same synchronised step, a joined or replaying one included, and before the
step's buckets, so that all ranks issue the same collectives in the same order. The result is
read later: on the host (Gloo) after the step's buckets were waited for, when it has long
arrived; on CUDA once a copy to the host, queued behind the all-gather, has landed.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import lit_dp.gradients.group as groups
from lit_dp.gradients.waiting import Waiter
from lit_dp.job import in_flight


class Exchange:
    """All-gathers one 1-D tensor per rank over ``group`` and hands ``deliver(tag, rows)`` the result,
    one row per rank, on the host; ``what`` names it in a hang's diagnosis. ``deliver`` is a method
    of the observer that owns this exchange, held weakly: a cycle would keep the process group
    alive after it was destroyed, and with it rank 0's rendezvous port."""

    def __init__(
        self, group: dist.ProcessGroup, waiter: Waiter, what: str, deliver: Callable[[Any, torch.Tensor], None]
    ) -> None:
        self._group = group
        self._waiter = waiter
        self._what = what
        self._deliver = weakref.WeakMethod(deliver)
        # (tag, the work, its outputs) until read; on CUDA then (tag, None, [], the copy's event, the host copy)
        self._pending: tuple[Any, dist.Work | None, list[torch.Tensor], Any, torch.Tensor | None] | None = None

    def start(self, values: torch.Tensor, tag: Any) -> None:
        """Start gathering every rank's ``values`` (same length everywhere); ``tag`` comes back with the
        result. A result still on its way to the host (CUDA) is delivered first."""
        self.poll(wait=True)
        gathered = [torch.empty_like(values) for _ in range(self._group.size())]
        work = dist.all_gather(gathered, values, group=self._group, async_op=True)
        in_flight.keep(values, *gathered)  # the run's last one may be read as it ends, or dropped unread
        self._pending = (tag, work, gathered, None, None)

    def poll(self, wait: bool = False) -> None:
        """Deliver the result if it arrived: on the host it is waited for (polled after the step's
        buckets, it has arrived already); on CUDA, once the copy to the host landed (``wait``: now)."""
        if self._pending is None:
            return
        tag, work, gathered, arrived, host = self._pending
        if work is not None:
            groups.wait(self._waiter, work, self._group, self._what)
            stacked = torch.stack(gathered)
            if stacked.device.type != "cuda":
                self._hand_over(tag, stacked)
                return
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
            return
        self._hand_over(tag, host)

    def _hand_over(self, tag: Any, rows: torch.Tensor) -> None:
        self._pending = None
        deliver = self._deliver()
        if deliver is not None:
            deliver(tag, rows)
