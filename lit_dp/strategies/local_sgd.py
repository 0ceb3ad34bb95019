"""LocalSGD's schedule: ``local_sgd_steps`` as a feature (``lit_dp.strategies.feature``), for both doors.

The averager (``lit_dp.LocalSGD``) is built over the wrapped model when a fit is set up (under
Fabric: when ``fabric.setup`` wraps the model), steps after each optimizer step (automatic and
manual optimization alike, and each ``optimizer.step()`` of a Fabric loop; accumulated
micro-batches do not count), finishes when training ends (Fabric: ``fabric.strategy.teardown()``),
and keeps its state in the strategy's checkpoint entry (``local_sgd``: whatever
``LocalSGD.state_dict`` returns, plus ``replicas``), so a resumed fit goes on with it. A Trainer loads a checkpoint
before the averager exists, ``fabric.load`` after: either way the state reaches it before the next step.

Between syncs the replicas differ, and rank 0's model and optimizer state, which the checkpoint
holds as any Lightning checkpoint does, are not the job's state. So once the local phase has
started, each rank's entry holds ``replicas``: the world size, and under ``ranks`` this rank's own
model and inner optimizer states (rank 0's are the checkpoint's own) with ``LocalSGD.rank_state_dict()``,
as ``RankEntries`` (``lit_dp.checkpoint.tree``): no rank gathers another's; the checkpoint's writer
puts every rank's in the file, or each rank writes its own into the sharded folder. A resumed run
hands each rank its own before its first training step (Fabric: as ``fabric.load`` restores the
entry, after the model and optimizers). A resume with another number of ranks goes on from what
exists, and rank 0 says in one line what was lost: rank r takes old rank r's state where there is
one; a rank the checkpoint had none of starts from the last sync's model with rank 0's optimizer
state; the local steps of old ranks beyond the new world size since the last sync are lost. A
checkpoint written before the replicas were kept resumes every rank from rank 0's, with a warning.
Across torchft's replica groups the ranks of a group hold its model, and ``replicas`` holds only what
``LocalSGD.rank_state_dict()`` gives (with error feedback, each rank's residuals, of its own shard).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lit_dp.checkpoint.tree import RANKS, RankEntries
from lit_dp.local_sgd import LocalSGD
from lit_dp.options import Options
from lit_dp.options.local_sgd import LocalSGDOptions
from lit_dp.options.warning import LitDPWarning
from lit_dp.strategies.feature import Feature, Run

log = logging.getLogger(__name__)

_REPLICAS = "replicas"


class LocalSGDSchedule(Feature):
    """The averager while fitting with ``local_sgd_steps`` (``local_sgd``), and its state, every rank's, in checkpoints."""

    key = "local_sgd"
    exposes = {"local_sgd": None}  # strategy.local_sgd, None without local_sgd_steps
    shared_by_replicas = True  # across torchft's replica groups a recovering one takes a peer's schedule and snapshot

    def __init__(self, options: LocalSGDOptions) -> None:
        self._options = options
        self._local_sgd: LocalSGD | None = None  # from setup to teardown
        self._run: Run | None = None  # from setup to teardown: the model and (Trainer) optimizers
        self._optimizers: list[Any] = []  # Fabric's, as each is set up
        self._resumed: dict[str, Any] | None = None  # from the checkpoint, until setup
        self._replica: dict[str, Any] | None = None  # what this rank restores at its first step (_resumed_replica)

    @classmethod
    @override
    def build(cls, options: Options) -> LocalSGDSchedule | None:
        return cls(options.local_sgd) if options.local_sgd.steps is not None else None

    @property
    def local_sgd(self) -> LocalSGD | None:
        """The averager (``lit_dp.LocalSGD``: its schedule, ``sync_count``, ``state_dict()``) while fitting with
        ``local_sgd_steps``, from setup to teardown; None before and after, and without the option."""
        return self._local_sgd

    @override
    def setup(self, run: Run) -> None:
        if run.model is None or not run.fitting:
            return
        if self._local_sgd is not None:  # Fabric: a second model set up in the same run
            raise ValueError(
                f"local_sgd_steps={self._options.steps} averages one model, and fabric.setup was given a second one "
                "before fabric.strategy.teardown(): expected one model per run, or lit_dp.LocalSGD(model, ...) "
                "over each model in your loop (docs/local_sgd.md)."
            )
        options = self._options
        if options.adaptive and run.trainer is not None and not run.trainer.lightning_module.automatic_optimization:
            raise ValueError(
                "local_sgd_adaptive=True is not supported with manual optimization: the adaptive period needs the "
                "training loss, which only automatic optimization hands to the strategy. Use a fixed local_sgd_steps."
            )
        self._run = run
        self._local_sgd = LocalSGD(
            run.model,
            options.steps,
            options.warmup_steps,
            adaptive=options.adaptive,
            comm_buffer_size=None,  # the model's when the local phase starts: with "auto", the tuned size
            outer=options.outer,
            outer_lr=options.outer_lr,
            outer_momentum=options.outer_momentum,
            sync_dtype=options.sync_dtype,
            error_feedback=options.error_feedback,
            fragments=options.fragments,
            offload=options.offload,
            sync_delay=options.sync_delay,
            mixing=options.mixing,
        )
        log.debug(
            "LocalSGD on: parameters averaged after optimizer steps (lit_dp.LocalSGD), in %d fragment(s)",
            self._local_sgd.fragments,
        )
        if self._resumed is not None:  # a Trainer's resume: this rank's own states wait for its first step
            log.debug("LocalSGD: schedule restored from the checkpoint")
            self._local_sgd.load_state_dict(self._resumed)
            self._resumed = None

    @override
    def setup_optimizer(self, optimizer: Any) -> Any:
        self._optimizers.append(optimizer)
        return optimizer

    @override
    def training_step(self, step: Callable[[], Any]) -> Any:
        # The first forward after a resume: Lightning has restored the checkpoint's model and optimizer states
        # by now (this rank's own where it holds them, but wrapping the model gave it rank 0's parameters), so
        # this rank's own take their place here.
        self.restore_replica()
        return step()

    @override
    def optimizer_step(self, step: Callable[[Any], Any], optimizer: Any, closure: Any) -> Any:
        output = step(closure)
        if self._local_sgd is not None:
            assert self._run is not None and self._run.features is not None  # both strategies' setup hands them
            loss = output if self._options.adaptive else None
            # Joined: this rank replays the step without a batch (the Trainer's uneven inputs).
            self._local_sgd.step(loss, optimizer.param_groups[0]["lr"], joined=self._run.features.joined)
        return output

    @override
    def on_train_end(self) -> None:
        if self._local_sgd is not None:
            self._local_sgd.finish()

    @override
    def teardown(self) -> None:
        self._local_sgd = None
        self._run = None
        self._optimizers = []
        self._replica = None

    @property
    @override
    def replicas_differ(self) -> bool:
        local_sgd = self.local_sgd
        return local_sgd is not None and _world_size() > 1 and self._past_warmup(local_sgd.step_count, local_sgd.across_replica_groups)

    @override
    def state_dict(self) -> dict[str, Any] | None:
        """``LocalSGD.state_dict()``, and past warm-up ``replicas``: the world size and this rank's own entry (its
        model and optimizer states, rank 0's being the checkpoint's; ``LocalSGD.rank_state_dict()``), no collective.
        Across replica groups only ``LocalSGD.rank_state_dict()`` is a rank's own, and ``replicas`` holds it alone."""
        if self.local_sgd is None:
            return None
        state = self.local_sgd.state_dict()
        if self._in_local_phase(int(state["step"])):
            own = self._own_entry(state)
            if own or self._replicas_differ(state):
                state[_REPLICAS] = {"world_size": _world_size(), RANKS: RankEntries({_rank(): own} if own else {})}
        return state

    def _own_entry(self, state: dict[str, Any]) -> dict[str, Any]:
        """What only this rank holds between syncs: its model and inner optimizers' states (but on rank 0, whose
        are the checkpoint's own, and across replica groups, whose ranks hold their group's) and its
        ``LocalSGD.rank_state_dict()`` (with error feedback, its residuals: across replica groups of several
        ranks, of its own shard of the group's sum). The one place a per-rank state is added."""
        assert self._run is not None and self._run.model is not None and self.local_sgd is not None
        entry: dict[str, Any] = {}
        if _rank() != 0 and self._replicas_differ(state):
            entry["model"] = self._run.model.module.state_dict()
            entry["optimizers"] = [optimizer.state_dict() for optimizer in self._optimizer_list()]
        if own := self.local_sgd.rank_state_dict():
            entry["local_sgd"] = own
        return entry

    @override
    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """A Trainer's resume: applied when setup builds the averager, and this rank's model and optimizer
        states, when the checkpoint has them, at its first training step (``restore_replica``). A running
        averager (``fabric.load``, after the model and optimizers; or a peer replica group's state under
        fault tolerance) takes it at once, this rank's own model and optimizer states with it."""
        self._replica = None if state is None else self._resumed_replica(state)
        schedule = None if state is None else {key: value for key, value in state.items() if key != _REPLICAS}
        if self._local_sgd is None or schedule is None:
            self._resumed = schedule  # the others' states go
            return
        log.debug("LocalSGD: schedule restored from the checkpoint")
        self._local_sgd.load_state_dict(schedule)
        self._resumed = None
        self.restore_replica()

    @override
    def own_replica(self, state: Any) -> dict[str, Any] | None:
        """This rank's model and optimizer states in a checkpoint's entry, where they are its own (not rank 0's)."""
        entry = _entry_of(state, _rank()) if isinstance(state, dict) and self._replicas_differ(state) else None
        return entry if entry is not None and "model" in entry else None

    def _resumed_replica(self, state: dict[str, Any]) -> dict[str, Any] | None:
        """What this rank restores at its first step: its own entry, or ``_LAST_SYNC`` (a rank the checkpoint had
        none of), or None (rank 0's, the checkpoint's own, is all). Rank 0 says what a change of world size lost."""
        world_size = _world_size()
        if not self._replicas_differ(state):
            # Across replica groups a rank's own entry is its LocalSGD state alone (load_rank_state_dict decides
            # whether it is this rank's: a peer group's, sent to a group that heals, is not).
            return _entry_of(state, _rank()) if self._in_local_phase(int(state["step"])) else None
        replicas = state.get(_REPLICAS)
        if replicas is None:
            if world_size > 1:
                rank_zero_warn(
                    f"LocalSGD: the checkpoint was written at optimizer step {state['step']}, in the local phase, "
                    "without every rank's model and optimizer state (a checkpoint from before lit_dp kept them): every "
                    "rank resumes from rank 0's, and the other ranks' work since their last sync is lost.",
                    category=LitDPWarning,
                )
            return None
        saved = int(replicas["world_size"])
        if saved != world_size:
            rank_zero_info(f"[lit_dp] LocalSGD: {_what_a_new_world_size_loses(state, saved, world_size)}")
        if _rank() >= saved:
            return {_LAST_SYNC: True}
        return _entry_of(state, _rank()) or None

    def restore_replica(self) -> None:
        """Load this rank's own model and optimizer states from the checkpoint being resumed, once, after the
        front door restored rank 0's (the Trainer calls it before the first training step; a Fabric loop
        after loading the model and optimizers); a rank the checkpoint had none of takes the last sync's model."""
        if self._replica is None or self._run is None or self._run.model is None or self.local_sgd is None:
            return
        replica, self._replica = self._replica, None
        if replica.get(_LAST_SYNC):
            self.local_sgd.take_last_sync()
            log.debug("LocalSGD: this rank, which the checkpoint had no model of, starts from the last sync's model")
            return
        if "model" in replica:
            self._run.model.module.load_state_dict(replica["model"])
            for optimizer, optimizer_state in zip(self._optimizer_list(), replica["optimizers"], strict=True):
                optimizer.load_state_dict(optimizer_state)
        self.local_sgd.load_rank_state_dict(replica.get("local_sgd", {}))
        log.debug("LocalSGD: this rank's own state restored from the checkpoint (%s)", ", ".join(replica) or "nothing")

    def _replicas_differ(self, state: dict[str, Any]) -> bool:
        return self._past_warmup(int(state["step"]), bool(state.get("across_replica_groups", False)))

    def _in_local_phase(self, step: int) -> bool:
        return step > self._options.warmup_steps

    def _past_warmup(self, step: int, across_replica_groups: bool) -> bool:
        """Past warm-up every rank holds its own model and inner optimizer state; across torchft's replica
        groups not: the ranks of one group train as one between syncs, and its checkpoint is its own."""
        return self._in_local_phase(step) and not across_replica_groups

    def _optimizer_list(self) -> list[Any]:
        trainer = self._run.trainer if self._run is not None else None
        return list(trainer.optimizers) if trainer is not None else self._optimizers


_LAST_SYNC = "last_sync"  # a resumed rank that the checkpoint has no model of: it takes the last sync's


def _what_a_new_world_size_loses(state: dict[str, Any], saved: int, world_size: int) -> str:
    """One line: what a resume at ``world_size`` ranks takes from a checkpoint of ``saved`` ranks between syncs."""
    step, last = int(state["step"]), int(state["last_average"])
    where = f"the checkpoint holds {saved} ranks' models at step {step}, between syncs (the last after step {last}), this run has {world_size}"
    kept = f"{_ranks(0, min(saved, world_size))} resume{'s' if min(saved, world_size) == 1 else ''} {'its' if min(saved, world_size) == 1 else 'their'} own"
    if world_size < saved:
        return f"{where}: {kept}; the local steps of {_ranks(world_size, saved)} since step {last} are lost."
    start = "the model of the last sync" if state.get("outer") is not None else "rank 0's model"
    return (
        f"{where}: {kept}; {_ranks(saved, world_size)} start{'s' if world_size - saved == 1 else ''} from {start} "
        "with rank 0's optimizer state; nothing is lost."
    )


def _ranks(low: int, high: int) -> str:
    return f"rank {low}" if high - low == 1 else f"ranks {low}-{high - 1}"


def _entry_of(state: dict[str, Any], rank: int) -> dict[str, Any] | None:
    """A rank's entry under ``replicas``; a sharded checkpoint's keys come back as strings."""
    ranks = (state.get(_REPLICAS) or {}).get(RANKS) or {}
    return ranks.get(rank, ranks.get(str(rank)))


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
