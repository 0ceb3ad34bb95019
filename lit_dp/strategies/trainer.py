"""``PaddleDPStrategy``: ``Trainer(strategy="paddle_dp")``.

Lightning launches the processes (or Paddle's launcher / torchrun / SLURM did); in each one the
strategy brings up the process group with ``init_parallel_env`` and wraps the LightningModule
in ``lit_dp.DataParallel``. On one device too: a group of one rank, as under ``"ddp"``.

The registered names copy Lightning's ``ddp`` families; what this strategy shares with the Fabric
one in ``lit_dp.fabric`` is in ``lit_dp.strategies.base``.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from contextlib import contextmanager
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.strategy import TBroadcast, _ForwardRedirection
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.nn import Module
from typing_extensions import override

from lit_dp.data_parallel import DataParallel
from lit_dp.gradients.broadcast import sync_params_buffers
from lit_dp.gradients.buckets import DEFAULT_BUCKET_MB
from lit_dp.gradients.hooks import describe_comm_hook
from lit_dp.job.process_group import barrier, broadcast_object, destroy_parallel_env
from lit_dp.local_sgd import LocalSGD
from lit_dp.observability.autotune import AUTO
from lit_dp.options import TRAINER, Options, options_doc
from lit_dp.sharding import ShardedOptimizer
from lit_dp.strategies.base import DataParallelStrategyMixin, default_cluster_environment, register_families
from lit_dp.strategies.checkpoint_io import AtomicCheckpointIO
from lit_dp.strategies.fault_tolerance import FaultTolerance, TrainerFaultTolerance
from lit_dp.strategies.monitor import CommStatsMonitor
from lit_dp.strategies.reliability import ReliabilityMixin
from lit_dp.strategies.resume import continue_epoch
from lit_dp.strategies.sharded_clipping import clip_sharded_by_global_norm

CHECKPOINT_KEY = "lit_dp"  # the strategy's own entry in Lightning checkpoints

# Lightning's own sentence (`DDPStrategy.on_exception`), which is what users search for, then ours.
LIGHTNING_UNUSED_PARAMETERS_MESSAGE = (
    "It looks like your LightningModule has parameters that were not used in producing the loss returned by "
    "training_step. If this is intentional, you must enable the detection of unused parameters in lit_dp, either "
    "by setting the string value `strategy='paddle_dp_find_unused_parameters_true'` or by setting the flag in the "
    "strategy with `strategy=PaddleDPStrategy(find_unused_parameters=True)` "
    "(`strategy.find_unused_parameters=true` on a recipe's command line)."
)



class PaddleDPStrategy(ReliabilityMixin, DataParallelStrategyMixin, ParallelStrategy):
    """Data parallelism with lit_dp's bucketed reducer, one process per device.

    The first five arguments are Lightning's, set by the Trainer. The options (``lit_dp.options``)
    are keyword arguments, or one ``options=Options.build(...)`` already validated; Lightning
    ``DDPStrategy``'s names for the same options are accepted, so a ``DDPStrategy(...)`` moves
    over by renaming the class:
{options}

    With ``comm_buffer_size="auto"`` the tuned size is stored in checkpoints, so a resumed run
    keeps it; LocalSGD's schedule is stored too. Checkpoints are written atomically
    (``AtomicCheckpointIO``, unless another ``checkpoint_io`` is given), and a fit resumed from a
    checkpoint taken inside an epoch goes on at the next batch of that epoch
    (``lit_dp.strategies.resume``). With ``sharding_stage`` the optimizers from
    ``configure_optimizers`` are rebuilt over each rank's parameters (``lit_dp.ShardedOptimizer``),
    ``gradient_clip_val`` clips by the global norm and checkpoints hold the consolidated
    optimizer state (docs/sharding.md).
    """

    strategy_name = "paddle_dp"
    _launchers = (_SubprocessScriptLauncher, _MultiProcessingLauncher)
    _unused_parameters_message = LIGHTNING_UNUSED_PARAMETERS_MESSAGE
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
            checkpoint_io=checkpoint_io if checkpoint_io is not None else AtomicCheckpointIO(),
            precision_plugin=precision_plugin,
        )
        self._keep_options(options, values)
        self._forward_redirection = _ManualOptimizationRedirection()
        self._local_sgd: LocalSGD | None = None
        self._local_sgd_resumed: dict[str, Any] | None = None  # from the checkpoint, until setup
        self._tuned_buffer_size: float | None = None  # with "auto": restored, or chosen by a finished fit
        # fault_tolerance="torchft" (lit_dp.strategies.fault_tolerance): settings checked here, the Manager in setup.
        self._fault_tolerance = (
            TrainerFaultTolerance(FaultTolerance(self._options)) if self._options.fault_tolerance else None
        )

    @property
    def comm_buffer_size(self) -> float | str:
        """The bucket size in MB: with ``"auto"``, the tuned size once chosen (or restored)."""
        return self.tuned_comm_buffer_size or self._options.comm_buffer_size

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
    def is_distributed(self) -> bool:
        """Read by Lightning for strategies it does not know, e.g. to add a ``DistributedSampler``."""
        return True

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.setup_distributed()

    def setup_distributed(self) -> None:
        """Seed, ranks, then the process group: one rank's own for a single process, as under ``"ddp"``."""
        reset_seed()
        self._init_process_group()

    def describe(self) -> str:
        """One line with the settings in effect, for logs."""
        options = self._options
        size = options.comm_buffer_size
        return (
            f"strategy=paddle_dp backend={self.process_group_backend} world_size={self.world_size} "
            f"devices={[str(d) for d in self.parallel_devices or []]} "
            f"comm_buffer_size={size}{'' if size == AUTO else 'MB'} "
            f"last_comm_buffer_size={options.last_comm_buffer_size}MB "
            f"find_unused_parameters={options.find_unused_parameters} "
            f"gradient_as_bucket_view={options.gradient_as_bucket_view} local_sgd_steps={options.local_sgd_steps} "
            f"local_sgd_warmup_steps={options.local_sgd_warmup_steps} local_sgd_adaptive={options.local_sgd_adaptive} "
            f"comm_hook={describe_comm_hook(**options.hook_options())} comm_stats={options.comm_stats} "
            f"sharding_stage={options.sharding_stage} sharding_overlap={options.sharding_overlap} "
            f"uneven_inputs={options.uneven_inputs} hang_timeout={options.hang_timeout} "
            f"fault_tolerance={options.fault_tolerance}"
        )

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self._check_sharding_precision(self.precision_plugin)
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if fitting and self._fault_tolerance is not None:  # the Manager before the model it wraps
            self._fault_tolerance.ft.start(self.root_device, self.world_size)
        if fitting:
            self.model = self._setup_model(self.model)
            self._local_sgd = self._setup_local_sgd()
            self.setup_optimizers(trainer)
        if fitting and self._fault_tolerance is not None:  # what a recovering replica receives
            self._fault_tolerance.attach(trainer)
        elif dist.is_initialized():
            sync_params_buffers(self.model)
        self.setup_precision_plugin()
        if fitting and self._options.sharding_stage is not None:
            clip_sharded_by_global_norm(self.precision_plugin)
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
        if fitting and (self._options.comm_stats or self._options.comm_buffer_size == AUTO):
            if not any(isinstance(callback, CommStatsMonitor) for callback in trainer.callbacks):
                trainer.callbacks.append(CommStatsMonitor())
        if fitting:
            self._setup_reliability(trainer)

    @override
    def _setup_model(self, model: Module) -> Module:
        if self._tuned_buffer_size is not None:
            size = self._tuned_buffer_size
            rank_zero_info(f"[lit_dp] comm_buffer_size=auto: {size:g} MB, tuned before (checkpoint or earlier fit)")
        manager = self._fault_tolerance.ft.manager if self._fault_tolerance is not None else None
        return self._wrap(model, self._options.replace(comm_buffer_size=self.comm_buffer_size), manager)

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

    def _setup_local_sgd(self) -> LocalSGD | None:
        options = self._options
        if options.local_sgd_steps is None or not isinstance(self.model, DataParallel):
            return None
        assert self.lightning_module is not None
        if options.local_sgd_adaptive and not self.lightning_module.automatic_optimization:
            raise ValueError(
                "local_sgd_adaptive=True is not supported with manual optimization: the adaptive period needs the "
                "training loss, which only automatic optimization hands to the strategy. Use a fixed local_sgd_steps."
            )
        local_sgd = LocalSGD(
            self.model,
            options.local_sgd_steps,
            options.local_sgd_warmup_steps,
            adaptive=options.local_sgd_adaptive,
            comm_buffer_size=self.comm_buffer_size if self.comm_buffer_size != AUTO else DEFAULT_BUCKET_MB,
        )
        if self._local_sgd_resumed is not None:
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
            loss = output if self._options.local_sgd_adaptive else None
            self._local_sgd.step(loss, optimizer.param_groups[0]["lr"], joined=self._replaying)
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

    @override
    def process_dataloader(self, dataloader: object) -> object:
        # Called after Lightning restored the loops and before the first batch is fetched.
        trainer = self.lightning_module._trainer if self.lightning_module is not None else None
        if trainer is not None and trainer.training and self._fault_tolerance is not None:
            return self._fault_tolerance.process_dataloader(dataloader, trainer)  # dealt step by step
        if trainer is not None and trainer.training:
            dataloader = continue_epoch(dataloader, trainer.fit_loop)
        return super().process_dataloader(dataloader)  # uneven inputs: strategies/reliability.py

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        if self._fault_tolerance is not None and self.lightning_module is not None:  # the step's quorum, then its data
            batch = self._fault_tolerance.batch(batch, self.lightning_module.trainer)
        return super().batch_to_device(batch, device, dataloader_idx)

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
        # Manual optimization: the forward did not arm the reducer (see the redirection below);
        # `manual_backward` arms it here, unless inside `block_backward_sync`.
        assert self.lightning_module is not None
        if isinstance(self.model, DataParallel) and not self.lightning_module.automatic_optimization:
            self.model.prepare_for_backward(closure_loss)

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
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    @override
    def on_exception(self, exception: BaseException) -> None:
        # In the launching process of a spawned job the reducer's error arrives inside the rank's
        # traceback; Lightning's sentence is moved to the front, as DDPStrategy does with its own.
        opening = self._unused_parameters_message
        message = exception.args[0] if exception.args else None
        if isinstance(message, str) and opening in message and not message.startswith(opening):
            exception.args = (f"{opening}\n{message.replace(opening, '').strip()}",)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | os.PathLike, storage_options: Any | None = None
    ) -> None:
        own = {}
        if self.tuned_comm_buffer_size is not None:
            own["tuned_comm_buffer_size"] = self.tuned_comm_buffer_size
        if self._local_sgd is not None:
            own["local_sgd"] = self._local_sgd.state_dict()
        if self._fault_tolerance is not None:
            own["fault_tolerance"] = self._fault_tolerance.checkpoint_state()
        if own:
            checkpoint[CHECKPOINT_KEY] = own
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

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
        if self._fault_tolerance is not None and "fault_tolerance" in own:
            self._fault_tolerance.restore_checkpoint_state(own["fault_tolerance"])
        return checkpoint

    @override
    def teardown(self) -> None:
        lightning_module = self.lightning_module
        self._local_sgd = None
        if self._fault_tolerance is not None:
            self._fault_tolerance.ft.close()
        self._teardown_reliability()
        if isinstance(self.model, DataParallel):
            self.model.flush_comm_stats()  # the trace of a run shorter than trace_steps
            self._tuned_buffer_size = self.tuned_comm_buffer_size
            self.model = lightning_module
        if (
            lightning_module is not None
            and lightning_module._trainer is not None
            and lightning_module._trainer.state.fn == TrainerFn.FITTING
            and self._layer_sync
        ):
            assert self.model is not None
            self.model = self._layer_sync.revert(self.model)
        super().teardown()
        # A second `fit` in the same process then starts from a clean slate.
        destroy_parallel_env()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register_families(strategy_registry, cls)


class _ManualOptimizationRedirection(_ForwardRedirection):
    """Under manual optimization the forward must not arm the reducer: ``manual_backward`` does.

    The previous sync flag is restored afterwards, so a forward inside ``block_backward_sync``
    stays unsynchronised.
    """

    def __init__(self) -> None:
        self._saved_sync: bool | None = None

    @override
    def on_after_inner_forward(self, wrapper_module: Module, original_module: pl.LightningModule) -> None:
        if isinstance(wrapper_module, DataParallel) and not original_module.automatic_optimization:
            self._saved_sync = wrapper_module.grad_need_sync
            wrapper_module.grad_need_sync = False

    @override
    def on_after_outer_forward(self, wrapper_module: Module, original_module: pl.LightningModule) -> None:
        if isinstance(wrapper_module, DataParallel) and self._saved_sync is not None:
            wrapper_module.grad_need_sync = self._saved_sync
            self._saved_sync = None


PaddleDPStrategy.__doc__ = PaddleDPStrategy.__doc__.format(options=options_doc(TRAINER))
# `import lit_dp` loads this module once Lightning is imported (see lit_dp/__init__.py).
PaddleDPStrategy.register_strategies(StrategyRegistry)
