"""One replica group's commit protocol across replica groups (torchft): quorum, collectives, vote.

Whatever crosses replica groups is one *transaction* of this protocol, in torchft's own shape
(its ``Manager`` under DDP, its DiLoCo): a data-parallel step's gradient buckets with the count of
those taking part, a LocalSGD or DiLoCo sync, a streaming fragment's sync. A transaction:

1. ``start``: torchft's quorum. It says who takes part; it rebuilds torchft's process group when
   the members changed or a vote failed; and a group behind the others (restarted, or one that did
   not apply a transaction its peers applied) takes a peer's state there, before anything else
   (it *heals*). torchft hands the ranks of a healing group their sources in turn (rank ``r`` heals
   from the ``r``-th group up to date, its ``src/manager.rs``), and between LocalSGD's syncs the
   groups hold different models: once any rank of a group healed, its ranks re-align inside the
   group, on its own process group, to its rank 0's state (``realign_with``), so that the group
   holds one peer's state. A group that healed into a transaction its peers had started (a
   restarted group meets them at a sync) takes part in it (``follow_syncs``).
2. the collectives (``allreduce``, any other through ``collective``) on torchft's process group,
   one in flight at a time. A failure never raises: it is reported to the Manager, the tensors are
   zeroed, the group's connections are closed (a peer inside a collective with this group fails at
   once instead of at the timeout), and nothing else crosses groups before the vote.
3. ``vote``: torchft's ``should_commit``, which every rank of the group takes part in: the group
   applies the transaction only if none of its ranks saw a failure. A failed vote is one line
   (``[lit_dp] fault tolerance: [group 1] the sync after step 96 failed: rank 0: RuntimeError: ...``)
   and counts as torchft counts it: the next quorum gets a new id, torchft's process group is
   rebuilt, and the next transaction goes through.

Groups may decide differently (torchft's ``should_commit`` says so): a failure seen on one side
only fails that side's vote while its peers apply. The protocol then *heals from a group that
applied*: the group that did not apply is a transaction behind in torchft's count, and the next
quorum gives it the state of one that did, so by the next quorum every rank of every group holds
the same state again. An agreement step across groups before applying would itself be a
collective that can fail on one side (the two generals' problem): it would move the
disagreement, not remove it, and cost a round trip on the slow link at every transaction.

What a transaction is belongs to the callers: each step while gradients cross groups
(``FaultTolerance`` starts and votes them), LocalSGD's syncs in its local phase, whose inner
steps stay inside each group and take no quorum (``cross_groups_every_step``).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

import lit_dp.gradients.group as groups
from lit_dp.fault_tolerance.lighthouse import LighthouseStatus, group_of
from lit_dp.fault_tolerance.serving import ServedState
from lit_dp.job.restart import JobAttempt

log = logging.getLogger(__name__)

LINE = "[lit_dp] fault tolerance"
PEER_KEY = "lit_dp_transaction"  # the transaction a peer was in, sent with its state to a healing group
# Waits of the quorum timeout for a quorum while other groups are alive, before a group gives up.
QUORUM_ATTEMPTS = 3
# A waiting collective looks at its connections this often, and gives a connection a peer closed
# this long to deliver what it holds (a peer may finish its part of the last step and exit while
# the last bytes it sent are still unread here) before aborting.
WATCH_SECONDS = 0.05
HANG_UP_GRACE_SECONDS = 0.2


@dataclasses.dataclass(frozen=True)
class Transaction:
    """What a quorum is taken for and its vote decides: ``name`` as users read it ("the sync after step
    96"; None: a step, named by torchft's count once its quorum is in, "step 12"); ``sync``, for a
    LocalSGD sync, its fragment."""

    name: str | None = None
    sync: int | None = None


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


class CrossGroupCommit:
    """One rank's part in its replica group's commit protocol, around its torchft ``manager`` (see the
    module docstring). ``within`` is the group's own process group (None for a group of one rank);
    ``lighthouse`` the lighthouse's address, read when no quorum comes (None: not read); ``served``, the
    reads of the state this group serves to the groups healing from it, waited for before its vote.
    The group's rank 0 says what users see, each line naming the group.
    """

    def __init__(
        self,
        manager: Any,
        within: dist.ProcessGroup | None = None,
        *,
        lighthouse: str | None = None,
        served: ServedState | None = None,
    ) -> None:
        self.manager = manager
        self.served = served
        self.within = within if within is not None and within.size() > 1 else None
        self.group_rank = self.within.rank() if self.within is not None else 0
        self.group_size = self.within.size() if self.within is not None else 1
        self.replica_group = group_of(str(manager._replica_id)) if manager._replica_id is not None else "0"
        self.lighthouse = lighthouse
        self.steps_discarded = 0
        self.syncs_failed = 0
        self.membership_changes = 0
        self.recovery_seconds: float | None = None  # this group's last heal, from its quorum's start
        self._every_step = True  # see cross_groups_every_step
        self._open: Transaction | None = None  # started, not yet voted
        self._peer: Transaction | None = None  # the transaction of the peer this rank healed from
        self._loaded = False  # this rank took a peer's state in the last quorum
        self._realign: tuple[Callable[[], Any], Callable[[Any], None]] | None = None
        self._follow_sync: Callable[[int], None] | None = None
        self._last: _ReplicaWork | None = None  # the collective in flight
        self._members: tuple[int, ...] = ()  # the replica groups of the last quorum
        self._quorum: tuple[int, ...] | None = None  # set by the process group at each reconfiguration
        self._sizes_checked: tuple[int, ...] | None = None  # the members whose sizes were found equal
        self._quorum_started = 0.0  # when the last quorum was asked for
        self._holds_final_state = False  # healed from peers after their last step (see ``start``)
        manager.register_state_dict_fn(PEER_KEY, self._load_peer, self._peer_state)

    # -- what the callers set ---------------------------------------------------------------------

    def realign_with(self, save: Callable[[], Any], load: Callable[[Any], None]) -> None:
        """What the ranks of a group that healed re-align to: rank 0's ``save()``, ``load``-ed by the others
        (the whole state a healing group receives: the model, the optimizers, the data, the schedules)."""
        self._realign = (save, load)

    def follow_syncs(self, take_part: Callable[[int], None]) -> None:
        """``take_part(fragment)``: LocalSGD's part in a sync its peers started, for a group that healed
        into it; it runs the sync's collectives and its vote (``lit_dp.LocalSGD``)."""
        self._follow_sync = take_part

    def cross_groups_every_step(self, every_step: bool) -> None:
        """Whether each optimizer step crosses replica groups (its gradients: a transaction per step), or
        only LocalSGD's syncs do (its local phase: the steps between them take no quorum)."""
        self._every_step = every_step

    @property
    def every_step(self) -> bool:
        return self._every_step

    @property
    def open(self) -> Transaction | None:
        """The transaction started and not yet voted on."""
        return self._open

    # -- 1. the quorum ----------------------------------------------------------------------------

    def start(self, transaction: Transaction) -> bool:
        """Start ``transaction``: its quorum, a heal when this group is behind, the group re-aligned; returns
        whether this group healed (its state is then a peer's). A group that healed into a sync its peers
        started carries that one out instead of its own (``open`` says which): from a step, LocalSGD has
        taken part in it when this returns (``follow_syncs``), that transaction voted; from a sync of its
        own (it was left out of that one's quorum, and met its peers at their next), the caller syncs the
        fragment ``open`` names, or nothing when ``open`` is None (it met them after their last step)."""
        if self._open is not None:
            raise RuntimeError(f"lit_dp: a transaction started across replica groups before {self._open.name} was voted on")
        self._open = transaction
        healed = self._take_quorum()
        if transaction.name is None:  # a step: the quorum's count names it (a healed group's jumped to its peers')
            transaction = self._open = dataclasses.replace(transaction, name=f"step {self.manager.current_step()}")
        peer = self._peer
        joins = healed and peer is not None and peer.sync is not None and peer != transaction
        self._took(healed, peer.name if joins else transaction.name)
        if healed and peer is None and transaction.sync is not None:
            # Left out of this sync's quorum, this group met its peers at their last quorum, after their last
            # step (``reconcile``): it holds their final state, and there is no sync left to carry out, nor a
            # quorum to reconcile in (the peers are gone after theirs).
            log.debug("%s: [group %s] took its peers' final state instead of %s", LINE, self.replica_group, transaction.name)
            self._open = None
            self._holds_final_state = True
        if joins:
            log.debug("%s: [group %s] carries out its peers' %s", LINE, self.replica_group, peer.name)
            self._open = peer
            if transaction.sync is None:
                if self._follow_sync is None:
                    raise RuntimeError(
                        f"lit_dp: replica group {self.replica_group} healed at {transaction.name} into its peers' "
                        f"{peer.name}, with no LocalSGD to take part in it: expected the same local_sgd options on "
                        "every replica group."
                    )
                self._follow_sync(peer.sync)
        return healed

    def reconcile(self) -> None:
        """After the last step: one more quorum, in which a group that did not apply a transaction its peers
        applied heals from one that did, so that every group ends with the same state. One try: groups that
        are gone by then are not waited for past the quorum timeout. Nothing to do for a group that took
        its peers' final state in their last quorum."""
        if self._holds_final_state:
            return
        started = time.monotonic()
        try:
            self._start_quorum()
        except TimeoutError:
            self.say(
                f"no quorum within {time.monotonic() - started:.0f} s after the last step: the groups were not reconciled"
            )
            return
        self._quorum_started = started
        healed = self._realigned()
        failures = self._failures(self.manager.errored())
        if failures:  # no vote follows: a heal that failed here would leave the groups apart unsaid
            self.say(f"the groups were not reconciled after the last step: {failures}")
            return
        self._took(healed, "the quorum after the last step")

    def _take_quorum(self) -> bool:
        """``Manager.start_quorum``, tried up to ``QUORUM_ATTEMPTS`` times of its quorum timeout
        (``QuorumUnreachable`` after the last, or at once when the job ended without this group); then
        the group sizes checked and the group re-aligned. Returns whether this group healed."""
        for attempt in range(1, QUORUM_ATTEMPTS + 1):
            started = time.monotonic()
            try:
                self._start_quorum()
            except TimeoutError:
                status = LighthouseStatus.read(self.lighthouse) if self.lighthouse else None
                step = self.manager.current_step()
                ended = status is not None and status.ended_without(self.replica_group, step)
                reason = self._unreachable(status, ended, time.monotonic() - started, attempt)
                if ended or attempt == QUORUM_ATTEMPTS:
                    self.say(reason)
                    raise QuorumUnreachable(reason, job_ended=ended) from None
                self.say(f"{reason}; trying again")
                continue
            self._quorum_started = started
            self._check_sizes()
            return self._realigned()
        raise AssertionError("unreachable")

    def _start_quorum(self) -> None:
        """``Manager.start_quorum``, this rank's last heal forgotten first. On its ``TimeoutError`` torchft keeps
        the failed quorum and would raise it again at whatever asks it next (the next start, the number of
        groups taking part for the run's metrics): the Manager is left answering from the last quorum that
        formed, and the error raised."""
        self._peer, self._loaded = None, False
        last_quorum = self.manager._quorum_future
        try:
            self.manager.start_quorum()
        except TimeoutError:
            self.manager._quorum_future = last_quorum
            raise

    def _realigned(self) -> bool:
        """Whether any rank of this group took a peer's state in the quorum just taken; if one did, every
        rank now holds rank 0's (and knows the transaction rank 0's peer was in)."""
        took = self._loaded
        within = self.within
        if within is None:
            return took
        flag = torch.tensor([float(took)], device=groups.device_of(within))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=within)
        if not flag.item():
            return False
        save = self._realign[0] if self._realign is not None else None
        payload = [(self._peer, save() if save is not None else None) if self.group_rank == 0 else None]
        dist.broadcast_object_list(payload, src=dist.get_global_rank(within, 0), group=within)
        self._peer, state = payload[0]
        if self.group_rank != 0 and state is not None and self._realign is not None:
            self._realign[1](state)
        log.debug("%s: [group %s] healed: its ranks re-aligned to its rank 0's state", LINE, self.replica_group)
        return True

    @property
    def peer_after_last_step(self) -> bool:
        """Whether the state this rank took in the quorum in progress is a peer's after its last step (made in
        its ``reconcile``, in no transaction); read by the state's own loader, which torchft calls after ours."""
        return self._loaded and self._peer is None

    def _load_peer(self, state: dict[str, Any]) -> None:
        # torchft loads a peer's state in start_quorum (ours is loaded first: registered first).
        self._loaded = True
        self._peer = Transaction(**state["transaction"]) if state.get("transaction") else None

    def _peer_state(self) -> dict[str, Any]:
        # Called in torchft's quorum thread while the main thread waits for the quorum.
        return {"transaction": dataclasses.asdict(self._open) if self._open is not None else None}

    def record_quorum(self, members: list[int]) -> None:
        """The members of a new quorum, from torchft's process group (its global ranks: ``replica_group *
        group_size + group_rank``); called in torchft's quorum thread, read after the quorum."""
        self._quorum = tuple(sorted({member // self.group_size for member in members}))

    def _check_sizes(self) -> None:
        """Replica groups of different sizes are refused before anything is reduced with them: rank ``r``
        of a group meets rank ``r`` of the others, and the data and the divisors count ranks per group."""
        members = self._quorum  # None on a rank whose process group could not be built with the others
        if (members is not None and members == self._sizes_checked) or not self.lighthouse:
            return
        status = LighthouseStatus.read(self.lighthouse)
        sizes = status.world_sizes if status is not None else {}
        sizes = {**sizes, self.replica_group: self.group_size}
        if len(set(sizes.values())) > 1:
            each = ", ".join(
                f"group {group} has {size} rank{'s' * (size != 1)}" for group, size in sorted(sizes.items())
            )
            raise ValueError(
                f"replica groups of different sizes are not supported: {each}; rank r of a group meets rank r of "
                "the others, and the data is dealt by ranks per group: expected the same --nproc-per-node (and "
                "--nnodes) for every group."
            )
        self._sizes_checked = members

    # -- 2. the collectives -----------------------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        """A sum of ``tensors`` across the replica groups of the quorum (``collective``)."""
        op = opts if isinstance(opts, dist.ReduceOp) else opts.reduceOp
        if op != dist.ReduceOp.SUM:
            raise ValueError(
                f"lit_dp: all_reduce with {op} across replica groups is not supported: the replicas present change "
                "from step to step, so lit_dp divides by Manager.num_participants() itself; expected ReduceOp.SUM."
            )
        return self.collective(tensors, lambda group: group.allreduce(tensors, opts))

    def collective(self, tensors: list[torch.Tensor], issue: Callable[[Any], dist.Work]) -> dist.Work:
        """``issue(group)``: a collective on torchft's process group that writes ``tensors``, under the
        protocol (the steps of torchft's ``Manager.allreduce``): nothing once the transaction failed, the
        quorum waited for, zeros from a group that does not take part, a failure reported instead of
        raised. Its work never raises and its future is a plain ``torch.futures.Future``; one collective
        is in flight at a time (as torchft's own DDP hook waits for each bucket: after a peer died, gloo
        fails an operation waiting on its connection at once, but one posted after the connection broke
        waits out the timeout, and buffers a timed-out operation may still write cannot be reused)."""
        if self._last is not None:
            self._last.wait()
        manager = self.manager
        if manager.errored() is not None:
            return _CompletedWork(_zeroed(tensors))
        manager.wait_quorum()
        if not manager.is_participating():
            _zeroed(tensors)
        try:
            work = issue(manager._pg)
        except Exception as error:  # noqa: BLE001 - torchft's contract: a failed collective fails the transaction
            manager.report_error(error)
            return _CompletedWork(_zeroed(tensors))
        future = manager.wrap_future(work.get_future(), tensors)
        close = getattr(manager._pg, "close_connections", None)  # a replica_process_group's
        if close is not None:
            # The moment a collective fails (on Gloo's thread, once the Manager has the error): this
            # group skips the transaction's other collectives, so a peer waiting on it in one must
            # fail now, not when this group's main thread gets there.
            future.add_done_callback(lambda _: close() if manager.errored() is not None else None)
        self._last = _ReplicaWork(manager, tensors, future)
        return self._last

    def failed(self) -> bool:
        """Whether a collective of the open transaction failed here (its vote will fail)."""
        return self.manager.errored() is not None

    # -- 3. the vote ------------------------------------------------------------------------------

    def vote(self) -> bool:
        """torchft's ``should_commit`` for the open transaction: True when this group applies it. A failed
        vote is said in one line naming the group, the transaction and the cause (every rank's own)."""
        transaction, self._open = self._open, None
        if transaction is None:
            raise RuntimeError("lit_dp: a vote across replica groups without a transaction started")
        if self._last is not None:
            self._last.wait()
            self._last = None
        error = self.manager.errored()
        if self.served is not None:
            self.served.wait_for_readers()  # should_commit stops serving this group's state
        if self.manager.should_commit():
            return True
        if transaction.sync is None:
            self.steps_discarded += 1
        else:
            self.syncs_failed += 1
        verb = "discarded" if transaction.sync is None else "failed"
        self.say(f"{transaction.name} {verb}: {self._cause(error)}")
        return False

    def _cause(self, error: Any) -> str:
        """Why the vote failed: each rank's failure, or the quorum's size."""
        failures = self._failures(error)
        if failures:
            return failures
        minimum, present = self.manager._min_replica_size, self.manager.num_participants()
        if present < minimum:
            return f"fewer than ft.min_replicas={minimum} replica groups took part ({present})"
        return "torchft's vote did not pass"

    def _failures(self, error: Any) -> str:
        """Each rank's failure in the group (``error``: this rank's, None if none), whole (the first line of
        its error); empty when no rank failed. Every rank of the group calls it."""
        own = _describe(error.original_exception) if error is not None else None
        causes = [own]
        if self.within is not None:
            causes = [None] * self.group_size
            dist.all_gather_object(causes, own, group=self.within)
        failures = [(rank, cause) for rank, cause in enumerate(causes) if cause is not None]
        if self.within is None:
            return failures[0][1] if failures else ""
        return "; ".join(f"rank {rank}: {cause}" for rank, cause in failures)

    # -- what users see ---------------------------------------------------------------------------

    def _took(self, healed: bool, at: str) -> None:
        """One line when the groups training change, and when this group healed (after the first step)."""
        if healed:
            self.recovery_seconds = time.monotonic() - self._quorum_started
        members = self._quorum if self._quorum is not None else self._members
        left = sorted(set(self._members) - set(members))
        joined = sorted(set(members) - set(self._members))
        parts = []
        # At step 0 every group but the first takes the first one's state (torchft's init_sync): no news.
        if healed and self.manager.current_step() > 0:
            recovered = f"replica group {self.replica_group} recovered a peer's state in {self.recovery_seconds:.2f} s"
            if not self._members:  # this process's first quorum, in a job under way
                verb = "rejoined" if JobAttempt.from_environ().is_restart else "joined"
                recovered, joined = f"{recovered} and {verb}", []
            parts.append(recovered)
        for ids, verb in ((left, "left"), (joined, "joined")):
            if ids:
                parts.append(f"replica group{'s' * (len(ids) > 1)} {_ids(ids)} {verb}")
        if parts:
            if self._members and (left or joined):
                self.membership_changes += 1
            self.say(f"{'; '.join(parts)} at {at}; {len(members)} train ({_ids(members)})")
        self._members = members

    def _unreachable(self, status: LighthouseStatus | None, ended: bool, waited: float, attempt: int) -> str:
        """Which quorum this group could not reach, the ``min_replicas`` it needed, and what the lighthouse says."""
        head = (
            f"replica group {self.replica_group} (at step {self.manager.current_step()}) found no quorum of "
            f"ft.min_replicas={self.manager._min_replica_size} replica groups at the lighthouse {self.lighthouse} in "
            f"{waited:.0f} s (attempt {attempt} of {QUORUM_ATTEMPTS})"
        )
        if status is None:
            return f"{head}; the lighthouse's status page could not be read"
        previous = ", ".join(f"{group} at step {step}" for group, step in status.previous.items())
        last = f"its last quorum: groups {previous}" if previous else "no quorum formed yet"
        if ended:
            silent = status.silent_for(self.replica_group) or 0.0
            return (
                f"{head}: the job went on without this group and ended ({last}; no other group heard from for "
                f"{silent:.0f} s); exiting"
            )
        alive = status.alive(self.replica_group)
        heard = f"groups {', '.join(alive)} are alive" if alive else "no other group is alive"
        return f"{head}: {heard}; {last}; the lighthouse says: {status.next_quorum}"

    def say(self, text: str) -> None:
        """One line for users, from the group's rank 0 (its ranks see the same quorums and votes), naming the group."""
        line = f"{LINE}: [group {self.replica_group}] {text}"
        if self.group_rank != 0:
            log.debug("%s", line)
            return
        # A progress bar on the console (Lightning's is tqdm's) is cleared for the line and drawn again after.
        with tqdm.external_write_mode(file=sys.stdout):
            print(line, flush=True)


def check_every_group_takes_part(manager: Any, sync_dtype: Any) -> None:
    """A ``ValueError`` for a Manager under which a group of the quorum may sit a sync out: a sync in a wire
    format cuts its payload into one chunk per member of torchft's process group, which must then be the groups
    taking part (``Manager.num_participants``). torchft's asynchronous quorum leaves a healing group out, and its
    spares (``WorldSizeMode.FIXED_WITH_SPARES``) the groups past ``min_replica_size``; lit_dp's own Manager has
    neither."""
    mode = getattr(getattr(manager, "_replica_world_size_mode", None), "name", "DYNAMIC")
    if getattr(manager, "_use_async_quorum", False) or mode != "DYNAMIC":
        raise ValueError(
            f"sync_dtype={sync_dtype!r} across replica groups with a Manager built with "
            f"use_async_quorum={getattr(manager, '_use_async_quorum', False)}, world_size_mode={mode} is not "
            "supported: a sync in a wire format cuts its payload into one chunk per group of the quorum, so every "
            "group must take part; expected use_async_quorum=False and WorldSizeMode.DYNAMIC, or sync_dtype=None."
        )


def _describe(error: BaseException) -> str:
    """An error in one line, whole: its type and the first line of its message."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def _ids(ids: tuple[int, ...] | list[int]) -> str:
    return ", ".join(str(i) for i in ids)


class _ReplicaWork(dist.Work):
    """One collective across replica groups: never raises; on failure its tensors are zeros."""

    def __init__(self, manager: Any, tensors: list[torch.Tensor], future: torch.futures.Future) -> None:
        super().__init__()
        self._manager = manager
        self._tensors = tensors
        self._future = future
        self._waited = False

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._waited:
            return True
        self._waited = True
        self._watch(self._manager._pg)
        self._future.wait()  # errors and the Manager's timeout were turned into a report to the Manager
        if self._manager.errored() is not None:
            # Possibly half-reduced: zeros leave the reducer's flags quiet, and the transaction fails.
            _zeroed(self._tensors)
            # This group skips the transaction's other collectives; a peer already inside one of them
            # would wait for it until the process group's timeout. Closing this group's connections
            # fails that peer at once, as a dead one does. The failed vote that follows brings a new
            # quorum, which rebuilds the process group.
            self._manager._pg.abort()
        return True

    def _watch(self, group: Any) -> None:
        """Wait for the collective in slices while a peer's connection may hang up under it: a peer that
        died or gave up closed it, and nothing will arrive on it. Closing this group's connections then
        fails the collective at once instead of at the process group's timeout."""
        hung_up = getattr(group, "connections_hung_up", None)  # a replica_process_group's
        if hung_up is None:
            return
        done = threading.Event()
        self._future.add_done_callback(lambda _: done.set())
        while not done.wait(WATCH_SECONDS):
            if hung_up() and not done.wait(HANG_UP_GRACE_SECONDS):
                log.debug("lit_dp: a replica group's connection hung up under a collective: closing them all")
                group.close_connections()  # the collective fails now; the group is rebuilt at the next quorum
                return

    def get_future(self) -> torch.futures.Future:
        return self._future


class _CompletedWork(dist.Work):
    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self._future: torch.futures.Future = torch.futures.Future()
        self._future.set_result(tensors)

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future


def _zeroed(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    for tensor in tensors:
        tensor.zero_()
    return tensors
