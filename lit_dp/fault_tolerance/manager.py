"""A replica group's torchft ``Manager``: its quorum and commit per step, its state, what users see.

``FaultTolerance`` is the engine of ``fault_tolerance="torchft"`` that both front doors drive
(their features are in ``lit_dp.strategies.fault_tolerance``): ``start`` builds the Manager
(torchft is imported there, only when the option is on), each step begins with a quorum and
ends with ``Manager.should_commit``, a recovering replica loads a peer's state between steps,
and users see one line per change of the groups training while torchft's own log lines go to a
file of the run (``TorchftLog``). A group that finds no quorum ends, saying why
(``QuorumUnreachable``). The settings come from the options (``lit_dp.options.fault_tolerance``)
or from torchft's launch variables: ``ft_lighthouse`` (a config's ``strategy.ft.lighthouse``)
or ``TORCHFT_LIGHTHOUSE``, ``ft_replica_group`` or ``REPLICA_GROUP_ID``.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import socket
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from lit_dp.fault_tolerance.hierarchical import CrossGroupTraffic
from lit_dp.fault_tolerance.lighthouse import LighthouseStatus
from lit_dp.fault_tolerance.replica_data import ReplicaBatches
from lit_dp.fault_tolerance.replica_group import replica_process_group
from lit_dp.gradients.buckets import MB
from lit_dp.job.restart import JobAttempt
from lit_dp.options import Options

log = logging.getLogger(__name__)

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
REPLICA_GROUP_ENV = "REPLICA_GROUP_ID"
STATE_KEY = "lit_dp"  # this replica's state, as registered with the Manager
LINE = "[lit_dp] fault tolerance"
# Waits of ft.quorum_timeout for a quorum while other groups are alive, before a group gives up.
QUORUM_ATTEMPTS = 3
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


class QuorumUnreachable(SystemExit):
    """A replica group found no quorum to join: it ends, saying why (``reason``).

    Exit status 0 when the job went on past this group's step and no other group is heard from
    any more (it ended without this group): its launcher does not start it again. 1 otherwise
    (others alive, or only down), after ``QUORUM_ATTEMPTS`` tries: its launcher's restarts
    (torchrun's ``--max-restarts``) bound how often it tries again.
    """

    def __init__(self, reason: str, job_ended: bool) -> None:
        super().__init__(0 if job_ended else 1)
        self.reason = reason
        self.job_ended = job_ended

    def __str__(self) -> str:
        return self.reason


class FaultTolerance:
    """One rank's torchft Manager (its replica group's ranks share one server), its steps, its state
    and what users see of it (said by the group's rank 0).

    The strategies call ``start`` before wrapping the model, ``track`` once what must travel to a
    recovering replica exists, then per step ``start_step`` (quorum) and ``commit``; the Trainer
    calls ``reconcile`` after the last step. Users see one line per change of the groups
    training (``replica group 0 left at step 31; 2 train (1, 2)``), and torchft's own log lines
    go to a file of the run (``torchft-group<N>.log``), which the first line names.
    """

    def __init__(self, options: Options) -> None:
        require_torchft()
        self.settings = Settings.resolve(options)
        self.manager: Any = None
        self.group_rank, self.group_size = 0, 1  # this process among its replica group's ranks, from start
        self.traffic: CrossGroupTraffic | None = None  # what the model's gradients sent across groups (watch)
        self.steps_started = 0
        self._tracked: tuple[Callable[[], dict[str, Any]], Callable[[dict[str, Any]], None]] | None = None  # track's
        self.batches: ReplicaBatches | None = None
        self._store: dist.TCPStore | None = None
        self._members: tuple[int, ...] = ()  # the replica groups of the last quorum
        self._quorum: tuple[int, ...] | None = None  # set by the process group at each reconfiguration
        self.steps_discarded = 0
        self.membership_changes = 0
        self.recovery_seconds: float | None = None  # this replica's last recovery, from its quorum's start
        self.last_committed: bool | None = None
        self._recovered = False  # set by the state's load, in start_quorum
        self._just_recovered = False  # to be said with the quorum's line
        self._discarded: tuple[int, str] | None = None  # the step discarded last and why, until it is said
        self._torchft_log: TorchftLog | None = None

    def start(
        self, device: torch.device, group_rank: int = 0, group_size: int = 1, log_dir: str | os.PathLike | None = None
    ) -> Any:
        """This rank's Manager; returns it. The replica group is this launcher's job, ``group_size``
        ranks (its default process group when more than one), this one ``group_rank``; they share
        a store of the group's (``group_store``). torchft's log lines go to ``log_dir`` (the current
        folder by default)."""
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
        self._store, host, port = group_store(group_size)
        self.manager = Manager(
            pg=replica_process_group(device, timeout, self._record_quorum),
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
        keep_out = getattr(self.manager._pg, "keep_out", None)  # a replica_process_group on Gloo's
        if keep_out is not None:
            keep_out(settings.lighthouse, self.manager._store.get("manager_addr").decode(), transport.address())
        ranks = f" of {group_size} ranks" if group_size > 1 else ""
        self._say(
            f"replica group {settings.replica_group}{ranks}, lighthouse {settings.lighthouse}; torchft's own log: "
            f"{self._torchft_log.path}"
        )
        return self.manager

    def watch(self, traffic: CrossGroupTraffic) -> None:
        """The cross-group traffic of the model's process group, for ``metrics`` and the run's last line."""
        self.traffic = traffic

    def track(self, save: Callable[[], dict[str, Any]], load: Callable[[dict[str, Any]], None]) -> None:
        """What a recovering replica receives (``save``) and how it takes it in (``load``)."""

        def load_and_time(state: dict[str, Any]) -> None:
            load(state)
            self._recovered = True

        self.manager.register_state_dict_fn(STATE_KEY, load_and_time, save)
        self._tracked = (save, load)

    @property
    def committed_steps(self) -> int:
        """Steps committed by the replica groups (torchft's count, the same on every participant)."""
        return self.manager.current_step()

    def start_step(self) -> None:
        """The step's quorum: membership, recovery if behind, then this replica's data for the step."""
        self.last_committed = None
        self.steps_started += 1
        self._join_quorum()
        self._start_as_one_group()
        self._announce()
        if self.batches is not None:
            manager = self.manager
            self.batches.start_step(manager.current_step(), *self.data_rank())

    def _start_as_one_group(self) -> None:
        """At step 0, every rank of this replica group takes its rank 0's state.

        torchft's ``init_sync`` gives rank ``r`` of each group the state of rank ``r`` of the quorum's
        replica ``r % P`` (it spreads recoveries over the replicas), so the ranks of a group built
        unequal (models from different seeds, and what is derived from them, such as LocalSGD's
        snapshot) would start from different replicas. Rank 0 of every group holds the first
        replica's: broadcast inside the group, every rank of every group starts from it. Once per
        quorum at step 0 (a step 0 discarded and tried again is healed again), on the group's own
        process group (its launcher's job's default group).
        """
        if self.group_size == 1 or self._tracked is None or self.manager.current_step() != 0:
            return
        save, load = self._tracked
        state = [save() if self.group_rank == 0 else None]
        dist.broadcast_object_list(state, src=0)
        if self.group_rank != 0:
            load(state[0])
        log.debug("%s: the replica group starts from its rank 0's state", LINE)

    def data_rank(self) -> tuple[int | None, int]:
        """This rank's place among every rank of the quorum's replica groups, and their number: what the
        step's data is dealt by (``ReplicaBatches.start_step``). None while not participating."""
        manager = self.manager
        replica_rank = manager.participating_rank()
        rank = None if replica_rank is None else replica_rank * self.group_size + self.group_rank
        return rank, manager.num_participants() * self.group_size

    def commit(self) -> bool:
        """torchft's vote: True when this replica group may apply the step. Groups that disagree (a
        peer failed after one's all-reduces completed) are reconciled at the next quorum: the one
        behind recovers from the one ahead."""
        committed = self.manager.should_commit()
        self.last_committed = committed
        if not committed:
            self.steps_discarded += 1
            error = self.manager.errored()
            why = (
                f"its communication failed: {str(error.original_exception).splitlines()[0][:200]}"
                if error is not None
                else f"fewer than ft_min_replicas={self.settings.min_replicas} replica groups took part"
            )
            log.debug("%s, step %d: step discarded (%s)", LINE, self.committed_steps, why)
            # Said with the next quorum, in one line with the change of groups that explains it.
            self._discarded = (self.committed_steps, why)
        return committed

    def reconcile(self) -> None:
        """After the last step: one more quorum, in which a group that discarded a step its peers
        committed (a peer failed after this group's all-reduces completed, or the other way
        round) recovers from the one ahead, so that every group ends with the same state. One
        try: groups that are gone by then are not waited for past ``ft.quorum_timeout``."""
        started = time.monotonic()
        try:
            self.manager.start_quorum()
        except TimeoutError:
            self._say(f"no quorum within {time.monotonic() - started:.0f} s after the last step: the groups were not reconciled")
            return
        self._took_quorum(started)
        self._announce()

    def metrics(self) -> dict[str, float]:
        """The ``ft/*`` figures: replica groups in the last quorum, steps discarded, last recovery time."""
        metrics = {
            "ft/replicas": float(len(self._members)),
            "ft/steps_discarded": float(self.steps_discarded),
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

    def close(self) -> None:
        traffic = self.describe_traffic()
        if traffic is not None:
            self._say(traffic)
        self.traffic, self.steps_started, self._tracked = None, 0, None
        if self._discarded is not None:  # the last step was discarded: no quorum followed to say it with
            self._say(f"step {self._discarded[0]} discarded ({self._discarded[1]})")
            self._discarded = None
        if self.manager is not None:
            self.manager.shutdown(wait=False)  # its heartbeats stop: the lighthouse knows this group left
            self.manager = None
        if self._torchft_log is not None:
            self._torchft_log.close()
            self._torchft_log = None
        self._store = None
        self.batches = None  # a next fit deals its own loader

    def _join_quorum(self) -> None:
        """``Manager.start_quorum``, tried up to ``QUORUM_ATTEMPTS`` times of ``ft.quorum_timeout``;
        ``QuorumUnreachable`` after the last, or at once when the job has ended without this group."""
        for attempt in range(1, QUORUM_ATTEMPTS + 1):
            started = time.monotonic()
            try:
                self.manager.start_quorum()
            except TimeoutError:
                status = LighthouseStatus.read(self.settings.lighthouse)
                ended = status is not None and status.ended_without(self.settings.replica_group, self.committed_steps)
                reason = self._unreachable(status, ended, time.monotonic() - started, attempt)
                if ended or attempt == QUORUM_ATTEMPTS:
                    self._say(reason)
                    raise QuorumUnreachable(reason, job_ended=ended) from None
                self._say(f"{reason}; trying again")
                # torchft keeps the failed quorum and would raise it again at the next start.
                self.manager._quorum_future = None
                continue
            self._took_quorum(started)
            return

    def _took_quorum(self, started: float) -> None:
        if self._recovered:  # the state was loaded in start_quorum
            self._recovered, self._just_recovered = False, True
            self.recovery_seconds = time.monotonic() - started

    def _unreachable(self, status: LighthouseStatus | None, ended: bool, waited: float, attempt: int) -> str:
        """Which quorum this group could not reach, the ``min_replicas`` it needed, and what the lighthouse says."""
        settings = self.settings
        head = (
            f"replica group {settings.replica_group} (at step {self.committed_steps}) found no quorum of "
            f"ft.min_replicas={settings.min_replicas} replica groups at the lighthouse {settings.lighthouse} in "
            f"{waited:.0f} s (attempt {attempt} of {QUORUM_ATTEMPTS})"
        )
        if status is None:
            return f"{head}; the lighthouse's status page could not be read"
        previous = ", ".join(f"{group} at step {step}" for group, step in status.previous.items())
        last = f"its last quorum: groups {previous}" if previous else "no quorum formed yet"
        if ended:
            silent = status.silent_for(settings.replica_group) or 0.0
            return (
                f"{head}: the job went on without this group and ended ({last}; no other group heard from for "
                f"{silent:.0f} s); exiting"
            )
        alive = status.alive(settings.replica_group)
        heard = f"groups {', '.join(alive)} are alive" if alive else "no other group is alive"
        return f"{head}: {heard}; {last}; the lighthouse says: {status.next_quorum}"

    def _record_quorum(self, members: list[int]) -> None:
        # Called by the process group in torchft's quorum thread; read after start_quorum returns.
        # torchft numbers this rank's peers replica_group * group_size + group_rank.
        self._quorum = tuple(sorted({member // self.group_size for member in members}))

    def _announce(self) -> None:
        """One line when the groups training change (what explains a discarded step), when this
        group recovered, or when a step was discarded with no change to explain it."""
        members = self._quorum if self._quorum is not None else self._members
        step, me = self.committed_steps, self.settings.replica_group
        left = sorted(set(self._members) - set(members))
        joined = sorted(set(members) - set(self._members))
        parts = []
        # At step 0 every group but the first takes the first one's state (torchft's init_sync): no news.
        if self._just_recovered and step > 0:
            recovered = f"replica group {me} recovered a peer's state in {self.recovery_seconds:.2f} s"
            if not self._members:  # this process's first quorum, in a job under way
                verb = "rejoined" if JobAttempt.from_environ().is_restart else "joined"
                recovered, joined = f"{recovered} and {verb}", []
            parts.append(recovered)
        self._just_recovered = False
        for ids, verb in ((left, "left"), (joined, "joined")):
            if ids:
                parts.append(f"replica group{'s' * (len(ids) > 1)} {_ids(ids)} {verb}")
        training = f"{len(members)} train ({_ids(members)})"
        if parts:
            if self._members and (left or joined):
                self.membership_changes += 1
            self._say(f"{'; '.join(parts)} at step {step}; {training}")
            self._discarded = None
        elif self._discarded is not None:
            self._say(f"step {self._discarded[0]} discarded ({self._discarded[1]}); {training}")
            self._discarded = None
        self._members = members

    def _say(self, text: str) -> None:
        if self.group_rank != 0:  # one voice per replica group: its ranks see the same quorums
            log.debug("%s: %s", LINE, text)
            return
        # A progress bar on the console (Lightning's is tqdm's) is cleared for the line and drawn again after.
        with tqdm.external_write_mode(file=sys.stdout):
            print(f"{LINE}: {text}", flush=True)


def _ids(ids: tuple[int, ...] | list[int]) -> str:
    return ", ".join(str(i) for i in ids)


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
