"""``lit_dp.LocalSGD``: the object a training loop steps once per optimizer step: its schedule, its syncs and their outcome."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lit_dp import join
from lit_dp.data_parallel import DataParallel
from lit_dp.fault_tolerance.commit import Transaction, check_every_group_takes_part
from lit_dp.gradients.broadcast import ddp_ignored, synced_buffers, synced_parameters
from lit_dp.gradients.buckets import assign_fragments, megabytes_to_bytes
from lit_dp.gradients.waiting import UNWATCHED, Waiter
from lit_dp.job.process_group import get_rings
from lit_dp.local_sgd.outer import OuterState
from lit_dp.local_sgd.schedule import ADAPTIVE_MAX_LOCAL_STEPS, ADAPTIVE_MIN_LOCAL_STEPS, Schedule
from lit_dp.local_sgd.transport import Reduction, SyncBucket, check_wire_backends, reduce_across
from lit_dp.local_sgd.wire import resolve_error_feedback, wire_format
from lit_dp.observability.stats import SyncRecorder, SyncStats
from lit_dp.options import DEFAULT_BUCKET_MB
from lit_dp.options.declare import choice
from lit_dp.options.local_sgd import (
    DEFAULT_OUTER_LR,
    DEFAULT_OUTER_MOMENTUM,
    OUTERS,
    check_mixing,
    check_outer_lr,
    check_outer_momentum,
)

log = logging.getLogger(__name__)


def _check_count(option: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{option}={value!r} is invalid: expected an integer >= {low}.")


class LocalSGD:
    """Periodic model averaging after ``warmup_steps`` data-parallel steps (see ``lit_dp.local_sgd``).

    Args:
        module: the model; when it is a ``lit_dp.DataParallel``, its gradient communication is
            switched off for the local phase. Every rank must hold the same parameters when the
            local phase starts (DataParallel's construction and warm-up guarantee it).
        local_steps: K, local optimizer steps between averages (the first period when adaptive).
        warmup_steps: W, ordinary data-parallel optimizer steps before the local phase.
        adaptive: recompute the period at each average from the loss and learning rate.
        min_local_steps, max_local_steps: bounds of the adaptive period.
        comm_buffer_size: bucket size limit of the averaging all-reduce, MB; None: the
            ``DataParallel``'s own when the local phase starts (with ``"auto"`` the tuned size),
            else ``DEFAULT_BUCKET_MB``.
        outer: ``"average"`` (the mean of the models) or ``"nesterov"`` (DiLoCo's outer optimizer).
        outer_lr, outer_momentum: the outer SGD's learning rate and Nesterov momentum (0: plain outer SGD,
            which with ``outer_lr=1`` is averaging).
        sync_dtype: the format the deltas travel in (``lit_dp.local_sgd.wire``): ``"bf16"`` (or
            ``torch.bfloat16``), ``"int8"``, ``"int4"`` or ``"fp8"`` (``float8_e4m3fn``, where the torch
            build has it), the last three with an fp32 scale per block of 128 values; always summed
            in fp32 (across torchft's replica groups of several ranks: inside each group in the parameters'
            dtype, then across groups in the format). None: the parameters' dtype.
        error_feedback: keep what the format dropped on this rank and add it to this rank's next delta;
            None: on for 8 bits and below (int8, int4, fp8), off for bf16. Not with ``sync_dtype=None``.
        fragments: F, sync the model one fragment at a time, one every K/F steps (streaming DiLoCo);
            K must be a multiple of F, and F at most the number of trainable tensors.
        offload: keep the snapshot and the outer momentum of CUDA parameters in (pinned) CPU memory;
            False: on the parameters' device. Parameters elsewhere keep them on their own device.
        sync_delay: tau, inner steps between the start of a sync and its application (its
            all-reduce overlaps them; Streaming DiLoCo, eager updates); below K/F. Refused across torchft's
            replica groups, where each sync is a transaction of their commit protocol.
        mixing: alpha, the weight kept of the local parameters when a sync is applied:
            ``alpha * local + (1 - alpha) * synced`` (torchft's ``fragment_update_alpha``); 0 replaces them.
        group: the process group; defaults to the ``DataParallel``'s (``module.rings``), or for
            another module to the rings of ``init_parallel_env``.
    """

    def __init__(
        self,
        module: nn.Module,
        local_steps: int,
        warmup_steps: int = 0,
        adaptive: bool = False,
        min_local_steps: int = ADAPTIVE_MIN_LOCAL_STEPS,
        max_local_steps: int = ADAPTIVE_MAX_LOCAL_STEPS,
        comm_buffer_size: float | None = DEFAULT_BUCKET_MB,
        group: dist.ProcessGroup | None = None,
        outer: str = "average",
        outer_lr: float = DEFAULT_OUTER_LR,
        outer_momentum: float = DEFAULT_OUTER_MOMENTUM,
        sync_dtype: torch.dtype | str | None = None,
        error_feedback: bool | None = None,
        fragments: int = 1,
        offload: bool = True,
        sync_delay: int = 0,
        mixing: float = 0.0,
    ) -> None:
        _check_count("local_steps", local_steps, 1)
        _check_count("fragments", fragments, 1)
        if local_steps % fragments:
            raise ValueError(
                f"fragments={fragments} with local_steps={local_steps} is invalid: fragment f syncs after the steps "
                "W + (f+1)*K/F + n*K; expected local_steps a multiple of fragments (so fragments <= local_steps)."
            )
        if adaptive and fragments > 1:
            raise ValueError(
                f"fragments={fragments} with adaptive=True is invalid: the fragments' offsets are fixed fractions of "
                "K, which the adaptive rule changes at every sync; expected fragments=1 or adaptive=False."
            )
        _check_count("sync_delay", sync_delay, 0)
        if sync_delay >= local_steps // fragments:
            raise ValueError(
                f"sync_delay={sync_delay} with local_steps={local_steps} and fragments={fragments} is invalid: a sync "
                "is applied sync_delay steps after it starts, before the next fragment's starts K/F steps after it; "
                f"expected sync_delay < {local_steps // fragments}."
            )
        if adaptive and sync_delay:
            raise ValueError(
                f"sync_delay={sync_delay} with adaptive=True is invalid: the adaptive rule changes K at every sync, "
                "which must stay above the delay; expected sync_delay=0 or adaptive=False."
            )
        self._sync_delay = sync_delay
        self._mixing = check_mixing("mixing", mixing)
        choice(*OUTERS)("outer", outer)
        outer_lr = check_outer_lr("outer_lr", outer_lr)
        outer_momentum = check_outer_momentum("outer_momentum", outer_momentum)
        self._wire = wire_format(sync_dtype)
        self._error_feedback = resolve_error_feedback(error_feedback, self._wire)
        if not isinstance(offload, bool):
            raise ValueError(f"offload={offload!r} is invalid: expected True or False.")
        self._offload = offload
        _check_count("warmup_steps", warmup_steps, 0)
        _check_count("min_local_steps", min_local_steps, 1)
        if not min_local_steps <= max_local_steps:
            raise ValueError(
                f"min_local_steps={min_local_steps!r}, max_local_steps={max_local_steps!r} are invalid: "
                "expected 1 <= min_local_steps <= max_local_steps."
            )
        if isinstance(module, DataParallel) and module.sharding_stage is not None:
            raise ValueError(
                f"lit_dp.LocalSGD with a DataParallel built with sharding_stage={module.sharding_stage} is invalid: "
                "LocalSGD steps every rank's optimizer on its own gradients, sharding steps each parameter on one "
                "rank only; expected one of them."
            )
        self._data_parallel = module if isinstance(module, DataParallel) else None
        self._schedule = Schedule(local_steps, warmup_steps, fragments, adaptive, (min_local_steps, max_local_steps))
        if group is not None:
            self._rings = [group]
        else:  # the model's own communicators (its process_group), else those of init_parallel_env
            self._rings = module.rings if isinstance(module, DataParallel) else get_rings()
        # Across torchft's replica groups (a model under a Manager: lit_dp.fault_tolerance), each sync is a
        # transaction of their commit protocol, as in torchft's DiLoCo: a quorum, the collectives, a vote
        # (see _sync). The divisor is the count of those that took part, the outer step runs even when one
        # group is present (as torchft's DiLoCo), and each group keeps its integer buffers (BatchNorm's
        # counts), as each keeps its buffers under the Manager.
        self._commit = getattr(self._rings[0], "commit", None) if self._rings else None
        self._replica_groups = self._commit is not None
        if self._commit is not None:
            if sync_delay:
                raise ValueError(
                    f"sync_delay={sync_delay} across torchft's replica groups is not supported: a sync is a "
                    "transaction of their commit protocol (a quorum, its collectives, a vote), and one still in "
                    "flight during the inner steps after it would cross the next transaction's quorum, which may "
                    "rebuild torchft's process group under it; expected sync_delay=0."
                )
            if self._wire is not None:
                check_every_group_takes_part(self._commit.manager, sync_dtype)
            self._commit.follow_syncs(self._take_part_in_peers_sync)
        elif self._wire is not None:
            check_wire_backends(sync_dtype, self._rings)
        if comm_buffer_size is not None:
            megabytes_to_bytes("comm_buffer_size", comm_buffer_size)  # checked now, read when the buckets are built
        self._comm_buffer_size = comm_buffer_size
        self._outer = outer
        self._outer_settings = {"lr": outer_lr, "momentum": outer_momentum}
        self._state: OuterState | None = None  # built when the local phase starts
        self._outer_resumed: dict[str, Any] | None = None  # a checkpoint's tensors, until the state is built
        self._residuals_resumed: list[torch.Tensor | None] | None = None  # this rank's, likewise
        inner = module.module if isinstance(module, DataParallel) else module
        # What the model keeps equal across ranks: DDP's ignore list, read when the model was wrapped.
        ignore = module.parameters_to_ignore if isinstance(module, DataParallel) else ddp_ignored(inner)
        self._params = [p for _, p in synced_parameters(inner, ignore) if p.requires_grad]
        self._buffers = [buffer for _, buffer in synced_buffers(inner, ignore)]
        self._fragment_indices = assign_fragments([p.numel() * p.element_size() for p in self._params], fragments)
        device = self._params[0].device if self._params else torch.device("cpu")
        self._recorder = SyncRecorder(device)
        self._pending: _PendingSync | None = None  # a sync started, applied sync_delay steps later
        self._after_sync: list[Callable[[int, bool], None]] = []  # the replica-consistency check, when on
        if self._data_parallel is not None:
            # Under Join a rank that ran out shadows this object's collectives too (lit_dp.join).
            self._data_parallel.join_state.driven_by(self)
            consistency = self._data_parallel.consistency
            if consistency is not None:  # the replicas are equal right after an average: compare them there
                # Counted in averages, which a rank shadowing the others under Join takes too (its step count lags).
                every = max(1, math.ceil(consistency.every_n_steps / local_steps))
                self.add_sync_hook(lambda step, shadow: consistency.check_after_average(step, shadow, every))
        self._follow_phase()

    @property
    def step_count(self) -> int:
        """Optimizer steps taken so far (``step()`` calls)."""
        return self._schedule.step

    @property
    def local_steps(self) -> int:
        """The current period K (changes only when adaptive)."""
        return self._schedule.local_steps

    @property
    def last_average(self) -> int:
        """The step after which the models were last averaged (W before the first average); with
        fragments, the last fragment's last sync (the one the buffers go with)."""
        return self._schedule.last_syncs[-1]

    @property
    def fragments(self) -> int:
        """F, the number of fragments synced in turn (1: the whole model at once)."""
        return self._schedule.fragments

    @property
    def outer(self) -> str:
        """``"average"`` or ``"nesterov"``."""
        return self._outer

    @property
    def across_replica_groups(self) -> bool:
        """Whether the syncs cross torchft's replica groups (the model is under a Manager): the ranks of one
        group then hold the same model between syncs, and a recovering group takes a peer's state."""
        return self._replica_groups

    @property
    def _world_size(self) -> int:
        """The ranks the syncs reduce over, read at each: across replica groups, those taking part."""
        return self._rings[0].size() if self._rings else 1

    @property
    def _syncs(self) -> bool:
        """Whether a sync communicates: with another rank, or across replica groups (even alone, the
        outer optimizer steps there, and a group that comes back must find the same schedule)."""
        return self._replica_groups or self._world_size > 1

    @property
    def in_local_phase(self) -> bool:
        """Whether warm-up is over: gradients stay local, models are averaged periodically."""
        return self._schedule.in_local_phase

    def step(self, loss: torch.Tensor | float | None = None, lr: float | None = None, *, joined: bool = False) -> bool:
        """Count one optimizer step; apply a sync started ``sync_delay`` steps ago, and start one (with
        fragments: of one fragment) when the schedule says so, applied now when ``sync_delay`` is 0.
        Returns whether a sync started.

        ``loss`` (this rank's training loss) and ``lr`` are required when adaptive. ``joined``:
        this rank ran out of batches and takes the step with the others (the Trainer's uneven
        inputs): it trained nothing, and its loss does not count.
        """
        schedule = self._schedule
        schedule.advance(joined)
        if self._pending is not None and schedule.step - self._pending.step >= self._sync_delay:
            self._complete()
        agree_first = schedule.needs_first_agreement
        fragment = schedule.due_fragment()
        if (agree_first or fragment is not None) and self._data_parallel is not None:
            join.notify(self._data_parallel, (agree_first, fragment))
        if agree_first:
            schedule.loss_0, schedule.lr_0 = self._agreed_loss_and_lr(loss, lr, counts=not joined)
        if fragment is not None:
            self._sync(fragment)
            if schedule.adaptive:
                schedule.next_period(*self._agreed_loss_and_lr(loss, lr, counts=not joined))
        self._follow_phase()
        return fragment is not None

    def shadow_step(self, agree_first: bool, fragment: int | None) -> None:
        """The collectives of a ``step()`` that the ranks still in take, on a rank that joined
        (``lit_dp.join``): it takes part in the sync of ``fragment`` (None: no sync) without counting
        (it sends zeros), and its loss does not count."""
        schedule = self._schedule
        if agree_first:
            schedule.loss_0, schedule.lr_0 = self._agreed_loss_and_lr(None, None, counts=False)
        if fragment is not None:
            self._sync(fragment, shadow=True)
            if schedule.adaptive:
                schedule.next_period(*self._agreed_loss_and_lr(None, None, counts=False))

    def adopt_schedule_of(self, src: int) -> None:
        """Take global rank ``src``'s schedule (after a Join, whose ranks counted different steps);
        every rank must call it, with parameters already equal on all ranks."""
        if self._world_size < 2:
            return
        if self._pending is not None:  # the ranks stopped stepping: a delayed sync is applied now
            self._complete()
        schedule = [self._shared_state_dict()]
        own = self.rank_state_dict()  # each rank keeps its own residuals
        with self._waiter.outside("the broadcast of the LocalSGD schedule"):
            dist.broadcast_object_list(schedule, src=src, group=self._rings[0])
        self.load_state_dict(schedule[0])
        self.load_rank_state_dict(own)

    def finish(self) -> None:
        """Make every rank hold the same model (call when training ends): apply a sync still in flight,
        replacing the parameters whatever ``mixing``, then sync at once, replacing them too, every other
        fragment that took a local step since its last sync, or with ``mixing`` every other fragment
        (its last sync left each rank part of its own). Across replica groups, a group whose vote
        failed one of these syncs then takes the state of one that applied it (one more quorum)."""
        replaced = None
        if self._pending is not None:
            replaced = self._pending.fragment
            self._complete(keep=0.0)
        due = [f for f in self._schedule.unsynced(every=bool(self._mixing)) if f != replaced]
        for fragment in due:
            self._sync(fragment, final=True)
        if due and self._commit is not None:
            self._commit.reconcile()
        if (due or replaced is not None) and self.fragments > 1 and self._syncs:
            self._after_sync_hooks(shadow=False)  # every fragment now synced and taken: the replicas are equal

    def _sync(self, fragment: int, shadow: bool = False, final: bool = False, quorum_taken: bool = False) -> None:
        """Start the sync of ``fragment`` (with the last, of the buffers too): every rank's parameters
        become their mean over the ranks that take part, or the snapshot stepped by the outer optimizer
        with their mean delta, mixed with the local ones by ``mixing``; applied ``sync_delay`` steps
        later (``_complete``), or now when that is 0 or ``final`` (``finish``: no mixing either).
        ``shadow``: this rank joined (``lit_dp.join``); its model waits for the final broadcast and is
        not compared. This rank's model counts if it took a step of its own since the fragment's last
        sync; a rank that ran out of batches counts once more, with the work it did before, then sends
        zeros and takes the result like the others.

        Across replica groups the sync is a transaction of their commit protocol: its quorum first
        (``quorum_taken``: this group healed into a sync its peers started, whose quorum it took), in
        which a group behind the others takes a peer's state (this object's included, from just before
        the peers' sync, which may be a later one than this group's); such a group sends nothing of its
        own (it holds its peer's work) and takes the result like the others."""
        healed = quorum_taken
        if self._commit is not None and not quorum_taken:
            step = self._schedule.step
            name = f"the sync after step {step}" + (f" (fragment {fragment})" if self.fragments > 1 else "")
            healed = self._commit.start(Transaction(name, sync=fragment))
            # Left out of this sync's quorum (late past the lighthouse's join timeout), this group met its
            # peers at their next sync and took their state from just before it: it syncs their fragment;
            # or after their last step, and holds their final state: nothing is left to sync.
            if self._commit.open is None:
                return
            fragment = self._commit.open.sync
        participates = self._schedule.synced(fragment) and not healed
        if not self._syncs:
            return
        if self._pending is not None:  # a rank that joined applies its delayed sync lazily: no collective is left
            self._complete()
        state = self._outer_state_built()
        began = self._recorder.mark()
        with torch.no_grad():
            reduction = self.reduce_across(state.fragments[fragment], self._rings, participates)
        assert reduction.exchange is not None
        self._pending = _PendingSync(fragment, self._schedule.step, shadow, began, reduction.exchange[0], reduction)
        if self._sync_delay == 0 or final:
            self._complete(keep=0.0 if final else self._mixing)

    def _take_part_in_peers_sync(self, fragment: int) -> None:
        """This group healed into a sync its peers started (a restarted group meets them there): this
        object holds a peer's state from just before it; the sync runs here too, sending nothing."""
        self._sync(fragment, quorum_taken=True)
        self._follow_phase()

    def _complete(self, keep: float | None = None) -> None:
        """Wait for the pending sync and apply it; ``keep``: the weight of the local parameters (``mixing``).
        Across replica groups, only once the group's vote says every rank of it saw the sync through."""
        pending, self._pending = self._pending, None
        assert pending is not None and self._state is not None
        keep = self._mixing if keep is None else keep
        # Exposed: with a delay, only the waits: for a wire format's exchange of chunks as it was launched,
        # and when it is applied (the compute in between overlapped the rest).
        waited_from = pending.launched if self._sync_delay == 0 else self._recorder.mark()
        exchange = pending.reduction.exchange if self._sync_delay and pending.reduction is not None else None
        with torch.no_grad():
            participants = pending.reduction.wait() if pending.reduction is not None else pending.participants
            if self._commit is not None and not self._commit.vote():
                self._sync_failed(pending)
                return
            self._state.apply(pending.fragment, participants, keep)
        nbytes = self._state.wire_bytes(pending.fragment, self._world_size)
        self._recorder.record(pending.step, nbytes, pending.began, waited_from, exchange)
        if self.fragments == 1 and not keep:  # else the replicas still differ: see finish()
            self._after_sync_hooks(pending.shadow)

    def _sync_failed(self, pending: _PendingSync) -> None:
        """A sync across replica groups that this group's vote failed (a collective failed on one of its
        ranks): nothing of it is applied on any rank of the group, the parameters keep this group's local
        work, and the fragment's next sync is its scheduled one (the schedule stays every group's). A group
        whose vote passed applied it and is a transaction ahead in torchft's count: at the next sync's
        quorum this group takes its state (parameters, snapshot, outer momentum, schedule) and sends
        nothing of its own. If no group applied it, each keeps its own work, which the next sync carries
        with the next period's."""
        assert self._state is not None
        self._state.drop(pending.fragment)
        self._schedule.trained[pending.fragment] = True
        log.debug("LocalSGD: the sync of fragment %d at step %d failed across replica groups", pending.fragment, pending.step)

    def reduce_across(
        self, buckets: list[SyncBucket], groups: list[dist.ProcessGroup], participates: bool = True
    ) -> Reduction:
        """The one cross-rank reduction of a sync over ``groups`` (``lit_dp.local_sgd.transport.reduce_across``),
        its waits through this object's ``Waiter``, the exchange of a wire format's chunks timed by its recorder."""
        return reduce_across(buckets, groups, self._waiter, participates, self._recorder.mark)

    def _after_sync_hooks(self, shadow: bool) -> None:
        for hook in self._after_sync:
            hook(self._schedule.step, shadow)

    def add_sync_hook(self, hook: Callable[[int, bool], None]) -> None:
        """Call ``hook(step, shadow)`` on every rank after each average, when every rank that is not
        shadowing the others' steps under Join (``shadow``) holds the same model: with fragments, only
        after ``finish()``, which leaves every fragment synced at the same step."""
        self._after_sync.append(hook)

    def held_bytes(self) -> dict[str, dict[str, int]]:
        """The memory this object holds, by what (``snapshot``; ``momentum``, the outer SGD's; ``sync``,
        payloads of a sync in flight, none between syncs) and by device (``str(device)``), in bytes:
        between syncs, the trainable parameters' bytes once for the snapshot and once more with
        momentum, on the CPU for CUDA parameters when offloaded."""
        if self._state is None:
            return {"snapshot": {}, "momentum": {}, "sync": {}}
        return self._state.held_bytes()

    def sync_stats(self) -> SyncStats | None:
        """The last average's bytes (this rank's payload) and times; None before the first (no wait)."""
        return self._recorder.last()

    def traffic(self) -> dict[str, float]:
        """The run's averages so far (with fragments: fragment syncs; a resumed object's include those its
        state carried), their mean and largest bytes, time and exposed time (ms), and bytes per local step
        it took against data parallelism's (the trainable parameters' bytes, which its reducer all-reduces
        every step); {} before the first average."""
        dp_bytes = float(sum(p.numel() * p.element_size() for p in self._params))
        summary = self._recorder.summary(self._schedule.local_steps_taken)
        if summary:
            summary["dp_bytes_per_step"] = dp_bytes
            summary["vs_dp"] = summary["bytes_per_step"] / dp_bytes if dp_bytes else 0.0
        return summary

    def describe_traffic(self) -> str:
        """One line over the averages so far (the Trainer prints it with ``comm_stats``), or "" before any."""
        t = self.traffic()
        if not t:
            return ""
        # The bytes are the wire format's, scales and padding included (SyncBucket.wire_bytes).
        how = f"LocalSGD outer={self._outer}"
        if self._wire is not None:
            how += f", sync_dtype={self._wire.name}{' with error feedback' if self._error_feedback else ''}"
        if self.fragments > 1:
            syncs = (
                f"{how}, fragments={self.fragments}: {t['syncs']:.0f} fragment syncs of "
                f"{t['bytes_per_sync'] / 2**20:.3f} MB (at most {t['max_bytes_per_sync'] / 2**20:.3f} MB)"
            )
        else:
            syncs = f"{how}: {t['syncs']:.0f} averages of {t['bytes_per_sync'] / 2**20:.3f} MB"
        return (
            f"{syncs}, "
            f"time {t['time_ms']:.3f} ms, exposed {t['exposed_ms']:.3f} ms each (rank 0); "
            f"{t['bytes_per_step'] / 2**20:.6f} MB per local step, {t['vs_dp']:.6f} of data parallelism's "
            f"{t['dp_bytes_per_step'] / 2**20:.3f} MB"
        )

    def state_dict(self) -> dict[str, Any]:
        """The schedule's state: save it with a checkpoint so a resumed run syncs at the same steps.
        Once the local phase has started, also ``outer``: the snapshot (each parameter as its
        fragment was last synced) and, with ``outer="nesterov"``, its momentum (None without), one
        CPU tensor per parameter, the same on every rank. With fragments, each fragment's last sync
        (``last_syncs``). The model's and the inner optimizer's states are not in it: they are each
        rank's own, saved beside it (see docs/local_sgd.md). With error feedback, this rank's residuals
        too (``rank_state_dict``), which only this rank takes back."""
        return self._shared_state_dict() | self.rank_state_dict()

    def _shared_state_dict(self) -> dict[str, Any]:
        """The state every rank holds alike (``state_dict`` without this rank's own part)."""
        state = self._schedule.state_dict()
        state["traffic"] = {"syncs": self._recorder.state_dict(), "local_steps": self._schedule.local_steps_taken}
        if self._replica_groups:
            state["across_replica_groups"] = True  # the ranks of a group hold one model between syncs
        # A resumed state not yet taken up is handed on unchanged.
        outer = self._state.state_dict() if self._state is not None else self._outer_resumed
        if outer is not None:
            state["outer"] = outer
        if self._pending is not None:
            state["pending"] = self._pending_state()
        return state

    def take_last_sync(self) -> None:
        """Set the parameters to the model of the last sync (each fragment's snapshot): a rank that a resumed
        checkpoint has no model of starts from there. Nothing changes before the local phase (no snapshot yet)."""
        if self._state is not None:
            with torch.no_grad():
                self._state.restore_parameters()

    def _pending_state(self) -> dict[str, Any]:
        """A delayed sync, waited for (which changes no value) and kept pending: its fragment, step, the
        count of ranks that took part and each bucket's sum (CPU), to be applied at the same step after a resume."""
        pending = self._pending
        assert pending is not None and self._state is not None
        if pending.reduction is not None:
            pending.participants, pending.reduction = pending.reduction.wait(), None
        return {
            "fragment": pending.fragment,
            "step": pending.step,
            "participants": pending.participants,
            "sums": [bucket.payload.cpu().clone() for bucket in self._state.fragments[pending.fragment]],  # type: ignore[union-attr]
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the schedule, and the saved snapshot (and momentum) when the state has them; a state
        without them (saved during warm-up, or before averaging saved its snapshot) snapshots the
        parameters as they are when the local phase starts.

        A fixed period is this object's own ``local_steps``, so a run may resume with another K;
        an adaptive period continues from the saved one. A state without fragments (saved before
        they existed) is one fragment's.
        """
        self._schedule.load_state_dict(state)
        traffic = state.get("traffic")
        if traffic is not None:  # saved since the statistics count the whole run
            self._recorder.load_state_dict(traffic["syncs"])
            self._schedule.local_steps_taken = int(traffic["local_steps"])
        self._outer_resumed = state.get("outer")
        self._residuals_resumed = self._own_residuals(state)
        self._state = None
        self._pending = None
        self._follow_phase()
        saved_pending = state.get("pending")
        if saved_pending is not None and self._state is not None:
            buckets = self._state.fragments[saved_pending["fragment"]]
            for bucket, saved_sum in zip(buckets, saved_pending["sums"], strict=True):
                bucket.payload = saved_sum.to(bucket.device)
            mark = self._recorder.mark()
            self._pending = _PendingSync(
                saved_pending["fragment"], saved_pending["step"], False, mark, mark, None, saved_pending["participants"]
            )

    def rank_state_dict(self) -> dict[str, Any]:
        """This rank's own part of the state, which no other rank holds: with error feedback, once the local
        phase has started, ``error_feedback``, its residuals (one CPU tensor per parameter) with the global
        rank and world size they belong to; {} otherwise."""
        if not self._error_feedback:
            return {}
        residuals = self._state.residuals() if self._state is not None else self._residuals_resumed
        if residuals is None:
            return {}
        return {"error_feedback": {**self._residuals_owner(), "residuals": residuals}}

    def _residuals_owner(self) -> dict[str, Any]:
        """Whose residuals this rank holds: its global rank and world size, and across replica groups its
        group's id too (the ranks of every group are numbered alike, and a group that heals takes a peer's
        state, whose residuals are the peer's)."""
        rank, world_size = _global_rank_and_size()
        owner: dict[str, Any] = {"rank": rank, "world_size": world_size}
        if self._commit is not None:
            owner["replica_group"] = self._commit.replica_group
        return owner

    def load_rank_state_dict(self, state: dict[str, Any]) -> None:
        """Take this rank's own part of a state (``rank_state_dict``): its residuals when they are this
        rank's (the same global rank and world size, and replica group), else zero."""
        self._residuals_resumed = self._own_residuals(state)
        if self._state is not None:
            self._state.restore_residuals(self._residuals_resumed)
            self._residuals_resumed = None

    def _own_residuals(self, state: dict[str, Any]) -> list[torch.Tensor | None] | None:
        """The residuals in ``state`` if they are this rank's; None (start at zero) for another rank's (every
        rank of a Trainer's resume reads rank 0's file), another world size's, or a state without them."""
        saved = state.get("error_feedback")
        if saved is None or not self._error_feedback:
            return None
        owner = {key: value for key, value in saved.items() if key != "residuals"}
        if owner == self._residuals_owner():
            return saved["residuals"]
        log.debug("LocalSGD: error feedback starts at zero: the state's residuals are another rank's (%s)", owner)
        return None

    def _follow_phase(self) -> None:
        """After the schedule moved: the model synchronises gradients during warm-up only (it is told,
        and keeps that itself; across replica groups, so is their commit protocol: a transaction per
        step in warm-up, per sync after), and the snapshot is taken as the local phase starts."""
        if self._data_parallel is not None:
            self._data_parallel.keep_gradients_local(self.in_local_phase)
        if self._commit is not None:
            self._commit.cross_groups_every_step(not self.in_local_phase)
        if self.in_local_phase and self._state is None and self._syncs:
            # The snapshot must be taken while every rank holds the same parameters: now.
            self._outer_state_built()

    def _outer_state_built(self) -> OuterState:
        """The buckets, their snapshots taken now (or restored) and the outer optimizer, built once."""
        if self._state is None:
            size = self._comm_buffer_size
            if size is None:  # the model's, tuned by now when "auto" (the warm-up must cover the tuning)
                size = self._data_parallel.comm_buffer_size if self._data_parallel is not None else DEFAULT_BUCKET_MB
            self._state = OuterState(
                self._params,
                self._buffers,
                self._fragment_indices,
                megabytes_to_bytes("comm_buffer_size", size),
                wire=self._wire,
                error_feedback=self._error_feedback,
                offload=self._offload,
                outer=self._outer,
                outer_settings=self._outer_settings,
                broadcast_other_buffers=not self._replica_groups,
                revertible=self._replica_groups,
                resumed=self._outer_resumed,
            )
            self._outer_resumed = None
            if self._residuals_resumed is not None:
                self._state.restore_residuals(self._residuals_resumed)
                self._residuals_resumed = None
        return self._state

    @property
    def _waiter(self) -> Waiter:
        return self._data_parallel.waiter if self._data_parallel is not None else UNWATCHED

    def _agreed_loss_and_lr(
        self, loss: torch.Tensor | float | None, lr: float | None, counts: bool = True
    ) -> tuple[float, float]:
        """The mean loss and learning rate of the ranks that ``counts`` (one all-reduce of
        weighted sums), the same on every rank."""
        if counts and (loss is None or lr is None):
            raise ValueError(
                f"LocalSGD(adaptive=True).step(loss={loss!r}, lr={lr!r}): expected this rank's training loss "
                "and the learning rate, from which the next averaging period is computed."
            )
        device = self._params[0].device if self._params else torch.device("cpu")
        weighted = [float(loss), float(lr), 1.0] if counts else [0.0, 0.0, 0.0]  # type: ignore[arg-type]
        values = torch.tensor(weighted, dtype=torch.float64, device=device)
        if self._world_size > 1:
            work = dist.all_reduce(values, group=self._rings[0], async_op=True)
            self._waiter.wait(work, "LocalSGD's agreement on the loss and learning rate")
        loss_sum, lr_sum, ranks = values.tolist()
        return loss_sum / ranks, lr_sum / ranks


def _global_rank_and_size() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@dataclasses.dataclass
class _PendingSync:
    """A sync started and not yet applied (``sync_delay``): its fragment, its step, whether this rank
    shadowed it under Join, the recorder's marks (started, all launched) and its collectives; restored
    from a checkpoint, the count of ranks that took part instead (the sums are in the payloads)."""

    fragment: int
    step: int
    shadow: bool
    began: Any
    launched: Any
    reduction: Reduction | None
    participants: int = 0
