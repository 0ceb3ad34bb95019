"""``PaddleDPStrategy``: ``Trainer(strategy="paddle_dp")``.

Lightning launches the processes (or Paddle's launcher / torchrun / SLURM did); in each one the
strategy brings up the process group with ``init_parallel_env`` and wraps the LightningModule
in ``lit_dp.DataParallel``. On one device too: a group of one rank, as under ``"ddp"``.

The registered names copy Lightning's ``ddp`` families; what this strategy shares with the Fabric
one in ``lit_dp.fabric`` is in ``lit_dp.strategies.base``, the process group's setup in
``lit_dp.strategies.process_group`` and the wrapping in ``lit_dp.strategies.wrapping``. Everything
else it does (sharding, uneven inputs, the hang watchdog's wiring, preemption, resuming, LocalSGD,
the bucket size, fault tolerance, the monitors) is a feature (``lit_dp.strategies.feature``),
built from the options by ``lit_dp.strategies.registry``: the hooks below call all of them, in the
registry's order, and name none. With debug logging (the ``lit_dp`` logger), each step of setup and teardown says what
was decided and why.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.nn import Module
from typing_extensions import override

from lit_dp.data_parallel import DataParallel
from lit_dp.gradients.broadcast import sync_params_buffers
from lit_dp.gradients.unused import UNUSED_PARAMETERS_OPENING
from lit_dp.options import TRAINER
from lit_dp.options.docs import options_doc
from lit_dp.sharding import ShardedOptimizer
from lit_dp.strategies import process_group
from lit_dp.strategies.base import DataParallelStrategyMixin, front_door
from lit_dp.strategies.checkpointing import optimizer_states, trainer_layout
from lit_dp.strategies.feature import CHECKPOINT_KEY, Run
from lit_dp.strategies.lightning_private import (
    attached_trainer,
    optimizers_to_device,
    sync_ddp_if_available,
)
from lit_dp.strategies.precision import DataParallelPrecision, for_data_parallel
from lit_dp.strategies.preemption import (
    BoundScriptLauncher,
    ForwardingMultiProcessingLauncher,
)

log = logging.getLogger(__name__)

# Lightning's own sentence (`DDPStrategy.on_exception`), which is what users search for: it opens
# the reducer's error, which names the parameters.
LIGHTNING_UNUSED_PARAMETERS_MESSAGE = (
    "It looks like your LightningModule has parameters that were not used in producing the loss returned by "
    "training_step. If this is intentional, you must enable the detection of unused parameters in lit_dp, either "
    "by setting the string value `strategy='paddle_dp_find_unused_parameters_true'` or by setting the flag in the "
    "strategy with `strategy=PaddleDPStrategy(find_unused_parameters=True)` "
    "(`strategy.find_unused_parameters=true` on a recipe's command line)."
)


@front_door
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
    keeps it; LocalSGD's schedule is stored too. Checkpoints are one file (``state_dict_type="full"``)
    or a folder each rank writes its part of (``"sharded"``), written atomically, in the background
    with ``async_save`` (``lit_dp.strategies.checkpointing``; a ``CheckpointIO`` of the user's, given
    here or in the Trainer's ``plugins``, is used as given, see ``lit_dp.strategies.checkpoint_io``), and
    a fit resumed from a checkpoint taken inside an epoch goes on at the next batch of that epoch
    (``lit_dp.strategies.resume``). With ``sharding_stage`` the optimizers from
    ``configure_optimizers`` are rebuilt over each rank's parameters (``lit_dp.ShardedOptimizer``),
    ``gradient_clip_val`` clips by the global norm and each owner writes its part of the optimizer
    state, which a full checkpoint holds unsharded (docs/sharding.md).
    """

    strategy_name = "paddle_dp"
    # Read by Lightning for strategies it does not know, e.g. to add a ``DistributedSampler``.
    is_distributed = True
    _launchers = (BoundScriptLauncher, ForwardingMultiProcessingLauncher)  # lit_dp.strategies.preemption
    _options_scope = TRAINER
    _precision_argument = "precision_plugin"

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
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._failed = False  # a new run (a strategy may fit more than once)
        self._features.setup_environment(self)
        self.setup_distributed()

    def setup_distributed(self) -> None:
        """Seed, ranks, then the process group: one rank's own for a single process, as under ``"ddp"``."""
        reset_seed()
        process_group.start_process_group(self)

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
        if fitting and self._layer_sync:
            log.debug("%s: sync_batchnorm: converting BatchNorm layers to SyncBatchNorm", type(self).__name__)
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if fitting:
            self.model = self._setup_model(self.model)
            self.setup_optimizers(trainer)
        elif dist.is_initialized():
            log.debug("%s: not fitting: no wrapper; broadcasting rank 0's parameters and buffers", type(self).__name__)
            sync_params_buffers(self.model)
        self.setup_precision_plugin()
        if fitting:
            optimizers_to_device(self.optimizers, self.root_device)
        self._checkpointing.check_writer(self.checkpoint_io)
        wrapped = self.model if isinstance(self.model, DataParallel) else None
        self._features.setup(Run(self, wrapped, trainer, self._features))
        self.optimizers = [self._features.setup_optimizer(optimizer) for optimizer in self.optimizers]

    @override
    def _setup_model(self, model: Module) -> DataParallel:
        trainer = attached_trainer(self.lightning_module) if self.lightning_module is not None else None
        wrapped = self._wrapping.wrap(model, Run(self, None, trainer), self._features, self._options)
        if self.lightning_module is not None and not self.lightning_module.automatic_optimization:
            wrapped.arm_at_backward()  # `manual_backward` arms the reducer (pre_backward), not the forwards
        return wrapped

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self.wait_for_parameters()  # with sharding_overlap the last gather may be in flight
        return super().lightning_module_state_dict()

    @override
    def on_validation_start(self) -> None:
        self._features.on_validation_start()
        super().on_validation_start()

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        # Every optimizer step, under automatic and manual optimization alike (manual steps come
        # through LightningOptimizer.step); accumulated micro-batches do not.
        step = partial(super().optimizer_step, optimizer, model=model, **kwargs)
        return self._features.optimizer_step(step, optimizer, closure)

    @override
    def on_train_end(self) -> None:
        # Callbacks have had their on_train_end (a last checkpoint): hand back the optimizers
        # configure_optimizers built, rank 0's with the whole state, as the model is unwrapped.
        self.optimizers = [
            optimizer.unwrap() if isinstance(optimizer, ShardedOptimizer) else optimizer for optimizer in self.optimizers
        ]
        self._features.on_train_end()
        super().on_train_end()

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        return super().batch_to_device(self._features.batch_to_device(batch), device, dataloader_idx)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._features.training_step(partial(super().training_step, *args, **kwargs))

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._features.validation_step(partial(super().validation_step, *args, **kwargs))

    @override
    def on_validation_end(self) -> None:
        self._features.on_validation_end()
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
        if not (self._features.joined and isinstance(self.model, DataParallel)):
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

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        if not isinstance(tensor, Tensor):
            return tensor
        with self._features.collective("reduce (self.log(..., sync_dist=True), reduce_boolean_decision)"):
            return sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        with self._features.collective("all_gather"):
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
        self._failed = True
        self._features.on_exception(exception, self)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        # A sharded optimizer's part, as each owner writes it: no rank gathers the others' (lit_dp.checkpoint).
        optimizer = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        if isinstance(optimizer, ShardedOptimizer):
            return optimizer.shard_state_dict()
        return super().optimizer_state(optimizer)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | os.PathLike, storage_options: Any | None = None
    ) -> None:
        """Every rank: its part of the checkpoint, in the format of ``state_dict_type``, now or in the background
        (``async_save``): ``lit_dp.strategies.checkpointing``."""
        # A weights-only save (Lightning's has no optimizer states) is no resume point: the features' state stays out of it.
        if "optimizer_states" in checkpoint and (own := self._features.state_dict()):
            checkpoint[CHECKPOINT_KEY] = own
        self._checkpointing.save(self._features, self.checkpoint_io, checkpoint, filepath, storage_options, trainer_layout())

    @override
    def remove_checkpoint(self, filepath: str | os.PathLike) -> None:
        # ModelCheckpoint dropping one of its top-k: after the save that replaces it is written (async_save).
        if self.is_global_zero:
            self._checkpointing.remove(self.checkpoint_io, filepath)

    @override
    def load_checkpoint(self, checkpoint_path: str | os.PathLike, weights_only: bool | None = None) -> dict[str, Any]:
        # Lightning loads the checkpoint before `setup` wraps the model: the features take their entries now, and
        # apply them as the fit is set up; a sharded folder's optimizer states are read once the optimizers exist.
        read_file = partial(super().load_checkpoint, checkpoint_path, weights_only=weights_only)
        return self._checkpointing.load_trainer(self._features, checkpoint_path, read_file, weights_only)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        for optimizer, state in zip(self.optimizers, optimizer_states(checkpoint["optimizer_states"], self.optimizers)):
            optimizer.load_state_dict(state)
        optimizers_to_device(self.optimizers, self.root_device)

    @override
    def teardown(self) -> None:
        log.debug("%s: tearing down strategy", type(self).__name__)
        lightning_module = self.lightning_module
        self._checkpointing.teardown(failed=self._failed)  # a save in flight: written before the run ends
        self._features.teardown()
        if isinstance(self.model, DataParallel):
            log.debug("%s: unwrapping the model from lit_dp.DataParallel", type(self).__name__)
            self.model = lightning_module
        trainer = attached_trainer(lightning_module) if lightning_module is not None else None
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING and self._layer_sync:
            assert self.model is not None
            log.debug("%s: sync_batchnorm: reverting SyncBatchNorm layers to BatchNorm", type(self).__name__)
            self.model = self._layer_sync.revert(self.model)
        super().teardown()
        process_group.leave_process_group(self)


PaddleDPStrategy.__doc__ = PaddleDPStrategy.__doc__.format(options=options_doc(TRAINER))
# `import lit_dp` loads this module once Lightning is imported (see lit_dp/__init__.py).
PaddleDPStrategy.register_strategies(StrategyRegistry)
