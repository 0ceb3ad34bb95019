"""A LocalSGD sync on the wire: the buckets a fragment's tensors travel in, and the one reduction over them.

A ``SyncBucket`` holds tensors of one dtype and device synced as one flat payload: the deltas
``snapshot - parameters`` (``DELTA``), the float buffers averaged (``MEAN``) or the other buffers
broadcast from the group's first rank (``FROM_FIRST_RANK``). ``reduce_across`` launches every
bucket's collective and the count of the ranks taking part, all before any is awaited;
``Reduction.wait`` issues none. With a wire format (``sync_dtype``: ``lit_dp.local_sgd.wire``) the
deltas travel encoded and are summed in fp32, with two collectives on the group it is given and no
other: an all-to-all (the group's ``alltoall_base``) and an all-gather into one tensor (torch's
function for torch's groups; ``allgather_into_tensor_coalesced`` for a group written in Python, as
torchft's own quantized all-reduce asks its process groups), so a group that offers those two (and
the SUM all-reduce of the count of ranks taking part) carries every format: torchft's replica groups
of one rank each (``FaultTolerantGroup``) among them. Over replica groups of several ranks (a group
with ``reduce_by_shards``, ``lit_dp.fault_tolerance.hierarchical``) the deltas are summed inside each
group in their own dtype first, and only each rank's shard of that sum crosses groups encoded.

Error feedback (``error_feedback``): what the encoding drops on a rank is kept (``residual``) and
added to that rank's next delta, so that over many syncs the sum applied tracks the fp32 sum
(Seide et al., 2014; Karimireddy et al., 2019). The reduction rounds twice: each rank's delta when
it is sent, and each chunk's sum when its owner sends it back. Both are fed back: the first by
every rank into its own residual, the second by the chunk's owner into the same residual's slice of
that chunk, since the sum it dropped belongs to no other rank. The residuals' sum then equals the
fp32 sum of the deltas minus the sum applied, at every sync: nothing dropped is lost, only delayed.
A sync that may be voided after it started (``revertible``: across replica groups, whose vote may
fail) gives the residuals back as it found them when it is (``drop``): its deltas were not applied,
and the next sync's carry them again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions

import lit_dp.gradients.group as process_groups
from lit_dp.gradients.waiting import UNWATCHED, Waiter
from lit_dp.local_sgd.wire import WireFormat
from lit_dp.options.local_sgd import WIRE_BACKENDS

DELTA, MEAN, FROM_FIRST_RANK = "delta", "mean", "from_first_rank"


def check_wire_backends(sync_dtype: Any, groups: list[dist.ProcessGroup]) -> None:
    """A wire format travels as bytes through an all-to-all and an all-gather: refused, before the first
    sync, on a backend lit_dp does not run them on."""
    for group in groups:
        backend = process_groups.backend_name(group)
        if backend not in WIRE_BACKENDS:
            raise ValueError(
                f"sync_dtype={sync_dtype!r} is invalid on the process group's backend {backend!r}: a sync in a wire "
                f"format takes an all-to-all and an all-gather, which lit_dp runs on {' and '.join(WIRE_BACKENDS)}; "
                "expected sync_dtype=None (the parameters' dtype) on this backend."
            )


def state_device(device: torch.device, offload: bool) -> torch.device:
    """Where the snapshot, the outer momentum and the residual of parameters on ``device`` live: the CPU
    for CUDA parameters when ``offload`` (the accelerator's memory is the scarce one), else their own device."""
    return torch.device("cpu") if offload and device.type == "cuda" else device


class SyncBucket:
    """Tensors of one dtype and device synced as one flat payload.

    Held between syncs: the snapshot (a deltas' bucket's parameters at its last sync) and, with error
    feedback, the residual (what this rank's encodings dropped, not sent yet; fp32, or fp64 for fp64
    parameters), both on ``state_device``, in pinned memory when that is the CPU and the tensors are
    on CUDA (``offload``). Held during a sync only: ``payload``, the flat tensor on the tensors'
    device (the deltas, then their sum: the pseudo-gradient), and with a ``wire`` format the bytes
    sent and received.
    """

    def __init__(
        self,
        kind: str,
        tensors: list[torch.Tensor],
        wire: WireFormat | None = None,
        state_device: torch.device | None = None,
        error_feedback: bool = False,
        revertible: bool = False,
    ) -> None:
        self.kind = kind
        self.tensors = tensors
        self.numels = [t.numel() for t in tensors]
        self.device, self.dtype = tensors[0].device, tensors[0].dtype
        self.snapshot = _state_copy(self._gather(), state_device or self.device) if kind == DELTA else None
        self.wire = wire if kind == DELTA and wire is not None and not wire.carries(self.dtype) else None
        # The dtype the sums are taken in: fp32, or the parameters' own when wider.
        self._accumulate = torch.promote_types(torch.float32, self.dtype)
        self.residual: torch.Tensor | None = None
        if self.wire is not None and error_feedback:
            zeros = torch.zeros(sum(self.numels), dtype=self._accumulate, device=self.device)
            self.residual = _state_copy(zeros, state_device or self.device)
        # A sync that may be voided after it started (across replica groups, by a failed vote) keeps the
        # residual it started from, to take back what it fed back (``drop``).
        self._revertible = revertible
        self._residual_before: torch.Tensor | None = None
        self.payload: torch.Tensor | None = None
        self._participates = True
        self._exchange: _WireExchange | None = None  # a wire format's sum over a flat group, under way
        self._group: dist.ProcessGroup | None = None
        self._work: dist.Work | None = None

    def _gather(self) -> torch.Tensor:
        return torch.cat([t.detach().reshape(-1) for t in self.tensors])

    def wire_bytes(self, ranks: int) -> int:
        """The bytes of this bucket's payload on ``ranks`` ranks as they travel: its elements in the
        parameters' dtype, or encoded (with their scales) and padded to a chunk per rank, which is what
        each rank's ``all_to_all`` sends (its own chunk included) and its ``all_gather`` receives."""
        if self.wire is None:
            return sum(self.numels) * self.dtype.itemsize
        return encoded_bytes(self.wire, sum(self.numels), ranks)

    def prepare(self, participates: bool) -> None:
        """The payload this rank sends: its delta ``snapshot - parameters`` (deltas' buckets), its float
        buffers (averaged ones), or its other buffers (broadcast from the first rank); zeros for the first
        two when it does not take part (a rank that ran out under Join): it adds nothing to the sum, and
        its residual waits."""
        self._participates = participates
        if not participates and self.kind != FROM_FIRST_RANK:
            self.payload = torch.zeros(sum(self.numels), dtype=self.dtype, device=self.device)
            return
        flat = self._gather()
        if self.snapshot is not None:
            torch.sub(self.snapshot.to(self.device, non_blocking=True), flat, out=flat)
        self.payload = flat

    def start(self, group: dist.ProcessGroup) -> None:
        """Launch this bucket's collective on ``group``: a sum (a broadcast from the group's first rank for
        the other buffers). A wire format is summed in fp32 (``_WireExchange``): each rank encodes its payload
        (plus its residual) in one chunk per rank, sends every other its chunk (``all_to_all``), adds the
        chunks it received in fp32 (``reduce_chunks``), and the sums are gathered back, encoded (``wait``): the
        bytes of one all-reduce in the wire format, rounded twice (the deltas, then their sum) whatever the
        number of ranks. Over replica groups of several ranks (a group with ``reduce_by_shards``:
        ``lit_dp.fault_tolerance.hierarchical``) the payload is summed in the parameters' dtype inside each
        group first, and only each rank's shard of that sum crosses groups in the wire format."""
        assert self.payload is not None, "start() before prepare()"
        self._group = group
        if self.residual is not None and self._revertible and self._participates:
            self._residual_before = self.residual.clone()
        if self.kind == FROM_FIRST_RANK:
            self._work = dist.broadcast(self.payload, src=dist.get_global_rank(group, 0), group=group, async_op=True)
        elif self.wire is None:
            self._work = dist.all_reduce(self.payload, group=group, async_op=True)
        elif hasattr(group, "reduce_by_shards"):
            self._work = group.reduce_by_shards(self.payload, self._sum_shard)
        else:
            self._exchange = _WireExchange(self.wire, self._accumulate, self.payload, self._fed_back(), group)

    def _fed_back(self) -> torch.Tensor | None:
        """The residual this sync adds and feeds back (None without error feedback, or when this rank does not
        take part: it sends zeros, and its residual waits)."""
        return self.residual if self._participates else None

    def _sum_shard(self, shard: torch.Tensor, offset: int, across: dist.ProcessGroup) -> int:
        """The wire format's sum of ``shard`` (this group's sum of the payload's values from ``offset`` on) over
        ``across``, the replica groups' same-rank peers, written back into it; this rank's residual covers those
        values. Run in order on the hierarchical group's thread; returns the bytes that crossed groups."""
        residual = self._fed_back()
        own = residual[offset : offset + shard.numel()] if residual is not None else None
        exchange = _WireExchange(self.wire, self._accumulate, shard, own, across)
        exchange.reduce_chunks(UNWATCHED)
        shard.copy_(exchange.result(UNWATCHED))
        return exchange.sent_bytes

    def reduce_chunks(self, waiter: Waiter) -> None:
        """A wire format's second half: add the chunks received in fp32 (in rank order), encode the sum and
        launch its gather; with error feedback, what that encoding dropped joins this rank's residual."""
        if self._exchange is not None:
            self._exchange.reduce_chunks(waiter)

    def wait(self, waiter: Waiter) -> None:
        """The sum (or broadcast) is in ``payload``."""
        assert self.payload is not None and self._group is not None, "wait() before start()"
        if self._exchange is not None:
            self.payload.copy_(self._exchange.result(waiter))
            self._exchange = None
            return
        assert self._work is not None, "wait() before start()"
        process_groups.wait(waiter, self._work, self._group, "the LocalSGD average")
        self._work = None

    def apply(self, participants: int, outer: bool, keep: float = 0.0) -> None:
        """Divide the sum by the ranks that took part and apply it; ``outer``: only hand the mean delta to
        the snapshot as its gradient (the outer optimizer steps the snapshots, then ``take_snapshot``).
        ``keep``: the weight of the local parameters in what they become (``mixing``; not for buffers).
        The payload is dropped either way."""
        result, self.payload = self.payload, None
        assert result is not None, "apply() before wait()"
        self._residual_before = None
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
        """A sync that nobody took part in, or that failed (across replica groups): nothing to apply, and the
        residual is the one the sync started from (what it fed back was never applied: the next sync's delta
        carries it again)."""
        self.payload = None
        if self._residual_before is not None:
            self.residual.copy_(self._residual_before)
            self._residual_before = None

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
        held = (self.payload, self._residual_before, *(self._exchange.held() if self._exchange is not None else ()))
        return [t for t in held if t is not None]


def encoded_bytes(wire: WireFormat, numel: int, ranks: int) -> int:
    """The bytes of ``numel`` values summed in ``wire`` over ``ranks`` ranks: a chunk per rank, each padded to
    whole blocks and encoded with its scales (what each rank's all-to-all sends, its own chunk included)."""
    return ranks * wire.row_bytes(_chunk_length(wire, numel, ranks))


def _chunk_length(wire: WireFormat, numel: int, ranks: int) -> int:
    return -(-numel // (ranks * wire.granule)) * wire.granule


class _WireExchange:
    """The sum over ``group`` of ``values`` (every rank's, of one length) in a wire format, summed in fp32
    (``accumulate``), and with error feedback into ``residual`` (None: none), which covers the first values.

    Built, it has encoded the values plus the residual, one chunk per rank of ``group``, kept what that
    dropped in the residual, and launched the all-to-all; ``reduce_chunks`` adds the chunks received, encodes
    their sum (feeding back what that dropped into the residual's slice of this rank's chunk) and launches
    the all-gather; ``result`` waits for it and decodes the sum.
    """

    def __init__(
        self,
        wire: WireFormat,
        accumulate: torch.dtype,
        values: torch.Tensor,
        residual: torch.Tensor | None,
        group: dist.ProcessGroup,
    ) -> None:
        self._wire, self._accumulate, self._residual, self._group = wire, accumulate, residual, group
        self._numel = values.numel()
        ranks = group.size()
        self._length = _chunk_length(wire, self._numel, ranks)  # values per rank's chunk, padded to the granule
        padded = torch.zeros(ranks * self._length, dtype=accumulate, device=values.device)
        padded[: self._numel].copy_(values)
        fed = residual.numel() if residual is not None else 0
        if residual is not None:
            padded[:fed].add_(residual.to(values.device, non_blocking=True))
        rows = padded.view(ranks, self._length)
        self._sent: torch.Tensor | None = wire.encode(rows)  # [ranks, bytes per chunk]
        self.sent_bytes = self._sent.numel()
        if residual is not None:  # what this encoding dropped waits for the next sync
            dropped = rows.sub_(wire.decode(self._sent, self._length, accumulate))
            residual.copy_(dropped.view(-1)[:fed])
        self._received: torch.Tensor | None = torch.empty_like(self._sent)
        self._work = dist.all_to_all_single(self._received, self._sent, group=group, async_op=True)

    def reduce_chunks(self, waiter: Waiter) -> None:
        if self._received is None:
            return
        assert self._sent is not None
        process_groups.wait(waiter, self._work, self._group, "the LocalSGD sync's exchange of chunks")
        wire, length, accumulate = self._wire, self._length, self._accumulate
        total = wire.decode(self._received[:1], length, accumulate)
        for rank in range(1, self._group.size()):
            total += wire.decode(self._received[rank : rank + 1], length, accumulate)
        self._received = None
        encoded = wire.encode(total)
        if self._residual is not None:
            first = self._group.rank() * length
            owned = self._residual[first : first + length]  # the chunk's values in the payload (none in padding)
            dropped = total.sub_(wire.decode(encoded, length, accumulate)).view(-1)
            owned.add_(dropped[: owned.numel()].to(owned.device))
        self._work = _all_gather(self._sent.view(-1), encoded.view(-1), self._group)  # the sent chunks are no longer needed

    def result(self, waiter: Waiter) -> torch.Tensor:
        """The sum of the values, in ``accumulate``."""
        assert self._sent is not None and self._received is None, "result() before reduce_chunks()"
        process_groups.wait(waiter, self._work, self._group, "the LocalSGD average")
        total = self._wire.decode(self._sent, self._length, self._accumulate).view(-1)[: self._numel]
        self._sent = None
        return total

    def held(self) -> tuple[torch.Tensor | None, ...]:
        return self._sent, self._received


class Reduction:
    """A sync's collectives, all launched (``reduce_across``): ``wait`` issues none. ``exchange``: the marks
    (``reduce_across``'s ``mark``) around the wait for a wire format's exchange of chunks, which launching
    takes: the first collectives were all launched at the first; None without ``mark``."""

    def __init__(
        self, buckets: list[SyncBucket], count: torch.Tensor, count_work: dist.Work, group: dist.ProcessGroup, waiter: Waiter
    ) -> None:
        self._buckets, self._count, self._count_work, self._group, self._waiter = buckets, count, count_work, group, waiter
        self.exchange: tuple[Any, Any] | None = None

    def wait(self) -> int:
        """Every bucket's sum is in its ``payload``; returns how many ranks took part."""
        for bucket in self._buckets:
            bucket.wait(self._waiter)
        process_groups.wait(self._waiter, self._count_work, self._group, "the LocalSGD count of the ranks taking part")
        return int(self._count.item())


def reduce_across(
    buckets: list[SyncBucket],
    groups: list[dist.ProcessGroup],
    waiter: Waiter,
    participates: bool = True,
    mark: Callable[[], Any] | None = None,
) -> Reduction:
    """The one cross-rank reduction of a sync: the sum over the ranks of ``groups`` of every bucket's
    payload (the deltas ``s - p``, which divided become the pseudo-gradient; the float buffers; the
    other buffers broadcast from the first rank), left in each bucket's ``payload`` once waited for.
    Bucket i goes on ``groups[i % len(groups)]`` (the rings); every collective is launched here, all
    before any is awaited (a wire dtype, summed in fp32, waits for its exchange of chunks and launches
    the gather of the sums), so that waiting (``Reduction.wait``) issues none, whenever it comes.
    The wait returns how many ranks took part: the divisor, all-reduced with the payloads, since a
    rank that ran out (``participates=False``) sends zeros. Every rank of ``groups`` must call it with
    the same buckets; pointing ``groups`` at another group (torchft's replica groups) syncs across it.
    ``mark`` (a clock's): timed around the wait for the exchange of chunks (``Reduction.exchange``), the
    part of launching that blocks."""
    device = buckets[0].device if buckets else torch.device("cpu")
    count = torch.tensor([float(participates)], device=device)
    count_work = dist.all_reduce(count, group=groups[0], async_op=True)
    for index, bucket in enumerate(buckets):
        bucket.prepare(participates)
        bucket.start(groups[index % len(groups)])
    reduction = Reduction(buckets, count, count_work, groups[0], waiter)
    launched = mark() if mark is not None else None
    for bucket in buckets:
        bucket.reduce_chunks(waiter)
    if mark is not None:
        reduction.exchange = (launched, mark())
    return reduction


def _state_copy(flat: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of ``flat`` on ``device``: pinned when it leaves a CUDA device for the CPU, so that the copies
    to and from the device at each sync can run asynchronously."""
    if device == flat.device:
        return flat.clone()
    pinned = device.type == "cpu" and flat.device.type == "cuda"
    return torch.empty(flat.shape, dtype=flat.dtype, device=device, pin_memory=pinned).copy_(flat)


def _all_gather(output: torch.Tensor, chunk: torch.Tensor, group: dist.ProcessGroup) -> dist.Work:
    if process_groups.written_in_python(group):
        # A group written in Python (torchft's process groups) is asked as torchft's own quantized all-reduce
        # asks it: torch's functions would look it up in their registry of groups, or (2.13) call a method of
        # a new name on it.
        return group.allgather_into_tensor_coalesced([output], [chunk], AllgatherOptions())
    # torch 2.13 renamed all_gather_into_tensor (FutureWarning); the project supports torch >= 2.8.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, chunk, group=group, async_op=True)
