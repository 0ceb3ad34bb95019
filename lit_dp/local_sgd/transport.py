"""A LocalSGD sync on the wire: the buckets a fragment's tensors travel in, and the one reduction over them.

A ``SyncBucket`` holds tensors of one dtype and device synced as one flat payload: the deltas
``snapshot - parameters`` (``DELTA``), the float buffers averaged (``MEAN``) or the other buffers
broadcast from the group's first rank (``FROM_FIRST_RANK``). ``reduce_across`` launches every
bucket's collective and the count of the ranks taking part, all before any is awaited;
``Reduction.wait`` issues none. A wire dtype (``sync_dtype="bf16"``) travels in that dtype and is
summed in fp32.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import lit_dp.gradients.group as process_groups
from lit_dp.gradients.waiting import Waiter
from lit_dp.options.local_sgd import SYNC_DTYPES

DELTA, MEAN, FROM_FIRST_RANK = "delta", "mean", "from_first_rank"
_WIRE_DTYPES = dict(zip(SYNC_DTYPES, (torch.bfloat16,)))


def wire_dtype(value: Any) -> torch.dtype | None:
    """None, ``torch.bfloat16`` or its name in ``SYNC_DTYPES`` ("bf16")."""
    if value is None or value in _WIRE_DTYPES.values():
        return value
    if isinstance(value, str) and value in _WIRE_DTYPES:
        return _WIRE_DTYPES[value]
    names = ", ".join(map(repr, SYNC_DTYPES))
    raise ValueError(f"sync_dtype={value!r} is invalid: expected None, torch.bfloat16 or one of {names}.")


def state_device(device: torch.device, offload: bool) -> torch.device:
    """Where the snapshot and the outer momentum of parameters on ``device`` live: the CPU for CUDA
    parameters when ``offload`` (the accelerator's memory is the scarce one), else their own device."""
    return torch.device("cpu") if offload and device.type == "cuda" else device


class SyncBucket:
    """Tensors of one dtype and device synced as one flat payload.

    Held between syncs: the snapshot (a deltas' bucket's parameters at its last sync), on
    ``state_device``, in pinned memory when that is the CPU and the tensors are on CUDA (``offload``).
    Held during a sync only: ``payload``, the flat tensor on the tensors' device (the deltas, then
    their sum: the pseudo-gradient), and with a ``wire`` dtype its two wire-dtype copies.
    """

    def __init__(
        self, kind: str, tensors: list[torch.Tensor], wire: torch.dtype | None = None, state_device: torch.device | None = None
    ) -> None:
        self.kind = kind
        self.tensors = tensors
        self.numels = [t.numel() for t in tensors]
        self.device, self.dtype = tensors[0].device, tensors[0].dtype
        self.snapshot = _state_copy(self._gather(), state_device or self.device) if kind == DELTA else None
        self.wire = wire if kind == DELTA and wire is not None and wire != self.dtype else None
        self.wire_bytes = sum(self.numels) * (self.wire or self.dtype).itemsize
        self.payload: torch.Tensor | None = None
        self._sent: torch.Tensor | None = None  # wire dtype, padded to a multiple of the group's size
        self._received: torch.Tensor | None = None
        self._group: dist.ProcessGroup | None = None
        self._work: dist.Work | None = None

    def _gather(self) -> torch.Tensor:
        return torch.cat([t.detach().reshape(-1) for t in self.tensors])

    def prepare(self, participates: bool) -> None:
        """The payload this rank sends: its delta ``snapshot - parameters`` (deltas' buckets), its float
        buffers (averaged ones), or its other buffers (broadcast from the first rank); zeros for the first
        two when it does not take part (a rank that ran out under Join): it adds nothing to the sum."""
        if not participates and self.kind != FROM_FIRST_RANK:
            self.payload = torch.zeros(sum(self.numels), dtype=self.dtype, device=self.device)
            return
        flat = self._gather()
        if self.snapshot is not None:
            torch.sub(self.snapshot.to(self.device, non_blocking=True), flat, out=flat)
        self.payload = flat

    def start(self, group: dist.ProcessGroup) -> None:
        """Launch this bucket's collective on ``group``: a sum (a broadcast from the group's first rank for
        the other buffers). A wire dtype is summed in fp32: each rank sends every other its chunk of the
        payload (``all_to_all``), adds the chunks it received in fp32 (``reduce_chunks``), and the sums
        are gathered back, in the wire dtype (``wait``): the bytes of one all-reduce in the wire dtype,
        rounded twice (the deltas, then their sum) whatever the number of ranks."""
        assert self.payload is not None, "start() before prepare()"
        self._group = group
        if self.kind == FROM_FIRST_RANK:
            self._work = dist.broadcast(self.payload, src=dist.get_global_rank(group, 0), group=group, async_op=True)
        elif self.wire is None:
            self._work = dist.all_reduce(self.payload, group=group, async_op=True)
        else:
            ranks = group.size()
            self._sent = torch.zeros(-(-self.payload.numel() // ranks) * ranks, dtype=self.wire, device=self.device)
            self._sent[: self.payload.numel()].copy_(self.payload)
            self._received = torch.empty_like(self._sent)
            self._work = dist.all_to_all_single(self._received, self._sent, group=group, async_op=True)

    def reduce_chunks(self, waiter: Waiter) -> None:
        """A wire dtype's second half: add the chunks received in fp32, launch the gather of the sums."""
        if self._received is None:
            return
        assert self._work is not None and self._sent is not None and self._group is not None
        waiter.wait(self._work, "the LocalSGD sync's exchange of chunks")
        accumulate = torch.promote_types(torch.float32, self.dtype)
        chunk_sum = self._received.view(self._group.size(), -1).sum(dim=0, dtype=accumulate).to(self.wire)
        self._received = None
        self._work = _all_gather(self._sent, chunk_sum, self._group)  # the sent chunks are no longer needed

    def wait(self, waiter: Waiter) -> None:
        """The sum (or broadcast) is in ``payload``."""
        assert self._work is not None and self.payload is not None and self._group is not None, "wait() before start()"
        process_groups.wait(waiter, self._work, self._group, "the LocalSGD average")
        self._work = None
        if self._sent is not None:
            self.payload.copy_(self._sent[: self.payload.numel()])
            self._sent = None

    def apply(self, participants: int, outer: bool, keep: float = 0.0) -> None:
        """Divide the sum by the ranks that took part and apply it; ``outer``: only hand the mean delta to
        the snapshot as its gradient (the outer optimizer steps the snapshots, then ``take_snapshot``).
        ``keep``: the weight of the local parameters in what they become (``mixing``; not for buffers).
        The payload is dropped either way."""
        result, self.payload = self.payload, None
        assert result is not None, "apply() before wait()"
        if self.snapshot is not None and outer:
            # The pseudo-gradient, on the snapshot's device, cleared by take_snapshot.
            self.snapshot.grad = result.div_(participants).to(self.snapshot.device)
            return
        if self.snapshot is not None:
            # snapshot - mean(delta): the mean of the ranks' parameters, and the next snapshot.
            # One pass: scaling inside the subtraction (alpha) instead of dividing first.
            self.snapshot.sub_(result.to(self.snapshot.device), alpha=1.0 / participants)
            self._scatter(self.snapshot, keep)
            return
        if self.kind == MEAN:
            result.div_(participants)
        self._scatter(result)

    def take_snapshot(self, keep: float = 0.0) -> None:
        """Every rank's parameters become the snapshot the outer optimizer just stepped (``keep``: mixed
        with the local ones); the pseudo-gradient is dropped, so that the next outer step (another
        fragment's) leaves this one be."""
        if self.snapshot is not None:
            self._scatter(self.snapshot, keep)
            self.snapshot.grad = None

    def drop(self) -> None:
        """A sync that nobody took part in: nothing to apply."""
        self.payload = None

    def _scatter(self, result: torch.Tensor, keep: float = 0.0) -> None:
        """The tensors become ``result``, or with ``keep`` its mix with them: ``keep * t + (1 - keep) * result``
        (torchft's ``fragment_update_alpha``); 0 copies, bit for bit."""
        pieces = [p.view_as(t) for p, t in zip(result.to(self.device, non_blocking=True).split(self.numels), self.tensors)]
        if keep:
            torch._foreach_lerp_([t.detach() for t in self.tensors], pieces, 1.0 - keep)
        else:
            torch._foreach_copy_([t.detach() for t in self.tensors], pieces)

    def in_flight(self) -> list[torch.Tensor]:
        """The tensors of a sync under way (none between syncs)."""
        return [t for t in (self.payload, self._sent, self._received) if t is not None]


class Reduction:
    """A sync's collectives, all launched (``reduce_across``): ``wait`` issues none."""

    def __init__(
        self, buckets: list[SyncBucket], count: torch.Tensor, count_work: dist.Work, group: dist.ProcessGroup, waiter: Waiter
    ) -> None:
        self._buckets, self._count, self._count_work, self._group, self._waiter = buckets, count, count_work, group, waiter

    def wait(self) -> int:
        """Every bucket's sum is in its ``payload``; returns how many ranks took part."""
        for bucket in self._buckets:
            bucket.wait(self._waiter)
        process_groups.wait(self._waiter, self._count_work, self._group, "the LocalSGD count of the ranks taking part")
        return int(self._count.item())


def reduce_across(
    buckets: list[SyncBucket], groups: list[dist.ProcessGroup], waiter: Waiter, participates: bool = True
) -> Reduction:
    """The one cross-rank reduction of a sync: the sum over the ranks of ``groups`` of every bucket's
    payload (the deltas ``s - p``, which divided become the pseudo-gradient; the float buffers; the
    other buffers broadcast from the first rank), left in each bucket's ``payload`` once waited for.
    Bucket i goes on ``groups[i % len(groups)]`` (the rings); every collective is launched here, all
    before any is awaited (a wire dtype, summed in fp32, waits for its exchange of chunks and launches
    the gather of the sums), so that waiting (``Reduction.wait``) issues none, whenever it comes.
    The wait returns how many ranks took part: the divisor, all-reduced with the payloads, since a
    rank that ran out (``participates=False``) sends zeros. Every rank of ``groups`` must call it with
    the same buckets; pointing ``groups`` at another group (torchft's replica groups) syncs across it."""
    device = buckets[0].device if buckets else torch.device("cpu")
    count = torch.tensor([float(participates)], device=device)
    count_work = dist.all_reduce(count, group=groups[0], async_op=True)
    for index, bucket in enumerate(buckets):
        bucket.prepare(participates)
        bucket.start(groups[index % len(groups)])
    for bucket in buckets:
        bucket.reduce_chunks(waiter)
    return Reduction(buckets, count, count_work, groups[0], waiter)


def _state_copy(flat: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of ``flat`` on ``device``: pinned when it leaves a CUDA device for the CPU, so that the copies
    to and from the device at each sync can run asynchronously."""
    if device == flat.device:
        return flat.clone()
    pinned = device.type == "cpu" and flat.device.type == "cuda"
    return torch.empty(flat.shape, dtype=flat.dtype, device=device, pin_memory=pinned).copy_(flat)


def _all_gather(output: torch.Tensor, chunk: torch.Tensor, group: dist.ProcessGroup) -> dist.Work:
    # torch 2.13 renamed all_gather_into_tensor (FutureWarning); the project supports torch >= 2.8.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, chunk, group=group, async_op=True)
