"""``lit_dp.LocalSGD``: ranks step on their own gradients and average their models periodically.

Paddle's collective ``LocalSGD`` mode (fleet's ``localsgd`` and ``adaptive_localsgd`` meta
optimizers) for torch modules, usable without Lightning::

    model = lit_dp.DataParallel(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    local_sgd = lit_dp.LocalSGD(model, local_steps=8, warmup_steps=100)
    for inputs, targets in loader:
        loss = criterion(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        local_sgd.step(loss)          # one call after each optimizer step
    local_sgd.finish()                # every rank now holds the same model

Schedule: the first ``warmup_steps`` (W) optimizer steps are ordinary data-parallel steps.
After that ``DataParallel`` stops all-reducing gradients (no ``no_sync`` needed), each rank
steps on its own gradients, and the models are averaged after every ``local_steps``-th (K-th)
local step counted from the end of warm-up: after optimizer steps W+K, W+2K, ... ``finish()``
averages once more unless the last step just did. Optimizer state is never communicated.

Averaging, as Paddle does it: each rank keeps a snapshot ``s`` of the last averaged parameters
and all-reduces the delta ``s - p`` (small numbers, so the sum rounds less than a sum of the
parameters themselves), then sets ``p = s - mean(delta)``, which is the mean of the ranks'
parameters, and takes it as the next snapshot. Floating-point buffers (BatchNorm's running
statistics) are averaged directly; other buffers (BatchNorm's ``num_batches_tracked``) are
taken from the group's first rank. Tensors travel coalesced in buckets of ``comm_buffer_size``
MB (``lit_dp.assign_group_by_size``), the buckets spread over the reducer's rings and all
launched before any is awaited.

Adaptive (``adaptive=True``, Paddle's ``AdaptiveLocalSGDOptimizer``, after Wang & Joshi,
"Adaptive Communication Strategies to Achieve the Best Error-Runtime Trade-off in Local-Update
SGD", 2019): at each average the next period becomes
``clip(ceil(sqrt(lr_0 * loss / (lr * loss_0) * K)), min_local_steps, max_local_steps)``
where ``loss_0`` and ``lr_0`` are the mean training loss and the learning rate at the first
step and ``loss``/``lr`` those at the average. Loss and learning rate are averaged over the
ranks by one all-reduce before the rule is applied, so every rank computes the same period.

Outer optimizer (``outer="nesterov"``, DiLoCo: Douillard et al., "DiLoCo: Distributed Low-Communication
Training of Language Models", 2023): the mean delta ``mean(s - p)`` is a pseudo-gradient, and
``torch.optim.SGD(nesterov=True, lr=outer_lr, momentum=outer_momentum)`` steps the snapshot ``s``
with it (as torchft's DiLoCo does); every rank then takes the new snapshot as its parameters.
Momentum 0 is plain outer SGD (torch's SGD refuses Nesterov without momentum), and with
``outer_lr=1`` averaging; ``outer="average"`` is exactly the averaging above.
``sync_dtype=torch.bfloat16``: the deltas travel in bf16 (half the bytes) and are summed in fp32
(an all-to-all of bf16 chunks, their sum in fp32, an all-gather of the sums in bf16: the bytes of
a bf16 all-reduce), then turned back into the parameters' dtype before they are applied.

Under Join a rank counts in a sync if it took a step of its own since its fragment's last sync:
a rank that ran out of batches brings the work it did before at its fragments' next syncs, then
takes part without counting (it sends zeros); the sum is divided by the ranks that counted
(all-reduced with the sync).

Memory (``offload=True``, the default): the snapshot and the outer momentum of CUDA parameters
live in pinned CPU memory; the flat payload (the pseudo-gradient) exists only while its fragment
syncs.

Streaming (``fragments=F``, Douillard et al., "Streaming DiLoCo with overlapping communication",
2025): the trainable tensors are cut into F fragments of about equal bytes, contiguous in
parameter order (``assign_fragments``), each bucketed on its own. Fragment f is synced after the
steps ``W + (f+1) * K/F + n*K`` (K a multiple of F), so a sync carries 1/F of the model and the
last fragment keeps the unfragmented schedule (``W + K``, ``W + 2K``, ...); the bytes per step
are unchanged. Each fragment has its own snapshot (its parameters at its last sync) and its own
outer momentum: the outer optimizer steps only the snapshots given a pseudo-gradient. Buffers
travel with the last fragment. ``finish()`` syncs every fragment stepped since its last sync.
``F=1`` is the unfragmented sync, bit for bit.

Overlapped (``sync_delay=tau``, ``mixing=alpha``; Streaming DiLoCo's overlap, torchft's
``fragment_sync_delay`` and ``fragment_update_alpha``): a sync's collectives are all launched at
its step and the result is applied tau steps later, each parameter becoming
``alpha * local + (1 - alpha) * synced``; tau < K/F keeps one sync in flight at a time.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import lit_dp.gradients.group as process_groups
from lit_dp import join
from lit_dp.data_parallel import DataParallel
from lit_dp.gradients.broadcast import ddp_ignored, synced_buffers, synced_parameters
from lit_dp.gradients.buckets import assign_fragments, assign_group_by_size, megabytes_to_bytes
from lit_dp.gradients.waiting import UNWATCHED, Waiter
from lit_dp.job.process_group import get_rings
from lit_dp.observability.stats import SyncRecorder, SyncStats
from lit_dp.options import DEFAULT_BUCKET_MB
from lit_dp.options.declare import choice
from lit_dp.options.local_sgd import (
    DEFAULT_OUTER_LR,
    DEFAULT_OUTER_MOMENTUM,
    OUTERS,
    SYNC_DTYPES,
    check_mixing,
    check_outer_lr,
    check_outer_momentum,
)

log = logging.getLogger(__name__)

# Paddle's AdaptiveLocalSGDOptimizer bounds the period to [1, 16].
ADAPTIVE_MIN_LOCAL_STEPS = 1
ADAPTIVE_MAX_LOCAL_STEPS = 16

_DELTA, _MEAN, _FROM_FIRST_RANK = "delta", "mean", "from_first_rank"
_WIRE_DTYPES = dict(zip(SYNC_DTYPES, (torch.bfloat16,)))


def _check_count(option: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{option}={value!r} is invalid: expected an integer >= {low}.")


def _state_device(device: torch.device, offload: bool) -> torch.device:
    """Where the snapshot and the outer momentum of parameters on ``device`` live: the CPU for CUDA
    parameters when ``offload`` (the accelerator's memory is the scarce one), else their own device."""
    return torch.device("cpu") if offload and device.type == "cuda" else device


def _sync_dtype(value: Any) -> torch.dtype | None:
    """None, ``torch.bfloat16`` or its name in ``SYNC_DTYPES`` ("bf16")."""
    if value is None or value in _WIRE_DTYPES.values():
        return value
    if isinstance(value, str) and value in _WIRE_DTYPES:
        return _WIRE_DTYPES[value]
    names = ", ".join(map(repr, SYNC_DTYPES))
    raise ValueError(f"sync_dtype={value!r} is invalid: expected None, torch.bfloat16 or one of {names}.")


class LocalSGD:
    """Periodic model averaging after ``warmup_steps`` data-parallel steps (see the module docstring).

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
        sync_dtype: the dtype the deltas travel in (``"bf16"`` or ``torch.bfloat16``); None: the parameters'.
        fragments: F, sync the model one fragment at a time, one every K/F steps (streaming DiLoCo);
            K must be a multiple of F, and F at most the number of trainable tensors.
        offload: keep the snapshot and the outer momentum of CUDA parameters in (pinned) CPU memory;
            False: on the parameters' device. Parameters elsewhere keep them on their own device.
        sync_delay: tau, inner steps between the start of a sync and its application (its
            all-reduce overlaps them; Streaming DiLoCo, eager updates); below K/F.
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
        self._sync_dtype = _sync_dtype(sync_dtype)
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
        self._warmup_steps = warmup_steps
        self._initial_local_steps = local_steps
        self._adaptive = adaptive
        self._bounds = (min_local_steps, max_local_steps)
        if group is not None:
            self._rings = [group]
        else:  # the model's own communicators (its process_group), else those of init_parallel_env
            self._rings = module.rings if isinstance(module, DataParallel) else get_rings()
        # Across torchft's replica groups (a model under a Manager: lit_dp.fault_tolerance), whose members
        # change from sync to sync: the divisor is the count of those that took part, a failed sync is left
        # undone, the outer step runs even when one group is present (as torchft's DiLoCo), and each group
        # keeps its integer buffers (BatchNorm's counts), as each keeps its buffers under the Manager.
        self._replica_groups = bool(self._rings) and hasattr(self._rings[0], "step_failed")
        if self._replica_groups:
            if sync_delay or self._sync_dtype is not None:
                raise ValueError(
                    f"sync_delay={sync_delay}, sync_dtype={sync_dtype!r} across torchft's replica groups are not "
                    "supported: a sync in flight would cross the next step's quorum, and torchft's groups offer no "
                    "all-to-all for the fp32 sums; expected sync_delay=0 and sync_dtype=None."
                )
            self._rings = [self._rings[0].for_syncs()]
        if comm_buffer_size is not None:
            megabytes_to_bytes("comm_buffer_size", comm_buffer_size)  # checked now, read when the buckets are built
        self._comm_buffer_size = comm_buffer_size
        self._outer = outer
        self._outer_settings = {"lr": outer_lr, "momentum": outer_momentum}
        self._outer_optimizer: torch.optim.SGD | None = None  # over the snapshots, with the buckets
        self._outer_resumed: dict[str, Any] | None = None  # a checkpoint's tensors, until the buckets exist
        inner = module.module if isinstance(module, DataParallel) else module
        # What the model keeps equal across ranks: DDP's ignore list, read when the model was wrapped.
        ignore = module.parameters_to_ignore if isinstance(module, DataParallel) else ddp_ignored(inner)
        self._params = [p for _, p in synced_parameters(inner, ignore) if p.requires_grad]
        self._buffers = [buffer for _, buffer in synced_buffers(inner, ignore)]
        self._param_index = {id(p): index for index, p in enumerate(self._params)}
        self._fragment_indices = assign_fragments([p.numel() * p.element_size() for p in self._params], fragments)
        self._buckets: list[list[_Bucket]] | None = None  # per fragment, built when the local phase starts
        self._step = 0
        # Per fragment, the step of its last sync; before the first, K steps before the first due one.
        self._last_syncs = [warmup_steps - local_steps + (f + 1) * local_steps // fragments for f in range(fragments)]
        self._local_steps = local_steps
        self._loss_0: float | None = None
        self._lr_0: float | None = None
        device = self._params[0].device if self._params else torch.device("cpu")
        self._recorder = SyncRecorder(device)
        self._pending: _PendingSync | None = None  # a sync started, applied sync_delay steps later
        # Per fragment: this rank took a step of its own (not joined) since the fragment's last sync.
        self._trained = [False] * fragments
        self._local_steps_taken = 0  # by this object (not a resumed run's earlier steps): the traffic's denominator
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
        return self._step

    @property
    def local_steps(self) -> int:
        """The current period K (changes only when adaptive)."""
        return self._local_steps

    @property
    def last_average(self) -> int:
        """The step after which the models were last averaged (W before the first average); with
        fragments, the last fragment's last sync (the one the buffers go with)."""
        return self._last_syncs[-1]

    @property
    def fragments(self) -> int:
        """F, the number of fragments synced in turn (1: the whole model at once)."""
        return len(self._fragment_indices)

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
        return self._step >= self._warmup_steps

    def step(self, loss: torch.Tensor | float | None = None, lr: float | None = None, *, joined: bool = False) -> bool:
        """Count one optimizer step; apply a sync started ``sync_delay`` steps ago, and start one (with
        fragments: of one fragment) when the schedule says so, applied now when ``sync_delay`` is 0.
        Returns whether a sync started.

        ``loss`` (this rank's training loss) and ``lr`` are required when adaptive. ``joined``:
        this rank ran out of batches and takes the step with the others (the Trainer's uneven
        inputs): it trained nothing, and its loss does not count.
        """
        self._step += 1
        if not joined:
            self._trained = [True] * self.fragments
        self._local_steps_taken += self._step > self._warmup_steps
        if self._pending is not None and self._step - self._pending.step >= self._sync_delay:
            self._complete()
        agree_first = self._adaptive and self._loss_0 is None
        fragment = self._due_fragment()
        if (agree_first or fragment is not None) and self._data_parallel is not None:
            join.notify(self._data_parallel, (agree_first, fragment))
        if agree_first:
            self._loss_0, self._lr_0 = self._agreed_loss_and_lr(loss, lr, counts=not joined)
        if fragment is not None:
            self._sync(fragment)
            if self._adaptive:
                self._local_steps = self._next_period(*self._agreed_loss_and_lr(loss, lr, counts=not joined))
        self._follow_phase()
        return fragment is not None

    def _due_fragment(self) -> int | None:
        """The fragment whose period ends with this step, if any (at most one: their offsets differ).
        Overdue counts as due: a run resumed with a smaller K syncs at its first step past it (the
        lowest overdue fragment first, one per step), rather than never again."""
        if self._step <= self._warmup_steps:
            return None
        return next((f for f, last in enumerate(self._last_syncs) if self._step - last >= self._local_steps), None)

    def shadow_step(self, agree_first: bool, fragment: int | None) -> None:
        """The collectives of a ``step()`` that the ranks still in take, on a rank that joined
        (``lit_dp.join``): it takes part in the sync of ``fragment`` (None: no sync) without counting
        (it sends zeros), and its loss does not count."""
        if agree_first:
            self._loss_0, self._lr_0 = self._agreed_loss_and_lr(None, None, counts=False)
        if fragment is not None:
            self._sync(fragment, shadow=True)
            if self._adaptive:
                self._local_steps = self._next_period(*self._agreed_loss_and_lr(None, None, counts=False))

    def adopt_schedule_of(self, src: int) -> None:
        """Take global rank ``src``'s schedule (after a Join, whose ranks counted different steps);
        every rank must call it, with parameters already equal on all ranks."""
        if self._world_size < 2:
            return
        if self._pending is not None:  # the ranks stopped stepping: a delayed sync is applied now
            self._complete()
        schedule = [self.state_dict()]
        with self._waiter.outside("the broadcast of the LocalSGD schedule"):
            dist.broadcast_object_list(schedule, src=src, group=self._rings[0])
        self.load_state_dict(schedule[0])

    def finish(self) -> None:
        """Make every rank hold the same model (call when training ends): apply a sync still in flight,
        replacing the parameters whatever ``mixing``, then sync at once, replacing them too, every other
        fragment that took a local step since its last sync, or with ``mixing`` every other fragment
        (its last sync left each rank part of its own)."""
        replaced = None
        if self._pending is not None:
            replaced = self._pending.fragment
            self._complete(keep=0.0)
        due = [
            f
            for f, last in enumerate(self._last_syncs)
            if f != replaced and self._step > self._warmup_steps and (self._step > last or self._mixing)
        ]
        for fragment in due:
            self._sync(fragment, final=True)
        if (due or replaced is not None) and self.fragments > 1 and self._syncs:
            self._after_sync_hooks(shadow=False)  # every fragment now synced and taken: the replicas are equal

    def _sync(self, fragment: int, shadow: bool = False, final: bool = False) -> None:
        """Start the sync of ``fragment`` (with the last, of the buffers too): every rank's parameters
        become their mean over the ranks that take part, or the snapshot stepped by the outer optimizer
        with their mean delta, mixed with the local ones by ``mixing``; applied ``sync_delay`` steps
        later (``_complete``), or now when that is 0 or ``final`` (``finish``: no mixing either).
        ``shadow``: this rank joined (``lit_dp.join``); its model waits for the final broadcast and is
        not compared. This rank's model counts if it took a step of its own since the fragment's last
        sync; a rank that ran out of batches counts once more, with the work it did before, then sends
        zeros and takes the result like the others."""
        self._last_syncs[fragment] = self._step
        participates, self._trained[fragment] = self._trained[fragment], False
        if not self._syncs:
            return
        if self._pending is not None:  # a rank that joined applies its delayed sync lazily: no collective is left
            self._complete()
        if self._buckets is None:
            self._buckets = self._build_buckets()
        began = self._recorder.mark()
        with torch.no_grad():
            reduction = self.reduce_across(self._buckets[fragment], self._rings, participates)
        self._pending = _PendingSync(fragment, self._step, shadow, began, self._recorder.mark(), reduction)
        if self._sync_delay == 0 or final:
            self._complete(keep=0.0 if final else self._mixing)

    def _complete(self, keep: float | None = None) -> None:
        """Wait for the pending sync and apply it; ``keep``: the weight of the local parameters (``mixing``)."""
        pending, self._pending = self._pending, None
        assert pending is not None and self._buckets is not None
        keep = self._mixing if keep is None else keep
        buckets = self._buckets[pending.fragment]
        # Exposed: with a delay, only the wait when it is applied (the compute in between overlapped it).
        waited_from = pending.launched if self._sync_delay == 0 else self._recorder.mark()
        outer = self._outer_optimizer is not None
        with torch.no_grad():
            participants = pending.reduction.wait() if pending.reduction is not None else pending.participants
            if self._replica_groups and self._rings[0].step_failed():
                self._sync_failed(pending, buckets)
                return
            for bucket in buckets:
                if participants:
                    bucket.apply(participants, outer, keep)
                else:
                    bucket.drop()
            if outer and participants:
                # Steps only the snapshots with a pseudo-gradient: this fragment's (and its momentum).
                self._outer_optimizer.step()
                for bucket in buckets:
                    bucket.take_snapshot(keep)
        self._recorder.record(pending.step, sum(bucket.wire_bytes for bucket in buckets), pending.began, waited_from)
        if self.fragments == 1 and not keep:  # else the replicas still differ: see finish()
            self._after_sync_hooks(pending.shadow)

    def _sync_failed(self, pending: _PendingSync, buckets: list[_Bucket]) -> None:
        """A sync across replica groups failed (a group died during it): nothing of it is applied, the
        parameters keep this group's local progress, and the fragment's next sync is its scheduled one
        (the schedule stays every group's), which carries this period's work too. This group's last
        committed step is voided (torchft's count goes back by one): a group whose sync succeeded is
        then ahead, and the next quorum gives this one its state (parameters, snapshot, outer
        momentum, schedule), so no two groups go on apart."""
        for bucket in buckets:
            bucket.drop()
        self._trained[pending.fragment] = True
        self._rings[0].void_last_commit()
        log.debug("LocalSGD: the sync of fragment %d at step %d failed across replica groups", pending.fragment, pending.step)

    def reduce_across(
        self, buckets: list[_Bucket], groups: list[dist.ProcessGroup], participates: bool = True
    ) -> _Reduction:
        """The one cross-rank reduction of a sync: the sum over the ranks of ``groups`` of every bucket's
        payload (the deltas ``s - p``, which divided become the pseudo-gradient; the float buffers; the
        other buffers broadcast from the first rank), left in each bucket's ``payload`` once waited for.
        Bucket i goes on ``groups[i % len(groups)]`` (the rings); every collective is launched here, all
        before any is awaited (a wire dtype, summed in fp32, waits for its exchange of chunks and launches
        the gather of the sums), so that waiting (``_Reduction.wait``) issues none, whenever it comes.
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
            bucket.reduce_chunks(self._waiter)
        return _Reduction(buckets, count, count_work, groups[0], self._waiter)

    def _after_sync_hooks(self, shadow: bool) -> None:
        for hook in self._after_sync:
            hook(self._step, shadow)

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
        held: dict[str, dict[str, int]] = {"snapshot": {}, "momentum": {}, "sync": {}}

        def add(what: str, tensor: torch.Tensor) -> None:
            device = str(tensor.device)
            held[what][device] = held[what].get(device, 0) + tensor.numel() * tensor.element_size()

        for bucket in (bucket for fragment in self._buckets or [] for bucket in fragment):
            if bucket.snapshot is not None:
                add("snapshot", bucket.snapshot)
            for tensor in bucket.in_flight():
                add("sync", tensor)
        for state in self._outer_optimizer.state.values() if self._outer_optimizer is not None else ():
            if state.get("momentum_buffer") is not None:
                add("momentum", state["momentum_buffer"])
        return held

    def sync_stats(self) -> SyncStats | None:
        """The last average's bytes (this rank's payload) and times; None before the first (no wait)."""
        return self._recorder.last()

    def traffic(self) -> dict[str, float]:
        """This object's averages so far (with fragments: fragment syncs), their mean and largest bytes,
        time and exposed time (ms), and bytes per local step it took against data parallelism's (the
        trainable parameters' bytes, which its reducer all-reduces every step); {} before the first average."""
        dp_bytes = float(sum(p.numel() * p.element_size() for p in self._params))
        summary = self._recorder.summary(self._local_steps_taken)
        if summary:
            summary["dp_bytes_per_step"] = dp_bytes
            summary["vs_dp"] = summary["bytes_per_step"] / dp_bytes if dp_bytes else 0.0
        return summary

    def describe_traffic(self) -> str:
        """One line over the averages so far (the Trainer prints it with ``comm_stats``), or "" before any."""
        t = self.traffic()
        if not t:
            return ""
        if self.fragments > 1:
            syncs = (
                f"LocalSGD outer={self._outer}, fragments={self.fragments}: {t['syncs']:.0f} fragment syncs of "
                f"{t['bytes_per_sync'] / 2**20:.3f} MB (at most {t['max_bytes_per_sync'] / 2**20:.3f} MB)"
            )
        else:
            syncs = f"LocalSGD outer={self._outer}: {t['syncs']:.0f} averages of {t['bytes_per_sync'] / 2**20:.3f} MB"
        return (
            f"{syncs}, "
            f"time {t['time_ms']:.3f} ms, exposed {t['exposed_ms']:.3f} ms each (rank 0); "
            f"{t['bytes_per_step'] / 2**20:.4f} MB per local step, {t['vs_dp']:.4f} of data parallelism's "
            f"{t['dp_bytes_per_step'] / 2**20:.3f} MB"
        )

    def state_dict(self) -> dict[str, Any]:
        """The schedule's state: save it with a checkpoint so a resumed run syncs at the same steps.
        Once the local phase has started, also ``outer``: the snapshot (each parameter as its
        fragment was last synced) and, with ``outer="nesterov"``, its momentum (None without), one
        CPU tensor per parameter, the same on every rank. With fragments, each fragment's last sync
        (``last_syncs``). The model's and the inner optimizer's states are not in it: they are each
        rank's own, saved beside it (see docs/local_sgd.md)."""
        state: dict[str, Any] = {
            "step": self._step,
            "last_average": self._last_syncs[-1],
            "fragments": self.fragments,
            "last_syncs": list(self._last_syncs),
            "local_steps": self._local_steps,
            "loss_0": self._loss_0,
            "lr_0": self._lr_0,
        }
        if self._replica_groups:
            state["across_replica_groups"] = True  # the ranks of a group hold one model between syncs
        outer = self._outer_state()
        if outer is not None:
            state["outer"] = outer
        if self._pending is not None:
            state["pending"] = self._pending_state()
        return state

    def _pending_state(self) -> dict[str, Any]:
        """A delayed sync, waited for (which changes no value) and kept pending: its fragment, step, the
        count of ranks that took part and each bucket's sum (CPU), to be applied at the same step after a resume."""
        pending = self._pending
        assert pending is not None and self._buckets is not None
        if pending.reduction is not None:
            pending.participants, pending.reduction = pending.reduction.wait(), None
        return {
            "fragment": pending.fragment,
            "step": pending.step,
            "participants": pending.participants,
            "sums": [bucket.payload.cpu().clone() for bucket in self._buckets[pending.fragment]],  # type: ignore[union-attr]
        }

    def _outer_state(self) -> dict[str, Any] | None:
        if self._buckets is None:
            return self._outer_resumed  # a resumed state not yet taken up: handed on unchanged
        snapshots: list[torch.Tensor | None] = [None] * len(self._params)
        momenta: list[torch.Tensor | None] = [None] * len(self._params)
        optimizer_state = self._outer_optimizer.state if self._outer_optimizer is not None else {}
        for bucket in (bucket for fragment in self._buckets for bucket in fragment):
            if bucket.snapshot is None:
                continue
            momentum = optimizer_state.get(bucket.snapshot, {}).get("momentum_buffer")
            buffers = momentum.split(bucket.numels) if momentum is not None else [None] * len(bucket.numels)
            for tensor, snapshot, buffer in zip(bucket.tensors, bucket.snapshot.split(bucket.numels), buffers):
                index = self._param_index[id(tensor)]
                snapshots[index] = snapshot.detach().cpu().clone()
                momenta[index] = buffer.cpu().clone() if buffer is not None else None
        return {"snapshot": snapshots, "momentum": momenta}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the schedule, and the saved snapshot (and momentum) when the state has them; a state
        without them (saved during warm-up, or before averaging saved its snapshot) snapshots the
        parameters as they are when the local phase starts.

        A fixed period is this object's own ``local_steps``, so a run may resume with another K;
        an adaptive period continues from the saved one. A state without fragments (saved before
        they existed) is one fragment's.
        """
        saved = int(state.get("fragments", 1))
        if saved != self.fragments:
            raise ValueError(
                f"the LocalSGD state was saved with fragments={saved}, this LocalSGD has fragments={self.fragments}: "
                "each fragment's last sync and snapshot are its own; expected the same fragments as the saved run."
            )
        self._step = int(state["step"])
        self._last_syncs = [int(last) for last in state.get("last_syncs", [state["last_average"]])]
        self._trained = [self._step > last for last in self._last_syncs]  # as every rank that has batches
        self._local_steps = int(state["local_steps"]) if self._adaptive else self._initial_local_steps
        self._loss_0 = state.get("loss_0")
        self._lr_0 = state.get("lr_0")
        self._outer_resumed = state.get("outer")
        self._buckets = None
        self._pending = None
        self._follow_phase()
        saved_pending = state.get("pending")
        if saved_pending is not None and self._buckets is not None:
            buckets = self._buckets[saved_pending["fragment"]]
            for bucket, saved_sum in zip(buckets, saved_pending["sums"], strict=True):
                bucket.payload = saved_sum.to(bucket.device)
            mark = self._recorder.mark()
            self._pending = _PendingSync(
                saved_pending["fragment"], saved_pending["step"], False, mark, mark, None, saved_pending["participants"]
            )

    def _follow_phase(self) -> None:
        """After the schedule moved: the model synchronises gradients during warm-up only (it is told,
        and keeps that itself), and the snapshot is taken as the local phase starts."""
        if self._data_parallel is not None:
            self._data_parallel.keep_gradients_local(self.in_local_phase)
        if self.in_local_phase and self._buckets is None and self._syncs:
            # The snapshot must be taken while every rank holds the same parameters: now.
            self._buckets = self._build_buckets()

    def _build_buckets(self) -> list[list[_Bucket]]:
        """Each fragment's buckets (the buffers' with the last), their snapshots taken now (or
        restored), and the outer optimizer over them."""
        float_buffers = [b for b in self._buffers if b.is_floating_point()]
        other_buffers = [b for b in self._buffers if not b.is_floating_point()]
        size = self._comm_buffer_size
        if size is None:  # the model's, tuned by now when "auto" (the warm-up must cover the tuning)
            size = self._data_parallel.comm_buffer_size if self._data_parallel is not None else DEFAULT_BUCKET_MB
        bucket_bytes = megabytes_to_bytes("comm_buffer_size", size)
        fragments: list[list[_Bucket]] = [[] for _ in self._fragment_indices]
        groups = [(f, _DELTA, [self._params[i] for i in indices]) for f, indices in enumerate(self._fragment_indices)]
        last = len(fragments) - 1
        groups += [(last, _MEAN, float_buffers)]
        if not self._replica_groups:
            groups += [(last, _FROM_FIRST_RANK, other_buffers)]
        for fragment, kind, tensors in groups:
            if not tensors:
                continue
            for indices in assign_group_by_size(tensors, [False] * len(tensors), [bucket_bytes]):
                bucket_tensors = [tensors[i] for i in indices]
                state_device = _state_device(bucket_tensors[0].device, self._offload)
                fragments[fragment].append(_Bucket(kind, bucket_tensors, self._sync_dtype, state_device))
        buckets = [bucket for fragment in fragments for bucket in fragment]
        self._outer_optimizer = None
        snapshots = [b.snapshot for b in buckets if b.snapshot is not None]
        if self._outer == "nesterov" and snapshots:
            # Nesterov needs momentum (torch's SGD refuses it without): momentum 0 is plain outer SGD.
            nesterov = self._outer_settings["momentum"] > 0
            self._outer_optimizer = torch.optim.SGD(snapshots, nesterov=nesterov, **self._outer_settings)
        if self._outer_resumed is not None:
            self._restore_outer(buckets, self._outer_resumed)
            self._outer_resumed = None
        return fragments

    def _restore_outer(self, buckets: list[_Bucket], state: dict[str, Any]) -> None:
        """A checkpoint's snapshot and momentum (per parameter) into the buckets' flat tensors."""
        if len(state["snapshot"]) != len(self._params):
            raise ValueError(
                f"the LocalSGD outer state holds {len(state['snapshot'])} parameters, the model "
                f"{len(self._params)}: expected a checkpoint of this model."
            )
        for bucket in buckets:
            if bucket.snapshot is None:
                continue
            indices = [self._param_index[id(t)] for t in bucket.tensors]
            bucket.snapshot.copy_(torch.cat([state["snapshot"][i].reshape(-1) for i in indices]))
            momenta = [state["momentum"][i] for i in indices]
            if self._outer_optimizer is not None and all(m is not None for m in momenta):
                buffer = torch.cat([m.reshape(-1) for m in momenta]).to(bucket.snapshot.device)
                self._outer_optimizer.state[bucket.snapshot]["momentum_buffer"] = buffer

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

    def _next_period(self, loss: float, lr: float) -> int:
        assert self._loss_0 is not None and self._lr_0 is not None
        if self._loss_0 <= 0 or loss < 0 or lr <= 0:
            raise ValueError(
                f"adaptive LocalSGD needs a positive training loss and learning rate: got loss_0={self._loss_0}, "
                f"loss={loss}, lr={lr} (averaged over the ranks)."
            )
        period = math.ceil(math.sqrt(self._lr_0 * loss / (lr * self._loss_0) * self._initial_local_steps))
        low, high = self._bounds
        return min(max(period, low), high)


class _Reduction:
    """A sync's collectives, all launched (``LocalSGD.reduce_across``): ``wait`` issues none."""

    def __init__(
        self, buckets: list[_Bucket], count: torch.Tensor, count_work: dist.Work, group: dist.ProcessGroup, waiter: Waiter
    ) -> None:
        self._buckets, self._count, self._count_work, self._group, self._waiter = buckets, count, count_work, group, waiter

    def wait(self) -> int:
        """Every bucket's sum is in its ``payload``; returns how many ranks took part."""
        for bucket in self._buckets:
            bucket.wait(self._waiter)
        process_groups.wait(self._waiter, self._count_work, self._group, "the LocalSGD count of the ranks taking part")
        return int(self._count.item())


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
    reduction: _Reduction | None
    participants: int = 0


class _Bucket:
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
        self.snapshot = _state_copy(self._gather(), state_device or self.device) if kind == _DELTA else None
        self.wire = wire if kind == _DELTA and wire is not None and wire != self.dtype else None
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
        if not participates and self.kind != _FROM_FIRST_RANK:
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
        if self.kind == _FROM_FIRST_RANK:
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
        if self.kind == _MEAN:
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
