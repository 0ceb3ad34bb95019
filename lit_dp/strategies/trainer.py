"""``PaddleDPStrategy``: ``Trainer(strategy="paddle_dp")``.

Lightning launches the processes (or Paddle's launcher / torchrun / SLURM did); in each one the
strategy brings up the process group with ``init_parallel_env`` and wraps the LightningModule
in ``lit_dp.DataParallel``. On one device too: a group of one rank, as under ``"ddp"``.

The registered names copy Lightning's ``ddp`` families; what this strategy shares with the Fabric
one in ``lit_dp.fabric`` is in ``lit_dp.strategies.base``. Uneven inputs
(``lit_dp.strategies.uneven.UnevenInputs``) and the hang watchdog's wiring
(``lit_dp.strategies.watchdog.StrategyWatchdog``) are objects the strategy holds and calls from
its hooks, as Lightning's strategies hold their layer sync and forward redirection; each does
nothing until ``setup`` turns it on for a fit. With debug logging (the ``lit_dp`` logger), each
step of setup and teardown says what was decided and why.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Generator
from contextlib import contextmanager
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.nn import Module
from typing_extensions import override

from lit_dp.data_parallel import DataParallel
from lit_dp.gradients.broadcast import sync_params_buffers
from lit_dp.gradients.unused import UNUSED_PARAMETERS_OPENING
from lit_dp.gradients.waiting import CollectiveHangError
from lit_dp.job.process_group import barrier, broadcast_object
from lit_dp.local_sgd import LocalSGD
from lit_dp.options import AUTO, TRAINER, Options
from lit_dp.options.docs import options_doc
from lit_dp.sharding import ShardedOptimizer
from lit_dp.strategies.base import DataParallelStrategyMixin, default_cluster_environment, register_families
from lit_dp.strategies.checkpoint_io import AtomicCheckpointIO, save_checkpoint
from lit_dp.strategies.fault_tolerance import FaultTolerance, TrainerFaultTolerance
from lit_dp.strategies.lightning_private import (
    StrategyRegistryType,
    TrainerScriptLauncher,
    WrappingCheckpointIO,
    attached_trainer,
    optimizers_to_device,
    sync_ddp_if_available,
)
from lit_dp.strategies.health import HealthMonitor
from lit_dp.strategies.monitor import CommStatsMonitor
from lit_dp.strategies.lost_ranks import LostRanks, end_started_ranks
from lit_dp.strategies.precision import DataParallelPrecision, check_sharded_clipping, for_data_parallel
from lit_dp.strategies.preemption import ForwardingMultiProcessingLauncher, Preemption
from lit_dp.strategies.resume import EpochContinuation
from lit_dp.strategies.uneven import UnevenInputs
from lit_dp.strategies.watchdog import StrategyWatchdog

log = logging.getLogger(__name__)

CHECKPOINT_KEY = "lit_dp"  # the strategy's own entry in Lightning checkpoints

# Lightning's own sentence (`DDPStrategy.on_exception`), which is what users search for: it opens
# the reducer's error, which names the parameters.
LIGHTNING_UNUSED_PARAMETERS_MESSAGE = (
    "It looks like your LightningModule has parameters that were not used in producing the loss returned by "
    "training_step. If this is intentional, you must enable the detection of unused parameters in lit_dp, either "
    "by setting the string value `strategy='paddle_dp_find_unused_parameters_true'` or by setting the flag in the "
    "strategy with `strategy=PaddleDPStrategy(find_unused_parameters=True)` "
    "(`strategy.find_unused_parameters=true` on a recipe's command line)."
)


class PaddleDPStrategy(DataParallelStrategyMixin, ParallelStrategy):
    """Data parallelism with lit_dp's bucketed reducer, one process per device.

    The first five arguments are Lightning's, set by the Trainer. The options (``lit_dp.options``)
    are keyword arguments, or one ``options=Options.build(...)`` already validated; Lightning
    ``DDPStrategy``'s names for the same options are accepted, so a ``DDPStrategy(...)`` moves
    over by renaming the class:
{options}

    torch DDP's own arguments (``broadcast_buffers``, ...) are taken as Lightning's ``DDPStrategy``
    takes them, and handed to ``lit_dp.DataParallel``.

    With ``comm_buffer_size="auto"`` the tuned size is stored in checkpoints, so a resumed run
    keeps it; LocalSGD's schedule is stored too. Checkpoints are written atomically
    (``AtomicCheckpointIO``; a ``CheckpointIO`` of the user's, given here or in the Trainer's
    ``plugins``, is used as given, see ``lit_dp.strategies.checkpoint_io``), and a fit resumed from a
    checkpoint taken inside an epoch goes on at the next batch of that epoch
    (``lit_dp.strategies.resume``). With ``sharding_stage`` the optimizers from
    ``configure_optimizers`` are rebuilt over each rank's parameters (``lit_dp.ShardedOptimizer``),
    ``gradient_clip_val`` clips by the global norm and checkpoints hold the consolidated
    optimizer state (docs/sharding.md).
    """

    strategy_name = "paddle_dp"
    _launchers = (TrainerScriptLauncher, ForwardingMultiProcessingLauncher)  # lit_dp.strategies.preemption
    _options_scope = TRAINER

    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        options: Options | None = None,
        **values: Any,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=default_cluster_environment(cluster_environment),
            # Kept unset unless given, as under "ddp": Lightning refuses a strategy's own next to the
            # user's `plugins`; the default is supplied when read (`checkpoint_io`).
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._keep_options(options, values)
        self._atomic_checkpoint_io = AtomicCheckpointIO()
        # The reliability wiring (docs/reliability.md), called from the hooks below; each does
        # nothing until `setup` turns it on for a fit.
        self._uneven = UnevenInputs(enabled=self._options.uneven_inputs)
        self._watchdog = StrategyWatchdog()
        self._local_sgd: LocalSGD | None = None
        self._local_sgd_resumed: dict[str, Any] | None = None  # from the checkpoint, until setup
        self._tuned_buffer_size: float | None = None  # with "auto": restored, or chosen by a finished fit
        self._preemption = Preemption()  # SIGTERM/SIGUSR1: lit_dp.strategies.preemption
        self._lost_ranks = LostRanks()  # a dead rank named: lit_dp.strategies.lost_ranks
        self._epoch_continuation = EpochContinuation()  # mid-epoch resumes: lit_dp.strategies.resume
        # fault_tolerance="torchft" (lit_dp.strategies.fault_tolerance): settings checked here, the Manager in setup.
        self._fault_tolerance = (
            TrainerFaultTolerance(FaultTolerance(self._options)) if self._options.fault_tolerance else None
        )

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        """The user's plugin as given, else ``AtomicCheckpointIO``, also under a wrapping plugin
        given without its own base (``AsyncCheckpointIO()``), where Lightning puts its default."""
        if self._checkpoint_io is None:
            return self._atomic_checkpoint_io
        if isinstance(self._checkpoint_io, WrappingCheckpointIO):
            self._checkpoint_io.checkpoint_io = self._atomic_checkpoint_io  # sets only a base not yet given
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO) -> None:
        self._checkpoint_io = io

    @property
    def comm_buffer_size(self) -> float | str:
        """The bucket size in MB: the fixed size; with ``"auto"``, the tuned size once chosen or
        restored from a checkpoint (``tuned_comm_buffer_size``), the default while the first steps
        tune (``DataParallel.comm_buffer_size``), and ``"auto"`` before a fit wraps the model."""
        if self.tuned_comm_buffer_size is not None:
            return self.tuned_comm_buffer_size
        if isinstance(self.model, DataParallel):
            return self.model.comm_buffer_size
        return self._options.comm_buffer_size

    @property
    @override
    def precision_plugin(self) -> Precision:
        """lit_dp's plugin for the precision asked for (``lit_dp.strategies.precision``: clipping with fused
        optimizers and sharding), or a plugin of the user's own class as given."""
        return self._precision_plugin if self._precision_plugin is not None else DataParallelPrecision()

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Precision | None) -> None:
        # Where Lightning hands the strategy the plugin it made for `precision=` (or the user's).
        self._precision_plugin = for_data_parallel(plugin)

    @property
    def tuned_comm_buffer_size(self) -> float | None:
        """With ``comm_buffer_size="auto"``: the size chosen in this run or restored from a checkpoint."""
        if self._tuned_buffer_size is not None:
            return self._tuned_buffer_size
        tuner = self.model.autotuner if isinstance(self.model, DataParallel) else None
        return tuner.chosen_mb if tuner is not None else None

    @property
    def fault_tolerance(self) -> FaultTolerance | None:
        """With ``fault_tolerance="torchft"``: its ``committed_steps``, ``metrics()`` and ``manager``."""
        return self._fault_tolerance.ft if self._fault_tolerance is not None else None

    @property
    def local_sgd(self) -> LocalSGD | None:
        """The model averager while fitting with ``local_sgd_steps``; None otherwise."""
        return self._local_sgd

    @property
    def _running_trainer(self) -> pl.Trainer | None:
        """The Trainer running the LightningModule, if any (the strategy itself holds no reference to it)."""
        return attached_trainer(self.lightning_module) if self.lightning_module is not None else None

    @property
    def is_distributed(self) -> bool:
        """Read by Lightning for strategies it does not know, e.g. to add a ``DistributedSampler``."""
        return True

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._lost_ranks.watch(self.launcher)
        self.setup_distributed()

    def setup_distributed(self) -> None:
        """Seed, ranks, then the process group: one rank's own for a single process, as under ``"ddp"``."""
        reset_seed()
        self._init_process_group()

    def describe(self) -> str:
        """One line with the settings in effect, for logs."""
        return (
            f"strategy=paddle_dp backend={self.process_group_backend} world_size={self.world_size} "
            f"devices={[str(d) for d in self.parallel_devices or []]} "
            f"{self._options.describe(TRAINER, skip=('backend',))}"  # the backend: shown resolved, first
        )

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        log.debug("%s: setting up for %s", type(self).__name__, trainer.state.fn.value)
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self._check_sharding_precision(self.precision_plugin)
            check_sharded_clipping(
                self.precision_plugin,
                self._options.sharding.stage,
                trainer.gradient_clip_val,
                trainer.gradient_clip_algorithm,
            )
        if fitting and self._layer_sync:
            log.debug("%s: sync_batchnorm: converting BatchNorm layers to SyncBatchNorm", type(self).__name__)
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if fitting and self._fault_tolerance is not None:  # the Manager before the model it wraps; its log in the run's folder
            self._fault_tolerance.ft.start(self.root_device, self.world_size, trainer.default_root_dir)
        if fitting:
            self.model = self._setup_model(self.model)
            self._watchdog.setup(trainer, self.model)
            self._local_sgd = self._setup_local_sgd()
            self.setup_optimizers(trainer)
            if self._fault_tolerance is not None:  # what a recovering replica receives
                self._fault_tolerance.attach(trainer)
        elif dist.is_initialized():
            log.debug("%s: not fitting: no wrapper; broadcasting rank 0's parameters and buffers", type(self).__name__)
            sync_params_buffers(self.model)
        self.setup_precision_plugin()
        if fitting:
            self._setup_fit(trainer)

    def _setup_fit(self, trainer: pl.Trainer) -> None:
        """What a fit needs once the wrapped model, its optimizers and the precision plugin are set up."""
        assert isinstance(self.model, DataParallel)
        optimizers_to_device(self.optimizers, self.root_device)
        if self._options.comm_stats or self._options.comm_buffer_size == AUTO:
            if not any(isinstance(callback, CommStatsMonitor) for callback in trainer.callbacks):
                log.debug("%s: CommStatsMonitor added to the callbacks", type(self).__name__)
                trainer.callbacks.append(CommStatsMonitor())
        if self.model.step_clock is not None and not any(isinstance(c, HealthMonitor) for c in trainer.callbacks):
            log.debug("%s: HealthMonitor added to the callbacks (batches, straggler/*)", type(self).__name__)
            trainer.callbacks.append(HealthMonitor())
        self._uneven.setup(trainer, self.model, sync_batchnorm=self._layer_sync is not None)
        self._preemption.setup(trainer, self.world_size, self.global_rank)  # collective under NCCL: on every rank

    @override
    def _setup_model(self, model: Module) -> DataParallel:
        options = self._options
        if self._tuned_buffer_size is not None:
            # A size restored from a checkpoint (or tuned by an earlier fit) replaces "auto": no step
            # is spent tuning again.
            size = self._tuned_buffer_size
            rank_zero_info(f"[lit_dp] comm_buffer_size=auto: {size:g} MB, tuned before (checkpoint or earlier fit)")
            options = options.replace(comm_buffer_size=size)
        manager = self._fault_tolerance.ft.manager if self._fault_tolerance is not None else None
        wrapped = self._wrap(model, options, manager)
        if self.lightning_module is not None and not self.lightning_module.automatic_optimization:
            wrapped.arm_at_backward()  # `manual_backward` arms the reducer (pre_backward), not the forwards
        return wrapped

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        # The schedulers keep the optimizers configure_optimizers built, whose groups the
        # sharded ones share (see lit_dp.sharding).
        self.optimizers = [self._shard(optimizer, self.model) for optimizer in self.optimizers]

    def wait_for_parameters(self) -> None:
        """With ``sharding_overlap``: finish gathering the updated parameters, before they are read outside a forward."""
        for optimizer in self.optimizers:
            if isinstance(optimizer, ShardedOptimizer):
                optimizer.wait_for_parameters()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self.wait_for_parameters()
        return super().lightning_module_state_dict()

    @override
    def on_validation_start(self) -> None:
        self.wait_for_parameters()
        self._watchdog.validation_started()
        super().on_validation_start()

    def _setup_local_sgd(self) -> LocalSGD | None:
        options = self._options
        if options.local_sgd.steps is None or not isinstance(self.model, DataParallel):
            return None
        assert self.lightning_module is not None
        if options.local_sgd.adaptive and not self.lightning_module.automatic_optimization:
            raise ValueError(
                "local_sgd_adaptive=True is not supported with manual optimization: the adaptive period needs the "
                "training loss, which only automatic optimization hands to the strategy. Use a fixed local_sgd_steps."
            )
        local_sgd = LocalSGD(
            self.model,
            options.local_sgd.steps,
            options.local_sgd.warmup_steps,
            adaptive=options.local_sgd.adaptive,
            comm_buffer_size=None,  # the model's when the local phase starts: with "auto", the tuned size
            outer=options.local_sgd.outer,
            outer_lr=options.local_sgd.outer_lr,
            outer_momentum=options.local_sgd.outer_momentum,
            sync_dtype=options.local_sgd.sync_dtype,
        )
        log.debug("%s: LocalSGD on: parameters averaged after optimizer steps (lit_dp.LocalSGD)", type(self).__name__)
        if self._local_sgd_resumed is not None:
            log.debug("%s: LocalSGD: schedule restored from the checkpoint", type(self).__name__)
            local_sgd.load_state_dict(self._local_sgd_resumed)
            self._local_sgd_resumed = None
        return local_sgd

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if self._fault_tolerance is not None:  # the step is applied only if every replica group commits it
            step = partial(super().optimizer_step, optimizer, model=model, **kwargs)
            return self._fault_tolerance.optimizer_step(step, closure)
        # Every optimizer step counts, under automatic and manual optimization alike (manual steps
        # come through LightningOptimizer.step); accumulated micro-batches do not.
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._local_sgd is not None:
            loss = output if self._options.local_sgd.adaptive else None
            self._local_sgd.step(loss, optimizer.param_groups[0]["lr"], joined=self._uneven.replaying)
        return output

    @override
    def on_train_end(self) -> None:
        # Callbacks have had their on_train_end (a last checkpoint): hand back the optimizers
        # configure_optimizers built, rank 0's with the whole state, as the model is unwrapped.
        self.optimizers = [
            optimizer.unwrap() if isinstance(optimizer, ShardedOptimizer) else optimizer for optimizer in self.optimizers
        ]
        if self._local_sgd is not None:
            self._local_sgd.finish()
        super().on_train_end()

    @override
    def process_dataloader(self, dataloader: object) -> object:
        # Called after Lightning restored the loops and before the first batch is fetched.
        trainer = self._running_trainer
        if trainer is not None and trainer.training and self._fault_tolerance is not None:
            return self._fault_tolerance.process_dataloader(dataloader, trainer)  # dealt step by step
        if trainer is not None:
            if trainer.training:
                dataloader = self._epoch_continuation.process(dataloader, trainer.fit_loop, self.world_size)
            dataloader = self._uneven.process_dataloader(trainer, dataloader)
        return super().process_dataloader(dataloader)

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        trainer = self._running_trainer
        if trainer is not None and self._fault_tolerance is not None:  # the step's quorum, then its data
            batch = self._fault_tolerance.batch(batch, trainer)
        if trainer is not None:
            self._uneven.batch_to_device(trainer)
        return super().batch_to_device(batch, device, dataloader_idx)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._uneven.replaying:
            # No batch of this rank's: an output shaped like the others' (zeros), which Lightning
            # backpropagates through `backward` below, where the step's collectives are taken.
            return self._uneven.replayed_output(self.root_device)
        with self._uneven.user_step("training_step"):
            output = super().training_step(*args, **kwargs)
        self._uneven.remember_output(output)
        return output

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._uneven.replaying:
            if isinstance(self.model, DataParallel):
                self.model.replay_forward()  # the buffer broadcast the forwards of the ranks with a batch take
            return None
        with self._uneven.user_step("validation_step"):
            return super().validation_step(*args, **kwargs)

    @override
    def on_validation_end(self) -> None:
        self._uneven.validation_end()
        self._watchdog.validation_ended()
        super().on_validation_end()

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradients accumulate locally inside (``accumulate_grad_batches``, manual optimization)."""
        if isinstance(self.model, DataParallel):
            with self.model.no_sync():
                yield
        else:
            yield

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        # Manual optimization: the forwards do not arm the reducer (DataParallel.arm_at_backward);
        # `manual_backward` does, here, and inside `block_backward_sync` the plan keeps it local.
        assert self.lightning_module is not None
        if isinstance(self.model, DataParallel) and not self.lightning_module.automatic_optimization:
            self.model.prepare_for_backward(closure_loss)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        if not (self._uneven.replaying and isinstance(self.model, DataParallel)):
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        # Lightning's backward path (Strategy.backward) with every hook, as on the ranks with a
        # batch, so that a collective in on_before_backward or on_after_backward meets its
        # partners; only the backward itself is the step's collectives without one of this rank's.
        assert self.lightning_module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        self.model.replay_step()
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    @contextmanager
    def _collective(self, name: str) -> Generator[None, None, None]:
        """One of the strategy's collectives: refused where uneven inputs cannot match it, and
        watched by the hang watchdog's thread (the wait itself has no deadline)."""
        self._uneven.check_collective(name)
        with self._watchdog.watching(f"strategy.{name}"):
            yield

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        with self._collective("barrier"):
            barrier(self.root_device)

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        with self._collective("broadcast"):
            return broadcast_object(obj, src)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        if not isinstance(tensor, Tensor):
            return tensor
        with self._collective("reduce (self.log(..., sync_dist=True), reduce_boolean_decision)"):
            return sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        with self._collective("all_gather"):
            return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    @override
    def on_exception(self, exception: BaseException) -> None:
        # The one place the reducer's error gets Lightning's sentence, as DDPStrategy augments
        # torch's. Under a spawning launcher it arrives inside the rank's traceback, as text.
        exception.args = tuple(
            f"{LIGHTNING_UNUSED_PARAMETERS_MESSAGE}\n{arg}"
            if isinstance(arg, str) and UNUSED_PARAMETERS_OPENING in arg and not arg.startswith(LIGHTNING_UNUSED_PARAMETERS_MESSAGE)
            else arg
            for arg in exception.args
        )
        if isinstance(exception, Exception):  # not a stop (Preempted, Ctrl-C): lit_dp.strategies.lost_ranks
            self._lost_ranks.note(exception, self.launcher, self.node_rank, self.num_processes, self.global_rank)
            if not isinstance(exception, CollectiveHangError):  # a hang's verdict ends every rank itself, at once
                end_started_ranks(exception, self.launcher, self.node_rank, self.num_processes)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | os.PathLike, storage_options: Any | None = None
    ) -> None:
        own = {}
        if self.tuned_comm_buffer_size is not None:
            own["tuned_comm_buffer_size"] = self.tuned_comm_buffer_size
        if self._local_sgd is not None:
            own["local_sgd"] = self._local_sgd.state_dict()
        if (layout := self._epoch_continuation.state_dict()) is not None:
            own["loader"] = layout  # lit_dp.strategies.resume: a resume with other ranks reads it
        if self._fault_tolerance is not None:
            own["fault_tolerance"] = self._fault_tolerance.checkpoint_state()
        if own:
            checkpoint[CHECKPOINT_KEY] = own
        if self.is_global_zero:
            # Rank 0 writes while the others wait in a barrier: a known phase of the hang watchdog.
            with self._watchdog.phase("saving a checkpoint"):
                save_checkpoint(self.checkpoint_io, checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: str | os.PathLike, weights_only: bool | None = None) -> dict[str, Any]:
        # Lightning loads the checkpoint before `setup` wraps the model: the restored size
        # replaces "auto" there, and no step is spent tuning again; the LocalSGD schedule is
        # applied when setup builds the averager.
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        own = checkpoint.get(CHECKPOINT_KEY, {})
        tuned = own.get("tuned_comm_buffer_size")
        if tuned is not None and self._options.comm_buffer_size == AUTO:
            self._tuned_buffer_size = tuned
        self._local_sgd_resumed = own.get("local_sgd")
        self._epoch_continuation.load_state_dict(own.get("loader"))  # lit_dp.strategies.resume
        if self._fault_tolerance is not None and "fault_tolerance" in own:
            self._fault_tolerance.restore_checkpoint_state(own["fault_tolerance"])
        return checkpoint

    @override
    def teardown(self) -> None:
        log.debug("%s: tearing down strategy", type(self).__name__)
        lightning_module = self.lightning_module
        self._local_sgd = None
        self._uneven.teardown()
        self._watchdog.teardown()
        self._preemption.teardown()
        self._epoch_continuation.teardown()
        if self._fault_tolerance is not None:
            self._fault_tolerance.ft.close()
        if isinstance(self.model, DataParallel):
            self.model.flush_comm_stats()  # the trace of a run shorter than trace_steps
            self._tuned_buffer_size = self.tuned_comm_buffer_size
            log.debug("%s: unwrapping the model from lit_dp.DataParallel", type(self).__name__)
            self.model = lightning_module
        trainer = self._running_trainer
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING and self._layer_sync:
            assert self.model is not None
            log.debug("%s: sync_batchnorm: reverting SyncBatchNorm layers to BatchNorm", type(self).__name__)
            self.model = self._layer_sync.revert(self.model)
        super().teardown()
        self._leave_process_group()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistryType) -> None:
        register_families(strategy_registry, cls)


PaddleDPStrategy.__doc__ = PaddleDPStrategy.__doc__.format(options=options_doc(TRAINER))
# `import lit_dp` loads this module once Lightning is imported (see lit_dp/__init__.py).
PaddleDPStrategy.register_strategies(StrategyRegistry)
