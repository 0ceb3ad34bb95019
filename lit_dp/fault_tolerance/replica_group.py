"""``DataParallel`` under a torchft ``Manager``: lit_dp's reducer over the replica groups present.

torchft (``pip install "lit_dp[ft]"``) keeps a job training while replica groups fail and come
back. Each step starts with a quorum at torchft's lighthouse, which reconfigures the process
group across the replica groups present; a collective that fails marks the step as errored, and
``Manager.should_commit`` then discards it (the optimizer must not step); a restarted replica
receives a healthy peer's state through torchft's checkpoint transport and joins at the next
quorum (docs/fault_tolerance.md). The quorum, the collectives' errors and the vote are the
commit protocol's (``lit_dp.fault_tolerance.commit``); with
``lit_dp.DataParallel(module, manager=manager)``:

- the reducer's buckets are all-reduced on a ``FaultTolerantGroup``: torchft's process group
  behind the protocol (the steps of ``Manager.allreduce``);
- gradients are divided by the replica groups taking part in the step
  (``Manager.num_participants``, the group's ``size()``), read by each synchronised forward's plan;
- a failed all-reduce leaves its bucket zeroed, gradients and flags alike, so the reducer's
  checks stay quiet on a step that is discarded anyway, and nothing of it is applied;
- the buckets never follow the first step's gradient-ready order: a replica that joins later
  could not learn it, so every replica, at every attempt, cuts its buckets from the model's
  registration order and the options alone;
- nothing is broadcast at construction (torch DDP's ``init_sync=False``): a replica that
  recovers joins a quorum long after the others were built. The Manager's own ``init_sync``
  gives every replica the first one's state at step 0.

What cannot work across replica groups that come and go is refused by name: the options by
``lit_dp.options.fault_tolerance`` (where every option is checked), a hook registered by hand by
``check_comm_hook``, a given process group or sparse gradients by ``replica_group``.

No replica group may depend on another for more than the step they share: the group that
leads a quorum hosts the store its members rendezvous on (torchft's quorum names the first
group at the highest step, nearly always group 0), and a group that gave up on a step must not
leave a peer waiting on it. ``replica_process_group`` is torchft's reconfigurable process group
with what that takes (see it), and a collective across groups is waited for in slices,
watching its connections (``lit_dp.fault_tolerance.commit``).
"""

from __future__ import annotations

import functools
import logging
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from lit_dp.fault_tolerance.commit import CrossGroupCommit
from lit_dp.fault_tolerance.gloo_connections import GlooConnections
from lit_dp.fault_tolerance.hierarchical import CrossGroupTraffic, HierarchicalGroup
from lit_dp.options.fault_tolerance import TORCHFT, UNDER_MANAGER

log = logging.getLogger(__name__)

# A quorum's rendezvous: its members get the quorum from the lighthouse at the same moment and
# meet at once, so one that has not come within this is gone (it died after asking for the
# quorum). Without a bound the others would wait the process group's whole timeout (60 s).
RENDEZVOUS_SECONDS = 2.0
# The bound needs the collectives' timeout set back after the rendezvous: Gloo's `set_timeout`,
# from torch 2.9. On torch 2.8 the rendezvous waits the group's whole timeout, as torchft's does.
RENDEZVOUS_BOUNDED = hasattr(getattr(dist, "ProcessGroupGloo", None), "set_timeout")
# How long to try to reach the store of the group that leads the quorum: a live store answers
# in milliseconds, a dead one's port refuses at once, a lost host's never answers. torch's
# TCPStore client would retry for the whole timeout instead.
STORE_PROBE_SECONDS = 2.0

# torch's stateless hooks: each communicates on the process group it gets as its state.
_GROUP_HOOKS_MODULE = default_hooks.__name__


class FaultTolerantGroup(dist.ProcessGroup):
    """The replica groups of the current quorum as one process group, for lit_dp's reducer and LocalSGD.

    It carries bytes only: each collective goes through the group's commit protocol
    (``lit_dp.fault_tolerance.commit.CrossGroupCommit``: torchft's process group behind the
    Manager's error handling, one collective in flight at a time, a failure reported, never
    raised). ``size()`` is the number of replica groups taking part in the quorum, what gradients
    are divided by (at least 1: before the first quorum torchft says 0). Being written in Python,
    the group never gets the reducer's one-rank shortcut (``lit_dp.gradients.group.trivially_alone``):
    the replicas present change from quorum to quorum.
    """

    def __init__(self, commit: CrossGroupCommit) -> None:
        super().__init__(0, 1)
        self.commit = commit
        self.traffic = CrossGroupTraffic()

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return TORCHFT

    def size(self) -> int:
        return max(1, self.commit.manager.num_participants())

    def rank(self) -> int:
        rank = self.commit.manager.participating_rank()
        return -1 if rank is None else rank

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        for tensor in tensors:  # one process per replica group: all it reduces crosses groups
            nbytes = tensor.numel() * tensor.element_size()
            self.traffic.add(nbytes, nbytes)
        return self.commit.allreduce(tensors, opts)

    # A LocalSGD sync in a wire format (lit_dp.local_sgd.transport) asks these two, as torchft's own quantized
    # all-reduce asks its process group. Each is one collective of the transaction, as an all-reduce is: a
    # failure fails its vote, and a group that does not take part sends zeros (which every format decodes to
    # zeros). The traffic counts the encoded payload once, at the all-to-all, as the all-reduce counts its
    # tensor: the all-gather carries the same bytes back, as a ring all-reduce's second half does.

    def alltoall_base(
        self, output: torch.Tensor, tensor: torch.Tensor, output_splits: list[int], input_splits: list[int], opts: Any
    ) -> dist.Work:
        nbytes = tensor.numel() * tensor.element_size()
        self.traffic.add(nbytes, nbytes)
        return self.commit.collective(
            [tensor, output], lambda group: group.alltoall_base(output, tensor, output_splits, input_splits, opts)
        )

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        return self.commit.collective(
            [*tensors, *outputs], lambda group: group.allgather_into_tensor_coalesced(outputs, tensors, opts)
        )


def replica_process_group(
    device: torch.device | str = "cpu",
    timeout: timedelta = timedelta(seconds=60),
    on_quorum: Callable[[list[int]], None] | None = None,
) -> Any:
    """torchft's reconfigurable process group across replica groups, for a ``Manager(pg=...)``.

    ``ProcessGroupGloo`` for a CPU ``device``, ``ProcessGroupBabyNCCL`` (an NCCL communicator
    in a subprocess, which its abort kills) for a CUDA one; ``timeout`` bounds a collective.
    ``on_quorum(ranks)`` is told the members of each new quorum (torchft passes them as the
    group's global ranks: ``replica_group * group_size + group_rank``).

    On Gloo, lit_dp adds what makes any replica group's failure cost the others no more than
    any other's, whichever it is (the quorum's leader included):

    - the rendezvous never waits on a dead store: the quorum's store is hosted by the group
      that leads it, and one that no longer answers fails the reconfiguration within
      ``STORE_PROBE_SECONDS`` (the step is discarded; the next quorum goes on without it);
    - the rendezvous waits at most ``RENDEZVOUS_SECONDS`` for a member that asked for the
      quorum and died before meeting the others, then fails the same way (torch 2.9 and later:
      ``RENDEZVOUS_BOUNDED``);
    - ``abort()`` and ``close_connections()`` shut the group's connections down
      (``lit_dp.fault_tolerance.gloo_connections``), so that every peer's pending collective fails at once, and
      ``connections_hung_up()`` lets a waiting all-reduce see that a peer closed its end.
    """
    from torchft.process_group import ProcessGroupBabyNCCL, ProcessGroupGloo

    announce = on_quorum or (lambda groups: None)

    if torch.device(device).type == "cuda":

        class AnnouncedProcessGroupBabyNCCL(ProcessGroupBabyNCCL):  # type: ignore[misc, valid-type]
            def configure(self, store_addr: str, *args: Any, **kwargs: Any) -> None:
                super().configure(store_addr, *args, **kwargs)
                announce(_quorum_groups(args, kwargs))

        return AnnouncedProcessGroupBabyNCCL(timeout=timeout)

    class ReplicaProcessGroupGloo(ProcessGroupGloo):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__(timeout=timeout)
            self._connections = GlooConnections({})
            self._other_ports: set[int] = set()  # see keep_out

        def keep_out(self, *addresses: str) -> None:
            """Servers whose connections are not the group's (``http://host:port``): the lighthouse, the
            replica group's Manager server, this rank's checkpoint server. Another thread of this
            process may open one while the group is built (a rank of the same replica group asking its
            Manager server, a peer fetching a checkpoint); recorded, its close would read as a hang-up."""
            self._other_ports.update(_port(address) for address in addresses)

        def configure(self, store_addr: str, *args: Any, **kwargs: Any) -> None:
            host, port = _store_endpoint(store_addr)
            _probe_store(host, port)
            # The store's own connections outlive the group: only Gloo's pairs are recorded.
            configure = functools.partial(super().configure, store_addr, *args, **kwargs)
            _, self._connections = GlooConnections.record(configure, skip_ports=(port, *self._other_ports))
            announce(_quorum_groups(args, kwargs))

        def _create_pg(self, store: Any, rank: int, world_size: int) -> Any:
            # Gloo's rendezvous waits as long as the group's timeout: bounded apart (see above),
            # then the collectives get the full timeout back.
            if not RENDEZVOUS_BOUNDED:
                return super()._create_pg(store, rank, world_size)
            self._timeout = min(timeout, timedelta(seconds=RENDEZVOUS_SECONDS))
            try:
                group = super()._create_pg(store, rank, world_size)
            finally:
                self._timeout = timeout
            group._get_backend(torch.device("cpu")).set_timeout(timeout)
            return group

        def abort(self, errored: bool = True) -> None:
            self.close_connections()
            super().abort(errored)

        def close_connections(self) -> None:
            """Only the connections: safe on Gloo's own thread, where dropping the group is not."""
            self._connections.shutdown()

        def connections_hung_up(self) -> bool:
            return self._connections.hung_up()

    return ReplicaProcessGroupGloo()


def _quorum_groups(args: tuple, kwargs: dict) -> list[int]:
    """``global_ranks`` of torchft's ``configure(store_addr, replica_id, rank, world_size, quorum_id,
    group_rank, group_world_size, global_ranks)``, after ``store_addr``."""
    groups = kwargs.get("global_ranks", args[6] if len(args) > 6 else None)
    return list(groups or [])


def _port(address: str) -> int:
    """The port of ``http://host:port[/path]`` or ``host:port``."""
    return int(address.split("://", 1)[-1].split("/", 1)[0].rpartition(":")[2])


def _store_endpoint(store_addr: str) -> tuple[str, int]:
    """``host`` and ``port`` of torchft's ``host:port/prefix`` (the host possibly ``[v6]``)."""
    address = store_addr.partition("/")[0]
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _probe_store(host: str, port: int) -> None:
    try:
        socket.create_connection((host, port), timeout=STORE_PROBE_SECONDS).close()
    except OSError as error:
        raise ConnectionError(
            f"the quorum's store at {host}:{port} does not answer ({error}): the replica group that leads the quorum "
            "and hosts it is gone; this step is discarded and the next quorum goes on without it"
        ) from error


JOIN_REFUSED = (
    f"Join (uneven inputs) with {UNDER_MANAGER} is not supported: the replica groups present share out the data at every "
    "step (lit_dp.ReplicaBatches), so none runs out before the others."
)


def replica_group(manager: Any, within: dist.ProcessGroup | None, sparse: bool) -> dist.ProcessGroup:
    """The reducer's group under a torchft ``manager`` (or the commit protocol around one, which the
    strategies pass), once ``sparse`` gradients are refused.

    ``within`` is this replica group's own process group (its launcher's job, e.g. the default
    group of a ``torchrun --nproc-per-node=N``): with more than one rank the gradients go the
    hierarchical way (``lit_dp.fault_tolerance.hierarchical``); with one, or none, every bucket is
    all-reduced across the replica groups directly. A bare Manager gets its commit protocol here.
    """
    if sparse:
        raise ValueError(
            f"{UNDER_MANAGER} with sparse gradients (an embedding built with sparse=True) is not supported: torchft has no "
            "fault-tolerant sparse all-reduce; expected sparse=False."
        )
    if within is not None and not isinstance(within, dist.ProcessGroup):
        raise ValueError(
            f"DataParallel(process_group={within!r}, manager=...) is invalid: under a torchft Manager the process group "
            "is this replica group's own ranks; expected a torch.distributed ProcessGroup, or None for the default group."
        )
    commit = manager if isinstance(manager, CrossGroupCommit) else CrossGroupCommit(manager, within)
    across = FaultTolerantGroup(commit)
    if within is None or within.size() == 1:
        return across
    group_size = getattr(commit.manager, "_group_world_size", within.size())
    if group_size != within.size():
        raise ValueError(
            f"DataParallel(manager=...) over a process group of {within.size()} ranks is invalid: the Manager was built "
            f"with world_size={group_size}, the ranks of its replica group; expected the two to be the same."
        )
    return HierarchicalGroup(within, across)


def refuse_an_asynchronous_quorum(manager: Any, within: dist.ProcessGroup) -> None:
    """A ``ValueError`` for a Manager with torchft's asynchronous quorum over a replica group of many ranks.

    With it a recovering rank loads its peer's state only in ``should_commit``, after the step's
    forward; at step 0 that leaves the ranks of one group holding different replicas' states
    (``DataParallel._start_as_the_first_replica_group`` re-aligns them at the forward, once the
    quorum is in).
    """
    if getattr(manager, "_use_async_quorum", False):
        raise ValueError(
            f"DataParallel(manager=...) with a Manager built with use_async_quorum=True over a replica group of "
            f"{within.size()} ranks is not supported: a recovering rank would load its peer's state after the step's "
            "forward, when the ranks of its group can no longer agree on one start; expected use_async_quorum=False."
        )


def check_comm_hook(
    state: object, hook: Callable, group: FaultTolerantGroup, where: str, declared_stateless: bool = False
) -> object:
    """The state to register ``hook`` with under fault tolerance, or a ``ValueError`` naming it.

    torch's stateless hooks (``allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook``
    and their ``fp16/bf16_compress_wrapper`` forms) communicate on their state, the process
    group: with ``None`` (the named ``fp16``/``bf16`` hooks, ``comm_dtype``) they get
    ``group``, so they reduce across the replica groups and divide by those taking part. So do
    the named hooks that declare themselves stateless (``declared_stateless``, chosen through the
    options). Any other hook could communicate anywhere, and PowerSGD keeps per-replica memory
    (its iteration count, its error feedback) that a recovering replica would not receive: both
    are refused.
    """
    chain = [] if declared_stateless else _hook_chain(hook)
    outside = [inner for inner in chain if getattr(inner, "__module__", None) != _GROUP_HOOKS_MODULE]
    if outside:
        name = f"{getattr(outside[0], '__module__', '?')}.{getattr(outside[0], '__qualname__', type(outside[0]).__qualname__)}"
        raise ValueError(
            f"comm_hook={name} with {where} is not supported: a hook may communicate on any process group and keep "
            "state of its own, which a recovering replica would not receive; expected comm_hook='fp16' or 'bf16', "
            "comm_dtype, or one of torch's default_hooks (allreduce_hook, fp16_compress_hook, bf16_compress_hook)."
        )
    if state is not None and state is not group:
        raise ValueError(
            f"comm_state={state!r} with {where} is invalid: torch's default hooks communicate on their state, which "
            "must be the replica groups' process group; expected comm_state=None."
        )
    return group


def _hook_chain(hook: Callable) -> list[Callable]:
    """``hook`` and, for torch's ``fp16/bf16_compress_wrapper``, the hooks it wraps (its closure's ``hook``)."""
    chain = [hook]
    code = getattr(hook, "__code__", None)
    for name, cell in zip(code.co_freevars if code else (), getattr(hook, "__closure__", None) or ()):
        if name == "hook" and callable(cell.cell_contents):
            chain += _hook_chain(cell.cell_contents)
    return chain
