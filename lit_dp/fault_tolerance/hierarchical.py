"""Replica groups of many ranks: the hierarchical all-reduce, in-group then across groups.

A replica group is one launcher's job (``torchrun --nproc-per-node=N``, ``--nnodes=M``, one SLURM
job): its N ranks train on their own process group, fast and reliable (NCCL on a node's GPUs),
and only the replicated dimension goes through torchft's quorum, as torchtitan's fault-tolerant
HSDP does. ``HierarchicalGroup`` is that pair as one process group for lit_dp's reducer, whose
buckets then never change: each all-reduce of a bucket becomes

1. a reduce-scatter inside the group: rank ``r`` of the group holds the group's sum of shard ``r``
   (a ``ceil(numel / N)``-element slice of the bucket);
2. an all-reduce of that shard across the replica groups of the step's quorum, on the
   ``FaultTolerantGroup``: rank ``r`` of every group meets rank ``r`` of the others (torchft's
   quorum configures one process group per group rank), so each rank sends 1/N of the bucket
   across groups, and a failure there discards the step as for a one-process group;
3. an all-gather inside the group, which gives every rank the whole reduced bucket.

The two process groups are given explicitly and the pair always reduces across groups: a model
whose gradients stay inside the group (LocalSGD's inner steps) reduces on ``within`` itself
(``DataParallel.keep_gradients_local``), and a failure across groups fails the transaction of the
commit protocol (``lit_dp.fault_tolerance.commit``), for every rank of the group at its vote.

LocalSGD's syncs in a wire format (``sync_dtype``) take the same three steps, the second one their own
(``reduce_by_shards``): rank ``r``'s shard of the group's sum is summed with the same rank of the other
groups in the wire format (``lit_dp.local_sgd.transport``), so that only the hop across groups, the
thin link, is quantized.

Paddle's fleet calls this the hierarchical all-reduce. The group's ``size()`` is the ranks of the
groups taking part (N times the quorum's groups), what the reducer divides by. LocalSGD's
averages take the same path: the replicas of one group are equal between its syncs, so the
group's sum is N copies, divided by N times the groups.

The three steps of one all-reduce run one after the other on a thread of the group's own (one
that takes the all-reduces asked for while there are any, then ends), so that backward goes on
meanwhile, as with any process group's asynchronous work; the all-reduces are taken in the order
they were asked for, the same on every rank, which keeps the group's collectives paired. A failure inside the group (a rank died: its launcher is ending the group)
fails the work, and with it the step, at once: nothing waits on a group that is being restarted.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import lit_dp.gradients.group as groups
from lit_dp.options.fault_tolerance import TORCHFT


@dataclass
class CrossGroupTraffic:
    """What one rank sent to the replica groups' all-reduces, against what it reduced in all.

    ``reduced_bytes`` counts the tensors handed to the group (a flat all-reduce would send all of
    them across groups); ``across_bytes`` the shards that crossed groups (1/N of them, rounded up
    to whole elements per all-reduce), in a wire format their encoded bytes (a chunk per group,
    scales and padding included: the all-to-all's, the all-gather carrying as much back as a ring
    all-reduce's second half does); ``allreduces`` the tensors. All count every attempt, a
    discarded step's or failed sync's included.
    """

    reduced_bytes: int = 0
    across_bytes: int = 0
    allreduces: int = 0

    def add(self, reduced: int, across: int) -> None:
        self.reduced_bytes += reduced
        self.across_bytes += across
        self.allreduces += 1


class HierarchicalGroup(dist.ProcessGroup):
    """A replica group of many ranks (``within``) and the replica groups of the quorum (``across``),
    as one process group: see the module docstring.

    ``within`` is the replica group's own process group (torch's, e.g. the default group of its
    launcher's job); ``across`` is this rank's ``FaultTolerantGroup``. Only ``allreduce`` with
    ``ReduceOp.SUM`` is offered, what lit_dp's reducer and LocalSGD ask of a group under a torchft
    Manager, and ``reduce_by_shards``, the same sum with another step across groups (LocalSGD's
    syncs in a wire format, whose shards cross groups encoded).
    """

    def __init__(self, within: dist.ProcessGroup, across: Any) -> None:
        super().__init__(within.rank(), within.size())
        self.within = within
        self.across = across
        self.traffic = CrossGroupTraffic()
        # NCCL's reduce-scatter beats one reduce per owner; Gloo's does not (docs/benchmarks.md,
        # "Thresholds of the gradient path"), and torch 2.8's Gloo has no reduce_scatter_tensor.
        self._nccl = groups.backend_name(within) == "nccl"
        self._jobs: deque[Callable[[], None]] = deque()
        self._lock = threading.Lock()
        self._draining = False  # a thread is taking the jobs

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return TORCHFT

    def size(self) -> int:
        return self.within.size() * self.across.size()

    def rank(self) -> int:
        across = self.across.rank()
        return -1 if across < 0 else across * self.within.size() + self.within.rank()

    @property
    def commit(self) -> Any:
        """The commit protocol every collective across the groups goes through (the cross-group group's)."""
        return self.across.commit

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        op = opts if isinstance(opts, dist.ReduceOp) else opts.reduceOp
        if op != dist.ReduceOp.SUM:
            raise ValueError(
                f"lit_dp HierarchicalGroup: all_reduce with {op} is not supported: lit_dp divides by the ranks of the "
                "replica groups taking part itself; expected ReduceOp.SUM."
            )
        for tensor in tensors:
            if not tensor.is_contiguous():
                raise ValueError("lit_dp HierarchicalGroup: all_reduce needs contiguous tensors (bucket buffers are).")
        return self._in_order(tensors, self._sum_across)

    def reduce_by_shards(self, tensor: torch.Tensor, sum_across: Callable[[torch.Tensor, int, Any], int]) -> dist.Work:
        """A sum of ``tensor`` like ``allreduce``'s, whose step across groups is the caller's:
        ``sum_across(shard, offset, across)`` replaces ``shard`` (this rank's shard of the group's sum, the
        tensor's values from ``offset`` on, padded with zeros) with its sum over ``across``, through its
        collectives (LocalSGD's syncs in a wire format: ``lit_dp.local_sgd.transport``), and returns the bytes
        it sent across groups. Run in turn with the all-reduces, on the group's thread."""
        return self._in_order([tensor], sum_across)

    def _sum_across(self, shard: torch.Tensor, offset: int, across: Any) -> int:
        across.allreduce([shard], dist.ReduceOp.SUM).wait()  # never raises: a failure fails the transaction
        return shard.numel() * shard.element_size()

    def _in_order(self, tensors: list[torch.Tensor], sum_across: Callable[[torch.Tensor, int, Any], int]) -> dist.Work:
        future: torch.futures.Future = torch.futures.Future()
        # On CUDA the worker's collectives must follow what the caller's stream wrote into the tensors.
        ready = torch.cuda.current_stream().record_event() if tensors and tensors[0].is_cuda else None

        def job() -> None:
            try:
                if ready is not None:
                    torch.cuda.set_device(tensors[0].device)
                    torch.cuda.current_stream().wait_event(ready)
                for tensor in tensors:
                    self._reduce(tensor, sum_across)
                done = torch.cuda.current_stream().record_event() if ready is not None else None
            except Exception as error:  # noqa: BLE001 - handed to whoever waits, as a process group's work does
                future.set_exception(error)
                return
            future.set_result(tensors if done is None else (tensors, done))

        self._submit(job)
        return _HierarchicalWork(future)

    def _submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            self._jobs.append(job)
            if self._draining:
                return
            self._draining = True
        # One thread takes the jobs in order while there are any, then ends: none outlives the
        # step's communication (a thread left waiting would meet the process group's teardown).
        threading.Thread(target=self._drain, name="lit_dp_hierarchical_allreduce", daemon=True).start()

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._jobs:
                    self._draining = False
                    return
                job = self._jobs.popleft()
            job()

    def _reduce(self, tensor: torch.Tensor, sum_across: Callable[[torch.Tensor, int, Any], int]) -> None:
        """Reduce-scatter in the group, the sum of this rank's shard across groups, all-gather in the group."""
        ranks, me = self.within.size(), self.within.rank()
        flat = tensor.view(-1)
        numel = flat.numel()
        shard_numel = -(-numel // ranks)
        padded = flat
        if shard_numel * ranks != numel:
            padded = flat.new_zeros(shard_numel * ranks)
            padded[:numel].copy_(flat)
        shards = list(padded.view(ranks, shard_numel).unbind(0))
        if self._nccl:
            own = torch.empty_like(shards[me])
            dist.reduce_scatter_tensor(own, padded, group=self.within)
        else:
            for owner, shard in enumerate(shards):
                dist.reduce(shard, group=self.within, group_dst=owner)
            own = shards[me].clone()  # Gloo's all-gather must not read from what it writes
        sent = sum_across(own, me * shard_numel, self.across)
        self.traffic.add(numel * flat.element_size(), sent)
        if self._nccl:
            dist.all_gather_into_tensor(padded, own, group=self.within)
        else:
            dist.all_gather(shards, own, group=self.within)
        if padded is not flat:
            flat.copy_(padded[:numel])


class _HierarchicalWork(dist.Work):
    """One all-reduce of a ``HierarchicalGroup``: done when its three steps are; raises what failed in them."""

    def __init__(self, future: torch.futures.Future) -> None:
        super().__init__()
        self._future = future
        self._result: torch.futures.Future | None = None

    def wait(self, timeout: timedelta | None = None) -> bool:
        value = self._future.wait()
        if isinstance(value, tuple):  # CUDA: the caller's stream waits for the worker's last collective
            torch.cuda.current_stream().wait_event(value[1])
        return True

    def get_future(self) -> torch.futures.Future:
        if self._result is None:
            self._result = self._future.then(lambda done: _tensors(done.value()))
        return self._result


def _tensors(value: Any) -> list[torch.Tensor]:
    return value[0] if isinstance(value, tuple) else value
