"""``fault_tolerance="torchft"``: the Trainer's and Fabric's side of live fault tolerance.

Each replica group is a Lightning job (its launcher's: one device, a node or several), each of
its ranks with a torchft ``Manager`` of the group; the groups meet at torchft's lighthouse
(docs/fault_tolerance.md). A step here:

1. starts with the Manager's quorum, synchronously (``use_async_quorum=False``), before any data
   is read: a replica that is behind (restarted, or that discarded a step its peers committed)
   receives a healthy peer's state there, through torchft's checkpoint transport, and loads it
   at this clean point, between steps;
2. reads this rank's slice of the step's samples (``lit_dp.fault_tolerance.replica_data.ReplicaBatches``:
   its place among every rank of the replica groups present);
3. runs forward and backward: ``lit_dp.DataParallel(manager=...)`` all-reduces across the
   replica groups (``lit_dp.fault_tolerance.replica_group``; a group of several ranks reduces
   inside itself first, ``lit_dp.fault_tolerance.hierarchical``);
4. asks ``Manager.should_commit``; only then does the optimizer step. A discarded step changes
   no parameter, no optimizer state and no data position: the Trainer counts it like a step its
   gradient scaler skips (global step and learning-rate schedule move on alike on every replica).

What a recovering replica receives: the parameters and buffers, every optimizer's (and, under
the Trainer, LR scheduler's and precision plugin's) state, the Trainer's loop counters (epoch,
batches, optimizer steps; as they were at the start of the peer's step when the replica takes them
in at the start of its own, which its loop then counts), the data position, and torchft's own step
count. What it does not: callbacks' state, RNG states, anything a LightningModule keeps outside its
``state_dict``.

What users see: one line per change of the groups training, on every group ("replica group 0
left at step 31; 2 train (1, 2)"), and on a group that comes back, that it recovered; torchft's
own log lines (a failure's tracebacks among them) go to a file of the run, which the first line
names. A group that finds no quorum ends and says why (``QuorumUnreachable``). After the last
step the Trainer asks for one more quorum, so that every group ends with the same state.

The settings come from the options (``lit_dp.options.fault_tolerance``) or from torchft's launch
variables: ``ft_lighthouse`` (a config's ``strategy.ft.lighthouse``) or ``TORCHFT_LIGHTHOUSE``,
``ft_replica_group`` or ``REPLICA_GROUP_ID``. The Manager and what users see of it are the engine's
(``lit_dp.fault_tolerance.manager.FaultTolerance``); this module is what the Trainer and Fabric add:
the steps' data, the Trainer's loop counters in the state sent, the last quorum after the last step.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.data import DataLoader
from typing_extensions import override

from lit_dp.fault_tolerance.manager import LINE, FaultTolerance
from lit_dp.fault_tolerance.replica_data import ReplicaBatches
from lit_dp.options import Options
from lit_dp.strategies.feature import Feature, Features, Run
from lit_dp.strategies.lightning_private import (
    batches_that_stepped,
    restore_batches_that_stepped,
)

log = logging.getLogger(__name__)


def replica_batches(dataloader: object, accumulate: int, seed: int) -> ReplicaBatches:
    """The training ``dataloader`` as ``ReplicaBatches``: its dataset, batch size, collate function and
    order (a ``DistributedSampler``'s ``shuffle`` and ``seed``, a ``RandomSampler``'s shuffle with
    ``seed``); or a ``ValueError`` saying why it cannot be dealt step by step."""
    if not isinstance(dataloader, DataLoader):
        raise ValueError(
            f"fault_tolerance='torchft' deals the training data step by step to the replica groups present: expected "
            f"a torch DataLoader over a map-style dataset, got {type(dataloader).__name__}."
        )
    sampler = dataloader.sampler
    if dataloader.batch_size is None or not hasattr(dataloader.dataset, "__len__"):
        raise ValueError(
            f"fault_tolerance='torchft' with a DataLoader of {type(dataloader.dataset).__name__} "
            f"(batch_size={dataloader.batch_size}) is not supported: expected a map-style dataset and a batch_size."
        )
    shuffle = isinstance(sampler, torch.utils.data.RandomSampler) or bool(getattr(sampler, "shuffle", False))
    if dataloader.num_workers:
        rank_zero_info(
            f"{LINE}: the training batches are read in this process at each step's start, once the quorum says which "
            f"samples are this replica's (num_workers={dataloader.num_workers} is not used for them)"
        )
    return ReplicaBatches(
        dataloader.dataset,
        dataloader.batch_size,
        shuffle=shuffle,
        seed=int(getattr(sampler, "seed", seed)),
        collate_fn=dataloader.collate_fn,
        accumulate=accumulate,
    )


def watch_traffic(fault_tolerance: FaultTolerance, run: Run) -> None:
    """The cross-group traffic of the run's model, for the ``ft/*`` metrics and the run's last line."""
    group = run.model.process_group if run.model is not None else None
    traffic = getattr(group, "traffic", None)
    if traffic is not None:
        fault_tolerance.watch(traffic)


class PendingBatch:
    """What the Trainer's training loader yields under fault tolerance: Lightning fetches one batch
    ahead, before the step's quorum, so the batch itself is read in ``batch_to_device``."""


class PendingBatches:
    """Endless ``PendingBatch`` es; the epoch ends when the data's does (``TrainerFaultTolerance``)."""

    def __iter__(self) -> Iterator[PendingBatch]:
        while True:
            yield PendingBatch()


class FaultToleranceFeature(Feature):
    """What both strategies' fault tolerance shares: the replica group's ``FaultTolerance`` (``ft``),
    built when the option is on, closed at teardown."""

    key = "fault_tolerance"
    exposes = {"fault_tolerance": None}

    def __init__(self, fault_tolerance: FaultTolerance) -> None:
        self.ft = fault_tolerance
        self._restored: dict[str, Any] = {}  # from a checkpoint, each part until what it restores exists

    @property
    def fault_tolerance(self) -> FaultTolerance:
        """``strategy.fault_tolerance`` (None without the option): its ``committed_steps``, ``metrics()``, ``manager``."""
        return self.ft

    @classmethod
    @override
    def build(cls, options: Options) -> FaultToleranceFeature | None:
        # The settings are checked here, as the strategy is built; the Manager starts with the run.
        return cls(FaultTolerance(options)) if options.fault_tolerance else None

    @override
    def teardown(self) -> None:
        self.ft.close()

    @override
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps (a whole-job restart resumes from it): torchft's step count, the data position."""
        batches = self.ft.batches
        return {
            "manager": self.ft.manager.state_dict() if self.ft.manager is not None else None,
            "data": batches.state_dict() if batches is not None else None,
        }

    @override
    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """From a checkpoint (the Trainer's resume, before ``setup``; ``fabric.load``, usually after ``fabric.setup``
        and ``setup_dataloaders``): torchft's step count into the Manager and the data position into the training
        loader's batches, each now if it exists, else when it is set up (``_apply_restored``)."""
        self._restored = {name: part for name, part in (state or {}).items() if part is not None}
        self._apply_restored()

    def _apply_restored(self) -> None:
        if "manager" in self._restored and self.ft.manager is not None:
            self.ft.manager.load_state_dict(self._restored.pop("manager"))
        if "data" in self._restored and self.ft.batches is not None:
            self.ft.batches.load_state_dict(self._restored.pop("data"))


class TrainerFaultTolerance(FaultToleranceFeature):
    """The Trainer's glue: the data, the step gate, the loop state, and the ``ft/*`` metrics."""

    def __init__(self, fault_tolerance: FaultTolerance) -> None:
        super().__init__(fault_tolerance)
        self._trainer: pl.Trainer | None = None  # from setup
        self._step_start_loops: dict[str, Any] | None = None  # the loop counters as the step in progress started
        self._starting_step = False  # in the step's quorum, before the loop counts the step's first batch
        self._peers_step_ends_epoch = False  # the step a peer was in when this rank took its state in ends the epoch

    @override
    def wrapper_arguments(self, run: Run, arguments: dict[str, Any]) -> dict[str, Any]:
        """The Manager, started before the model it wraps; its log in the run's folder."""
        assert run.trainer is not None
        strategy = run.strategy
        protocol = self.ft.start(strategy.root_device, strategy.global_rank, strategy.world_size, run.trainer.default_root_dir)
        return {**arguments, "manager": protocol}

    @override
    def setup(self, run: Run) -> None:
        """After the optimizers exist: what travels to a recovering replica; the callback."""
        self._trainer = trainer = run.trainer
        if trainer is None or not run.fitting:
            return
        watch_traffic(self.ft, run)
        features = run.features
        self.ft.track(
            lambda: _trainer_state(trainer, self.ft.batches, features, self._step_start_loops, self._step_ends_epoch()),
            lambda state: self._load_state(trainer, features, state),
        )
        self._apply_restored()
        trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, _FaultToleranceCallback)]
        trainer.callbacks.append(_FaultToleranceCallback(self.ft, lambda: self._peers_step_ends_epoch))

    @override
    def teardown(self) -> None:
        super().teardown()
        self._trainer = None

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        """The training loader, dealt step by step to the replica groups present."""
        trainer = self._trainer
        if trainer is None or not trainer.training:
            return dataloader
        if isinstance(trainer.val_check_interval, float) and trainer.val_check_interval != 1.0:
            raise ValueError(
                f"fault_tolerance='torchft' with trainer.val_check_interval={trainer.val_check_interval} is invalid: the "
                "replicas present decide how many steps an epoch takes, so the training loader has no length; expected "
                "an int (steps) or 1.0 (each epoch's end)."
            )
        for owner in (trainer.lightning_module, trainer.datamodule):
            if owner is not None and is_overridden("on_before_batch_transfer", owner):
                raise ValueError(
                    f"fault_tolerance='torchft' with {type(owner).__name__}.on_before_batch_transfer is not supported: "
                    "the training batch is read only at the step's start, once its quorum is in (Lightning fetches "
                    "a batch ahead); expected the transform in on_after_batch_transfer."
                )
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        previous, self.ft.batches = self.ft.batches, replica_batches(dataloader, trainer.accumulate_grad_batches, seed)
        if previous is not None:  # a reloaded loader goes on where the previous one was
            self.ft.batches.load_state_dict(previous.state_dict())
        self._apply_restored()  # a checkpoint's position
        return PendingBatches()

    @override
    def batch_to_device(self, batch: Any) -> Any:
        """The step's quorum, then its data."""
        trainer = self._trainer
        if trainer is None or not isinstance(batch, PendingBatch):
            return batch
        assert self.ft.batches is not None
        if trainer.fit_loop.epoch_loop.batch_progress.current.ready % trainer.accumulate_grad_batches == 0:
            self._step_start_loops = _loop_counters(trainer.fit_loop)
            self._starting_step, self._peers_step_ends_epoch = True, False
            try:
                self.ft.start_step()
            finally:
                self._starting_step = False
        # What Lightning did to the placeholder, done to the batch: the precision plugin's conversion.
        return trainer.precision_plugin.convert_input(self.ft.batches.next_batch())

    def _load_state(self, trainer: pl.Trainer, features: Features | None, state: dict[str, Any]) -> None:
        """A peer's state (or, in a group that healed, its rank 0's), taken in. The loop counters are the
        peer's at the point of the step this rank is at: a peer's state is made where its quorum is, at the
        start of a step (``batch_to_device``, before the loop counts the step's batch) or inside one (a
        LocalSGD sync in its optimizer step, after the loop counted the batch and the optimizer step as
        begun). A rank that takes it in at the start of its step, whose loop then counts the step's batch
        and optimizer step itself (a restarted group that meets its peers at their sync, and ends their
        step with them), takes the peer's counters from its step's start, and whether that step ends the
        data's epoch (its own plan is the next step's); a rank inside its step that takes the state of a peer
        after its last step (a group left out of its last sync meets its peers at their quorum after the
        last step), the peer's counters from its last step's start moved on as far as this rank's own have
        moved in this step (so the loop ends that step where the peer's ended, at ``max_steps``); any other
        rank, which meets the peer where it is, the peer's counters as they are."""
        if self._starting_step:
            loops = state["loops_at_step_start"]
        elif self.ft.protocol.peer_after_last_step and self._step_start_loops is not None:
            loops = _moved_on(state["loops_at_step_start"], self._step_start_loops, _loop_counters(trainer.fit_loop))
        else:
            loops = state["loops"]
        _load_trainer_state(trainer, self.ft.batches, features, {**state, "loops": loops})
        self._step_start_loops = state["loops_at_step_start"]
        self._peers_step_ends_epoch = self._starting_step and state["step_ends_epoch"]

    def _step_ends_epoch(self) -> bool:
        """Whether the step this rank is in ends the data's epoch once committed, for a rank that takes its
        state in there: its plan's; at the start of a step (where a healed group's rank 0 hands its state to
        its other ranks), that of the peers' step it took in, if any."""
        if self._starting_step:
            return self._peers_step_ends_epoch
        return self.ft.batches is not None and self.ft.batches.step_ends_epoch()

    @override
    def optimizer_step(self, step: Callable[[Any], Any], optimizer: Any, closure: Any) -> Any:
        """``step(closure)`` (the strategy's optimizer step), applied only if every replica group commits it."""

        def commit_or_discard() -> Any:
            result = closure()  # forward and backward: the all-reduces ran
            if not self.ft.commit():
                raise _Discarded
            return result

        try:
            return step(commit_or_discard)
        except _Discarded:
            return None


class _FaultToleranceCallback(pl.Callback):
    """The epoch's end when the data's ends, the reconciling quorum after the last step, the ``ft/*`` metrics."""

    def __init__(self, fault_tolerance: FaultTolerance, peers_step_ends_epoch: Callable[[], bool]) -> None:
        self.ft = fault_tolerance
        self.peers_step_ends_epoch = peers_step_ends_epoch

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        batches = self.ft.batches
        stepped = trainer.fit_loop.epoch_loop.batch_progress.current.ready % trainer.accumulate_grad_batches == 0
        if self.ft.in_peers_step:  # the end of the peers' step, which they committed: its epoch end is theirs
            ends_epoch = stepped and self.peers_step_ends_epoch()
        else:
            ends_epoch = stepped and self.ft.last_committed and batches is not None and batches.step_ends_epoch()
        if ends_epoch:
            # The data's epoch is complete: end Lightning's too (as a training_step's -1 does).
            trainer.fit_loop.epoch_loop.batch_progress.is_last_batch = True
        if stepped and _last_step(trainer, bool(ends_epoch)):
            self.ft.reconcile()  # before the fit's last validation and checkpoint see the state
        if stepped:
            pl_module.log_dict(self.ft.metrics(), on_step=True, on_epoch=False, batch_size=1)


def _last_step(trainer: pl.Trainer, ends_epoch: bool) -> bool:
    """Whether the step just taken is the fit's last (``max_steps``, or the last epoch's end)."""
    if trainer.max_steps != -1 and trainer.global_step >= trainer.max_steps:
        return True
    return ends_epoch and trainer.max_epochs not in (None, -1) and trainer.current_epoch + 1 >= trainer.max_epochs


class _Discarded(Exception):
    """Raised out of the optimizer's closure so that the optimizer does not step."""


def _loop_counters(fit_loop: Any) -> dict[str, Any]:
    epoch_loop = fit_loop.epoch_loop
    return {
        "epoch_progress": fit_loop.epoch_progress.state_dict(),
        "batch_progress": epoch_loop.batch_progress.state_dict(),
        "scheduler_progress": epoch_loop.scheduler_progress.state_dict(),
        "optim_progress": epoch_loop.automatic_optimization.optim_progress.state_dict(),
        "manual_progress": epoch_loop.manual_optimization.optim_step_progress.state_dict(),
        "batches_that_stepped": batches_that_stepped(epoch_loop),
    }


def _moved_on(start: Any, own_start: Any, own_now: Any) -> Any:
    """``start`` (loop counters, nested dicts of counts) moved on by what this rank counted since ``own_start``:
    each count ``start + own_now - own_start``; any other value (a flag) this rank's own now."""
    if isinstance(start, dict):
        return {key: _moved_on(start[key], own_start[key], own_now[key]) for key in start}
    if isinstance(start, int) and not isinstance(start, bool):
        return start + own_now - own_start
    return own_now


def _load_loop_counters(fit_loop: Any, counters: dict[str, Any]) -> None:
    epoch_loop = fit_loop.epoch_loop
    fit_loop.epoch_progress.load_state_dict(counters["epoch_progress"])
    epoch_loop.batch_progress.load_state_dict(counters["batch_progress"])
    epoch_loop.scheduler_progress.load_state_dict(counters["scheduler_progress"])
    epoch_loop.automatic_optimization.optim_progress.load_state_dict(counters["optim_progress"])
    epoch_loop.manual_optimization.optim_step_progress.load_state_dict(counters["manual_progress"])
    restore_batches_that_stepped(epoch_loop, counters["batches_that_stepped"])


def _trainer_state(
    trainer: pl.Trainer,
    batches: ReplicaBatches | None,
    features: Features | None,
    step_start_loops: dict[str, Any] | None,
    step_ends_epoch: bool,
) -> dict[str, Any]:
    loops = _loop_counters(trainer.fit_loop)
    return {
        "features": features.replica_state() if features is not None else {},
        "model": trainer.lightning_module.state_dict(),
        "optimizers": [optimizer.state_dict() for optimizer in trainer.optimizers],
        "schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
        "precision": trainer.precision_plugin.state_dict(),
        "loops": loops,
        "loops_at_step_start": step_start_loops if step_start_loops is not None else loops,
        "data": batches.state_dict() if batches is not None else None,
        "step_ends_epoch": step_ends_epoch,
    }


def _load_trainer_state(
    trainer: pl.Trainer, batches: ReplicaBatches | None, features: Features | None, state: dict[str, Any]
) -> None:
    trainer.lightning_module.load_state_dict(state["model"])
    for optimizer, optimizer_state in zip(trainer.optimizers, state["optimizers"]):
        optimizer.load_state_dict(optimizer_state)
    for config, scheduler_state in zip(trainer.lr_scheduler_configs, state["schedulers"]):
        config.scheduler.load_state_dict(scheduler_state)
    trainer.precision_plugin.load_state_dict(state["precision"])
    _load_loop_counters(trainer.fit_loop, state["loops"])
    if batches is not None and state["data"] is not None:
        batches.load_state_dict(state["data"])
    if features is not None:  # after the model: LocalSGD's snapshot is taken against the parameters loaded
        features.load_replica_state(state.get("features", {}))


class FabricFaultTolerance(FaultToleranceFeature):
    """Fabric's glue: a step starts when the training loader yields its batch (the quorum, then the
    data) and is applied by ``optimizer.step()`` only if it commits. One optimizer step per batch."""

    def __init__(self, fault_tolerance: FaultTolerance) -> None:
        super().__init__(fault_tolerance)
        self.modules: list[torch.nn.Module] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        self._features: Features | None = None  # the strategy's, for the state they share across groups

    @override
    def wrapper_arguments(self, run: Run, arguments: dict[str, Any]) -> dict[str, Any]:
        """The Manager and its commit protocol, started with the first module set up; what a recovering
        replica receives."""
        if self.ft.manager is None:
            strategy = run.strategy
            self.ft.start(strategy.root_device, strategy.global_rank, strategy.world_size)
            self.ft.track(self._state, self._load)
            self._apply_restored()
        return {**arguments, "manager": self.ft.protocol}

    @override
    def setup(self, run: Run) -> None:
        if run.model is not None:  # the module travels (without the wrapper)
            self.modules.append(run.model.module)
            watch_traffic(self.ft, run)
        self._features = run.features

    @override
    def setup_optimizer(self, optimizer: Any) -> Any:
        log.debug("%s: %s's state is sent to a recovering replica group", LINE, type(optimizer).__name__)
        self.optimizers.append(optimizer)
        return optimizer

    @override
    def process_dataloader(self, dataloader: Any) -> StepBatches:
        if self.ft.batches is not None:
            raise ValueError(
                "fault_tolerance='torchft' deals the training loader step by step, so fabric.setup_dataloaders takes it "
                "alone: expected one call, with the training loader (iterate validation loaders directly: every "
                "replica group validates on all of it)."
            )
        self.ft.batches = replica_batches(dataloader, 1, int(os.environ.get("PL_GLOBAL_SEED", 0)))
        self._apply_restored()
        return StepBatches(self.ft)

    @override
    def optimizer_step(self, step: Callable[[Any], Any], optimizer: Any, closure: Any) -> Any:
        return step(closure) if self.ft.commit() else None

    @override
    def on_train_end(self) -> None:
        """``fabric.strategy.teardown()``: one more quorum, in which a group that discarded the last step
        its peers committed takes their state (as the Trainer's after its last step)."""
        if self.ft.steps_started:
            self.ft.reconcile()

    @override
    def teardown(self) -> None:
        super().teardown()
        self.modules, self.optimizers, self._features = [], [], None

    def _state(self) -> dict[str, Any]:
        batches = self.ft.batches
        return {
            "modules": [module.state_dict() for module in self.modules],
            "optimizers": [optimizer.state_dict() for optimizer in self.optimizers],
            "data": batches.state_dict() if batches is not None else None,
            "features": self._features.replica_state() if self._features is not None else {},
        }

    def _load(self, state: dict[str, Any]) -> None:
        for module, module_state in zip(self.modules, state["modules"]):
            module.load_state_dict(module_state)
        for optimizer, optimizer_state in zip(self.optimizers, state["optimizers"]):
            optimizer.load_state_dict(optimizer_state)
        if self.ft.batches is not None and state["data"] is not None:
            self.ft.batches.load_state_dict(state["data"])
        if self._features is not None:  # after the modules: LocalSGD's snapshot is taken against them
            self._features.load_replica_state(state.get("features", {}))


class StepBatches:
    """Fabric's training loader under fault tolerance: each batch is read after its step's quorum;
    the iteration ends with the committed step that completes an epoch of the data."""

    def __init__(self, fault_tolerance: FaultTolerance) -> None:
        self.ft = fault_tolerance

    def __iter__(self) -> Iterator[Any]:
        batches = self.ft.batches
        assert batches is not None
        while True:
            self.ft.start_step()
            yield batches.next_batch()
            if self.ft.last_committed and batches.step_ends_epoch():
                return
