"""What the reducer and its observers know of a bucket: one declared protocol, and the dense buckets' common part.

Three kinds of bucket carry gradients (``DenseBucket``, ``ScatterBucket`` under sharding stage
2, ``SparseBucket``); the reducer drives each through ``Bucket`` (start, wait, write back) and
its observers read the same three figures of each (``nbytes``, ``sent_bytes``, ``futures``), so
neither knows which kind it holds. The two dense kinds share ``DenseGradients``: their members'
bytes, summed once, and the collectives they start.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

import lit_dp.gradients.group as groups
from lit_dp.gradients.plan import StepPlan
from lit_dp.gradients.waiting import Waiter


class Bucket(Protocol):
    """A bucket as the reducer and its observers use it."""

    indices: list[int]  # the reducer's parameter indices, in its order
    params: list[nn.Parameter]

    @property
    def nbytes(self) -> int:
        """The bytes of its members' gradients, as laid out (0 for a sparse one)."""
        ...

    def sent_bytes(self) -> int:
        """The gradient bytes its last start sent (its flags not counted)."""
        ...

    def futures(self) -> list[torch.futures.Future]:
        """Futures of the collectives started last; none for a group of one rank."""
        ...

    def start(self, plan: StepPlan, used: bytearray, complete: bool = False) -> None: ...

    def wait(self) -> None: ...

    def write_back(self, as_view: bool, skipped: Collection[int]) -> None: ...


class DenseGradients:
    """What ``DenseBucket`` and ``ScatterBucket`` share: members, their bytes, the collectives started."""

    __slots__ = ("_nbytes", "indices", "params", "ring", "works", "waiter")

    def __init__(self, indices: list[int], params: list[nn.Parameter], ring: dist.ProcessGroup, waiter: Waiter) -> None:
        self.indices = indices
        self.params = params
        # Read at every launch by the observers (comm_stats, the hang watchdog: on by default): summed once.
        self._nbytes = sum(p.numel() * p.element_size() for p in params)
        self.ring = ring
        self.works: list[dist.Work] = []
        self.waiter = waiter  # the owner's policy for every wait (a deadline under the hang watchdog)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def sent_bytes(self) -> int:
        """The gradient bytes this bucket reduces (its flags not counted)."""
        return self.nbytes

    def futures(self) -> list[torch.futures.Future]:
        """Futures of the collectives started last; none for a group of one rank.

        Gloo's ``reduce`` (a stage-2 bucket's) has no future (``Work::getFuture not implemented``):
        such works are left out, so observers (the hang watchdog, always subscribed) see the
        flags' all-reduce only.
        """
        futures = []
        for work in self.works:
            try:
                futures.append(work.get_future())
            except RuntimeError:
                continue
        return futures

    def wait(self) -> None:
        """Wait for this bucket's collectives (on CUDA: make the current stream wait for them)."""
        for work in self.works:
            groups.wait(self.waiter, work, self.ring)
        self.works = []
