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
started, ``state_dict`` gathers every other rank's model and optimizer states, and its own part of
LocalSGD's state (``LocalSGD.rank_state_dict``: error feedback's residuals), to rank 0
(``replicas``, one entry per global rank, CPU tensors), which writes them in the one checkpoint
file; a resumed run hands each rank its own before its first training step (Fabric: as
``fabric.load`` restores the entry, after the model and optimizers). A checkpoint without them
(written before they existed, or by another number of ranks) resumes every rank from rank 0's,
with a warning, as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from typing_extensions import override

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
        self._replica: dict[str, Any] | None = None  # this rank's model and optimizer states, until restored

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
        # The first forward after a resume: Lightning has restored rank 0's model and optimizer
        # states by now (the optimizers' after setup), so this rank's own replace them here.
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

    @override
    def state_dict(self) -> dict[str, Any] | None:
        """``LocalSGD.state_dict()``, and in the local phase ``replicas``: every rank's model and optimizer
        states, gathered to global rank 0 (a collective: every rank calls it, as every rank saves)."""
        if self._local_sgd is None:
            return None
        state = self._local_sgd.state_dict()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and self._replicas_differ(state):
            state[_REPLICAS] = self._gather_replicas()
        return state

    @override
    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """A Trainer's resume: applied when setup builds the averager, and this rank's model and optimizer
        states, when the checkpoint has them, at its first training step (``restore_replica``). A running
        averager (``fabric.load``, after the model and optimizers; or a peer replica group's state under
        fault tolerance) takes it at once, this rank's own model and optimizer states with it."""
        self._replica = None if state is None else self._own_replica(state)
        schedule = None if state is None else {key: value for key, value in state.items() if key != _REPLICAS}
        if self._local_sgd is None or schedule is None:
            self._resumed = schedule  # the others' states go
            return
        log.debug("LocalSGD: schedule restored from the checkpoint")
        self._local_sgd.load_state_dict(schedule)
        self._resumed = None
        self.restore_replica()

    def _own_replica(self, state: dict[str, Any]) -> dict[str, Any] | None:
        """This rank's model and optimizer states in a checkpoint's entry, when they differ from rank 0's
        and the checkpoint has them (a warning says why not otherwise)."""
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if world_size == 1 or not self._replicas_differ(state):
            return None
        replicas = state.get(_REPLICAS)
        if replicas is None:
            rank_zero_warn(
                f"LocalSGD: the checkpoint was written at optimizer step {state['step']}, in the local phase, "
                "without every rank's model and optimizer state (a checkpoint from before lit_dp kept them): every "
                "rank resumes from rank 0's, and the other ranks' work since their last sync is lost.",
                category=LitDPWarning,
            )
            return None
        if replicas["world_size"] != world_size:
            rank_zero_warn(
                f"LocalSGD: the checkpoint holds the states of {replicas['world_size']} ranks, this run has "
                f"{world_size}: every rank resumes from rank 0's model and optimizer state.",
                category=LitDPWarning,
            )
            return None
        return replicas["ranks"].get(dist.get_rank())  # none for rank 0: the checkpoint's own

    def restore_replica(self) -> None:
        """Load this rank's own model and optimizer states from the checkpoint being resumed, once, after the
        front door restored rank 0's (the Trainer calls it before the first training step; a Fabric loop
        after loading the model and optimizers)."""
        if self._replica is None or self._run is None or self._run.model is None:
            return
        replica, self._replica = self._replica, None
        self._run.model.module.load_state_dict(replica["model"])
        for optimizer, optimizer_state in zip(self._optimizer_list(), replica["optimizers"], strict=True):
            optimizer.load_state_dict(optimizer_state)
        if "local_sgd" in replica and self.local_sgd is not None:  # its error-feedback residuals
            self.local_sgd.load_rank_state_dict(replica["local_sgd"])
        log.debug("LocalSGD: this rank's own model and optimizer states restored from the checkpoint")

    def _replicas_differ(self, state: dict[str, Any]) -> bool:
        """Past warm-up every rank holds its own model and inner optimizer state; across torchft's replica
        groups not: the ranks of one group train as one between syncs, and its checkpoint is its own."""
        return int(state["step"]) > self._options.warmup_steps and not state.get("across_replica_groups", False)

    def _optimizer_list(self) -> list[Any]:
        trainer = self._run.trainer if self._run is not None else None
        return list(trainer.optimizers) if trainer is not None else self._optimizers

    def _gather_replicas(self) -> dict[str, Any] | None:
        """Every rank's model and optimizer states as CPU tensors on global rank 0 (None elsewhere), by
        global rank, rank 0's left out: the checkpoint holds it already."""
        assert self._run is not None and self._run.model is not None
        rank, world_size = dist.get_rank(), dist.get_world_size()
        own = None
        if rank != 0:
            states = {
                "model": self._run.model.module.state_dict(),
                "optimizers": [optimizer.state_dict() for optimizer in self._optimizer_list()],
                "local_sgd": self.local_sgd.rank_state_dict() if self.local_sgd is not None else {},
            }
            own = apply_to_collection(states, torch.Tensor, lambda t: t.detach().cpu())
        gathered: list[Any] | None = [None] * world_size if rank == 0 else None
        with self._run.model.waiter.outside("the gather of every rank's model and optimizer state for a checkpoint"):
            dist.gather_object(own, gathered, dst=0)
        if gathered is None:
            return None
        return {"world_size": world_size, "ranks": {r: s for r, s in enumerate(gathered) if r != 0}}
