"""A replica group's torchft ``Manager`` for the strategies: its steps, its state, its data, what users see.

``FaultTolerance`` is the engine of ``fault_tolerance="torchft"`` that both front doors drive
(their features are in ``lit_dp.strategies.fault_tolerance``): ``start`` builds the Manager
(torchft is imported there, only when the option is on) and the commit protocol around it
(``lit_dp.fault_tolerance.commit``), which owns every quorum and vote. While gradients cross
groups each step is a transaction of it (a quorum before the step's data, the vote before the
optimizer steps); in LocalSGD's local phase only its syncs are, and the steps between them deal
the data of the last quorum with no quorum of their own. A recovering replica loads a peer's
state between steps; users see one line per change of the groups training and per failed step
or sync, each naming its group, and a last line counting them, while torchft's own log lines go
to a file of the run (``TorchftLog``). The settings come from the options
(``lit_dp.options.fault_tolerance``) or from torchft's launch variables: ``ft_lighthouse`` (a
config's ``strategy.ft.lighthouse``) or ``TORCHFT_LIGHTHOUSE``, ``ft_replica_group`` or
``REPLICA_GROUP_ID``.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import socket
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lit_dp.fault_tolerance.commit import LINE, CrossGroupCommit, Transaction
from lit_dp.fault_tolerance.hierarchical import CrossGroupTraffic
from lit_dp.fault_tolerance.replica_data import ReplicaBatches
from lit_dp.fault_tolerance.replica_group import replica_process_group
from lit_dp.fault_tolerance.serving import ServedState
from lit_dp.gradients.buckets import MB
from lit_dp.options import Options

log = logging.getLogger(__name__)

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
REPLICA_GROUP_ENV = "REPLICA_GROUP_ID"
STATE_KEY = "lit_dp"  # this replica's state, as registered with the Manager
# torchft's Python loggers (the Manager's, its process groups', its checkpoint transport's, and
# the three it reports quorums, commits and errors to), sent to the run's torchft log.
TORCHFT_LOGGERS = ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors")


def require_torchft() -> None:
    """An ``ImportError`` saying how to install torchft when it is missing. The strategies call it as
    they are built, so a launcher's ranks never start only to fail at the import, each with a bare
    ``ModuleNotFoundError``; it finds the package without importing it (that waits for ``start``)."""
    if importlib.util.find_spec("torchft") is None:
        raise ImportError(
            "fault_tolerance='torchft' needs torchft, which is not installed here: pip install \"lit_dp[ft]\" "
            "(docs/fault_tolerance.md)."
        )


@dataclass(frozen=True)
class Settings:
    """What a replica group needs to join the others, resolved from the options and torchft's variables."""

    lighthouse: str
    replica_group: str
    min_replicas: int
    timeout: float
    quorum_timeout: float

    @classmethod
    def resolve(cls, options: Options, environ: os._Environ | dict[str, str] = os.environ) -> Settings:
        ft = options.ft
        lighthouse = ft.lighthouse or environ.get(LIGHTHOUSE_ENV)
        if not lighthouse:
            raise ValueError(
                f"fault_tolerance='torchft' needs the lighthouse's address: expected ft_lighthouse='http://HOST:29510' "
                f"(strategy.ft.lighthouse in a config) or {LIGHTHOUSE_ENV} in the environment (start one with: "
                "torchft_lighthouse --min_replicas 1)."
            )
        replica_group = ft.replica_group or environ.get(REPLICA_GROUP_ENV)
        if not replica_group:
            raise ValueError(
                f"fault_tolerance='torchft' needs this replica group's id: expected ft_replica_group (e.g. 0, distinct "
                f"per replica group and kept across its restarts; strategy.ft.replica_group in a config) or "
                f"{REPLICA_GROUP_ENV} in the environment."
            )
        if not replica_group.isdigit():  # the option's value was checked with the options; this is the variable's
            raise ValueError(
                f"{REPLICA_GROUP_ENV}={replica_group!r} is invalid: expected a number, e.g. 0 (torchft numbers the "
                "replica groups by it: distinct per group, kept across the group's restarts)."
            )
        return cls(lighthouse, replica_group, ft.min_replicas, ft.timeout, ft.quorum_timeout)


def group_store(group_size: int) -> tuple[dist.TCPStore | None, str, int]:
    """A store for the ranks of one replica group, where torchft's Manager finds its server:
    ``(store, host, port)``. Rank 0 of the group hosts it (a new one per start of the group, so
    nothing of a restarted group's last attempt is read back); with more than one rank the
    address travels on the group's default process group (``torch.distributed``'s, which its
    launcher's job set up)."""
    host = socket.gethostname()
    hosting = group_size == 1 or dist.get_rank() == 0
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False) if hosting else None
    address = [(host, store.port) if store is not None else None]
    if group_size > 1:
        dist.broadcast_object_list(address, src=0)
    host, port = address[0]
    return store, host, port


class FaultTolerance:
    """One rank's torchft Manager (its replica group's ranks share one server), its commit protocol
    (``protocol``), its steps, its state and its data.

    The strategies call ``start`` before wrapping the model (whose process groups take ``protocol``),
    ``track`` once what must travel to a recovering replica exists, then per step ``start_step``
    and ``commit``; the Trainer calls ``reconcile`` after the last step. Users see one line per
    change of the groups training (``replica group 0 left at step 31; 2 train (1, 2)``), one per
    failed step or sync, each naming the group that prints it, and torchft's own log lines go to a
    file of the run (``torchft-group<N>.log``), which the first line names.
    """

    def __init__(self, options: Options) -> None:
        require_torchft()
        self.settings = Settings.resolve(options)
        self.manager: Any = None
        self.protocol: CrossGroupCommit | None = None  # from start
        self.group_rank, self.group_size = 0, 1  # this process among its replica group's ranks, from start
        self.traffic: CrossGroupTraffic | None = None  # what the model's gradients sent across groups (watch)
        self.steps_started = 0
        self.batches: ReplicaBatches | None = None
        self._store: dist.TCPStore | None = None
        self.last_committed: bool | None = None
        self._peers_step = False  # this step ends the peers' (see start_step): it is not applied
        self._torchft_log: TorchftLog | None = None

    def start(
        self, device: torch.device, group_rank: int = 0, group_size: int = 1, log_dir: str | os.PathLike | None = None
    ) -> CrossGroupCommit:
        """This rank's Manager and its commit protocol; returns the protocol, what the model's process
        groups take. The replica group is this launcher's job, ``group_size`` ranks (its default process
        group when more than one), this one ``group_rank``; they share a store of the group's
        (``group_store``). torchft's log lines go to ``log_dir`` (the current folder by default)."""
        from torchft import Manager  # the optional engine: only with the option on
        from torchft.checkpointing import HTTPTransport

        settings = self.settings
        self.group_rank, self.group_size = group_rank, group_size
        rank_suffix = f"-rank{group_rank}" if group_rank else ""
        log_path = Path(log_dir or os.getcwd()) / f"torchft-group{settings.replica_group}{rank_suffix}.log"
        self._torchft_log = TorchftLog.open(log_path)
        timeout = timedelta(seconds=settings.timeout)
        transport = HTTPTransport(timeout=timeout, num_chunks=0)  # what the Manager makes by default
        self._torchft_log.take_requests(transport)
        served = ServedState(transport, settings.timeout)
        self._store, host, port = group_store(group_size)
        self.manager = Manager(
            pg=replica_process_group(device, timeout, lambda members: self.protocol.record_quorum(members)),
            load_state_dict=None,
            state_dict=None,
            min_replica_size=settings.min_replicas,
            use_async_quorum=False,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=settings.quorum_timeout),
            rank=group_rank,
            world_size=group_size,
            store_addr=host,
            store_port=port,
            lighthouse_addr=settings.lighthouse,
            replica_id=settings.replica_group,
            hostname=socket.gethostname(),
            checkpoint_transport=transport,
        )
        within = dist.group.WORLD if group_size > 1 else None
        self.protocol = CrossGroupCommit(self.manager, within, lighthouse=settings.lighthouse, served=served)
        keep_out = getattr(self.manager._pg, "keep_out", None)  # a replica_process_group on Gloo's
        if keep_out is not None:
            keep_out(settings.lighthouse, self.manager._store.get("manager_addr").decode(), transport.address())
        ranks = f" of {group_size} ranks" if group_size > 1 else ""
        self.protocol.say(
            f"replica group {settings.replica_group}{ranks}, lighthouse {settings.lighthouse}; torchft's own log: "
            f"{self._torchft_log.path}"
        )
        return self.protocol

    def watch(self, traffic: CrossGroupTraffic) -> None:
        """The cross-group traffic of the model's process group, for ``metrics`` and the run's last line."""
        self.traffic = traffic

    def track(self, save: Callable[[], dict[str, Any]], load: Callable[[dict[str, Any]], None]) -> None:
        """What a recovering replica receives (``save``) and how it takes it in (``load``); also what the
        ranks of a group that healed re-align to (its rank 0's)."""
        self.manager.register_state_dict_fn(STATE_KEY, load, save)
        self.protocol.realign_with(save, load)

    @property
    def steps_discarded(self) -> int:
        """Steps this group's vote discarded (a collective across groups failed on one of its ranks)."""
        return self.protocol.steps_discarded if self.protocol is not None else 0

    @property
    def syncs_failed(self) -> int:
        """LocalSGD syncs across groups this group's vote failed."""
        return self.protocol.syncs_failed if self.protocol is not None else 0

    @property
    def membership_changes(self) -> int:
        """Changes of the groups training seen so far (a group that left, one that joined)."""
        return self.protocol.membership_changes if self.protocol is not None else 0

    @property
    def recovery_seconds(self) -> float | None:
        """This group's last recovery, from its quorum's start to the state loaded; None before any."""
        return self.protocol.recovery_seconds if self.protocol is not None else None

    @property
    def committed_steps(self) -> int:
        """Transactions committed by the replica groups (torchft's count, the same on every participant):
        the steps while gradients cross groups, then LocalSGD's syncs."""
        return self.manager.current_step()

    def start_step(self) -> None:
        """The step's quorum when the step crosses groups (and at this process's first step, which finds
        the others and takes their state), then this replica's data for the step."""
        self.last_committed = None
        self._peers_step = False
        self.steps_started += 1
        protocol = self.protocol
        if protocol.every_step or self.steps_started == 1:
            protocol.start(Transaction())
            # Its quorum led this group into a LocalSGD sync its peers started inside their optimizer step
            # (a restarted group meets them there) and took their state from it: this step is the end of
            # theirs, and nothing of it is applied here, so that the loop counters, the data and LocalSGD's
            # schedule go on with the peers' from the next step.
            self._peers_step = protocol.open is None
        if self.batches is not None:
            rank, ranks = self.data_rank()
            if protocol.open is not None or self._peers_step:  # its samples are taken once a step commits
                self.batches.start_step(self.committed_steps, rank, ranks)
            else:  # a step of LocalSGD's local phase, which nothing discards: dealt by the last quorum
                self.batches.start_local_step(self.committed_steps, rank, ranks)

    def data_rank(self) -> tuple[int | None, int]:
        """This rank's place among every rank of the quorum's replica groups, and their number: what the
        step's data is dealt by (``ReplicaBatches.start_step``). None while not participating."""
        manager = self.manager
        replica_rank = manager.participating_rank()
        rank = None if replica_rank is None else replica_rank * self.group_size + self.group_rank
        return rank, manager.num_participants() * self.group_size

    def commit(self) -> bool:
        """The step's vote, when it crosses groups: True when this replica group may apply it. A group
        that discards a step its peers committed (a failure seen on its side only) takes the state of
        one that committed it at the next quorum (``lit_dp.fault_tolerance.commit``). A step of
        LocalSGD's local phase takes no vote: it is this group's own; one that ended in the peers' sync
        is not applied."""
        if self._peers_step:
            committed = False
        else:
            committed = self.protocol.vote() if self.protocol.open is not None else True
        self.last_committed = committed
        return committed

    @property
    def in_peers_step(self) -> bool:
        """Whether the step in progress ends the peers' (a restarted group met them at their sync from its
        start, see ``start_step``): nothing of it is applied here, and it was theirs to count."""
        return self._peers_step

    def reconcile(self) -> None:
        """After the last step: one more quorum, in which a group that discarded a step (or failed a sync)
        its peers applied takes the state of one that did, so that every group ends with the same state."""
        self.protocol.reconcile()

    def metrics(self) -> dict[str, float]:
        """The ``ft/*`` figures: replica groups in the last quorum, steps discarded, syncs failed, the
        changes of the groups, last recovery time."""
        metrics = {
            "ft/replicas": float(self.manager.num_participants()),
            "ft/steps_discarded": float(self.steps_discarded),
            "ft/syncs_failed": float(self.syncs_failed),
            "ft/membership_changes": float(self.membership_changes),
        }
        if self.recovery_seconds is not None:
            metrics["ft/recovery_s"] = self.recovery_seconds
        if self.traffic is not None and self.steps_started:
            metrics["ft/across_mb_per_step"] = self.traffic.across_bytes / self.steps_started / MB
        return metrics

    def describe_traffic(self) -> str | None:
        """What one rank sent across replica groups per step, against the bytes it reduced."""
        traffic, steps = self.traffic, self.steps_started
        if traffic is None or not steps or not traffic.reduced_bytes:
            return None
        share = traffic.across_bytes / traffic.reduced_bytes
        groups = f"replica groups of {self.group_size} rank{'s' * (self.group_size != 1)}"
        return (
            f"each rank sent {traffic.across_bytes / steps / MB:.3f} MB per step across replica groups, {share:.2f} of "
            f"the {traffic.reduced_bytes / steps / MB:.3f} MB it reduced ({groups})"
        )

    def describe_faults(self) -> str:
        """The run's failed transactions, counted: what the last line says."""
        steps, syncs, changes = self.steps_discarded, self.syncs_failed, self.membership_changes
        return (
            f"{steps} step{'s' * (steps != 1)} discarded, {syncs} failed sync{'s' * (syncs != 1)}, "
            f"{changes} change{'s' * (changes != 1)} of the groups training"
        )

    def close(self) -> None:
        if self.protocol is not None:
            traffic = self.describe_traffic()
            if traffic is not None:
                self.protocol.say(traffic)
            if self.steps_started:
                self.protocol.say(self.describe_faults())
        self.traffic, self.steps_started = None, 0
        if self.manager is not None:
            if self.protocol is not None and self.protocol.served is not None:
                self.protocol.served.wait_for_readers()  # a group healing in the last quorum reads it from here
            self.manager.shutdown(wait=False)  # its heartbeats stop: the lighthouse knows this group left
            self.manager = None
        self.protocol = None
        if self._torchft_log is not None:
            self._torchft_log.close()
            self._torchft_log = None
        self._store = None
        self.batches = None  # a next fit deals its own loader


class TorchftLog:
    """torchft's own log lines in a file of the run, not on the console: its Python loggers' (a
    failed all-reduce's ERROR with two tracebacks, every quorum and commit at INFO) and its
    checkpoint server's request lines. The console has lit_dp's one line per change instead."""

    def __init__(self, path: Path, handler: logging.Handler, saved: dict[str, tuple[bool, int]]) -> None:
        self.path = path
        self._handler = handler
        self._saved = saved  # each logger's propagate flag and level, restored by close

    @classmethod
    def open(cls, path: Path) -> TorchftLog:
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(path)
        handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
        saved = {}
        for name in TORCHFT_LOGGERS:
            logger = logging.getLogger(name)
            saved[name] = (logger.propagate, logger.level)
            logger.addHandler(handler)
            logger.propagate = False
            logger.setLevel(logging.INFO)
        # torchft's checkpoint transport reads a recovering group's state from a read-only buffer,
        # which torch warns of on every recovery; nothing writes to it.
        warnings.filterwarnings(
            "ignore", message="The given buffer is not writable", category=UserWarning, module="torch.distributed"
        )
        log.debug("%s: torchft's log lines go to %s", LINE, path)
        return cls(path, handler, saved)

    def take_requests(self, transport: Any) -> None:
        """The request lines of ``transport``'s checkpoint server (an ``http.server`` handler writes
        them to stderr), into this log. The handler class is the transport's own."""
        requests = logging.getLogger("torchft.checkpointing.http_transport")

        def log_message(handler: Any, format: str, *args: Any) -> None:
            requests.info("%s - %s", handler.address_string(), format % args)

        transport._server.RequestHandlerClass.log_message = log_message

    def close(self) -> None:
        for name, (propagate, level) in self._saved.items():
            logger = logging.getLogger(name)
            logger.removeHandler(self._handler)
            logger.propagate = propagate
            logger.setLevel(level)
        self._handler.close()
