"""``lit_dp.fabric.PaddleDPStrategy``: ``Fabric(strategy="paddle_dp")`` for hand-written loops.

The Fabric twin of ``lit_dp.PaddleDPStrategy``, as Lightning has a ``DDPStrategy`` in
``lightning.fabric.strategies`` next to the Trainer's: same options, same registered names, the
same ``lit_dp.DataParallel``. ``fabric.setup(model, optimizer)`` wraps the model,
``fabric.backward`` synchronises, ``fabric.no_backward_sync(model)`` is ``DataParallel.no_sync``,
and checkpoints hold the bare module's state (no wrapper prefix). With ``sharding_stage`` the
optimizers set up with the model become ``lit_dp.ShardedOptimizer`` s, ``fabric.clip_gradients``
clips by the global norm, and ``fabric.save`` writes the consolidated optimizer state.
Ranks with different numbers of batches train inside ``with fabric.strategy.join(model):``
(torch's ``Join``, see ``lit_dp.join``).
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import Any

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.strategies import STRATEGY_REGISTRY, ParallelStrategy
from lightning.fabric.strategies.strategy import TBroadcast
from lightning.fabric.utilities.distributed import ReduceOp
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lit_dp.data_parallel import DataParallel
from lit_dp.job.process_group import barrier, broadcast_object
from lit_dp.join import DataParallelJoin
from lit_dp.observability.watchdog import HangWatchdog
from lit_dp.options import FABRIC, Options
from lit_dp.options.docs import options_doc
from lit_dp.options.signature import takes_options
from lit_dp.sharding import ShardedOptimizer
from lit_dp.strategies.base import DataParallelStrategyMixin, default_cluster_environment, register_families
from lit_dp.strategies.checkpoint_io import AtomicCheckpointIO
from lit_dp.strategies.fault_tolerance import FabricFaultTolerance, FaultTolerance
from lit_dp.strategies.lightning_private import (
    BackwardSyncControl,
    FabricMultiProcessingLauncher,
    FabricScriptLauncher,
    StrategyRegistryType,
    forward_module,
    sync_ddp_if_available,
)
from lit_dp.strategies.precision import handles_unscaling

log = logging.getLogger(__name__)


class PaddleDPStrategy(DataParallelStrategyMixin, ParallelStrategy):
    """Data parallelism with lit_dp's bucketed reducer in Fabric, one process per device.

    The first five arguments are Lightning's, set by Fabric. The options (``lit_dp.options``)
    are keyword arguments (Lightning ``DDPStrategy``'s names accepted for ours), or one
    ``options=Options.build(...)`` already validated:
{options}

    Read the statistics with ``module.comm_stats()``. LocalSGD, which acts after each optimizer
    step, is ``lit_dp.LocalSGD`` in a Fabric loop. One device gets a process group of one rank
    and a wrapped model, as under Fabric's ``"ddp"``.
    """

    _launchers = (FabricScriptLauncher, FabricMultiProcessingLauncher)
    _options_scope = FABRIC

    @takes_options(FABRIC)
    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        options: Options | None = None,
        **values: Any,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=default_cluster_environment(cluster_environment),
            # Kept unset unless given, as the Trainer's: Fabric refuses a strategy's own next to the
            # user's `plugins`; the default is supplied when read (`checkpoint_io`).
            checkpoint_io=checkpoint_io,
            precision=precision,
        )
        self._keep_options(options, values)
        self._atomic_checkpoint_io = AtomicCheckpointIO()
        self._backward_sync_control = _PaddleDPBackwardSyncControl()
        self._wrapped: DataParallel | None = None  # the model set up last: sharded optimizers read its owners
        self._sharded: list[ShardedOptimizer] = []
        # fault_tolerance="torchft" (lit_dp.strategies.fault_tolerance): settings checked here, the Manager at setup.
        self._fault_tolerance = (
            FabricFaultTolerance(FaultTolerance(self._options)) if self._options.fault_tolerance else None
        )

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        """The user's plugin as given (``Fabric(plugins=[...])`` or ``checkpoint_io=``), else ``AtomicCheckpointIO``."""
        return self._atomic_checkpoint_io if self._checkpoint_io is None else self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO) -> None:
        self._checkpoint_io = io

    @property
    def comm_buffer_size(self) -> float | str:
        """The bucket size in MB of the model set up last (``DataParallel.comm_buffer_size``: with
        ``"auto"``, the default while the first steps tune, then the tuned size); the option as
        given (a size, or ``"auto"``) before ``fabric.setup`` and after teardown."""
        if self._wrapped is not None:
            return self._wrapped.comm_buffer_size
        return self._options.comm_buffer_size

    @property
    def fault_tolerance(self) -> FaultTolerance | None:
        """With ``fault_tolerance="torchft"``: its ``committed_steps``, ``metrics()`` and ``manager``."""
        return self._fault_tolerance.ft if self._fault_tolerance is not None else None

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._init_process_group()

    @override
    def setup_module(self, module: Module) -> DataParallel:
        self._check_sharding_precision(self.precision)
        if self._fault_tolerance is not None:  # the Manager before the model it wraps; the module travels
            manager = self._fault_tolerance.manager(self.root_device, self.world_size)
            self._fault_tolerance.modules.append(module)
            self._wrapped = self._wrap(module, self._options, manager)
            return self._wrapped
        self._wrapped = self._wrap(module, self._options)
        return self._wrapped

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        log.debug(
            "%s: setting up %s%s",
            type(self).__name__,
            type(optimizer).__name__,
            "; its state is sent to a recovering replica group" if self._fault_tolerance is not None else "",
        )
        sharded = self._shard(optimizer, self._wrapped)
        if self._fault_tolerance is not None:
            self._fault_tolerance.optimizers.append(sharded)
        if isinstance(sharded, ShardedOptimizer):
            self._sharded.append(sharded)
        return sharded

    @override
    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        self._unscale_for_clipping(optimizer)
        if isinstance(optimizer, ShardedOptimizer):  # the norm over every rank's gradients
            return optimizer.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)
        parameters = self.precision.main_params(optimizer)
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite)

    @override
    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: float | int) -> None:
        self._unscale_for_clipping(optimizer)
        torch.nn.utils.clip_grad_value_(self.precision.main_params(optimizer), clip_val)

    def _unscale_for_clipping(self, optimizer: Optimizer) -> None:
        """Gradients unscaled before clipping, also an optimizer's that unscales in its step (``fused=True``).

        Fabric's ``MixedPrecision`` refuses those; torch lets ``GradScaler.unscale_`` run before
        ``step`` for them too, and the step then gets only the inf check, no scale.
        """
        scaler = getattr(self.precision, "scaler", None)
        if scaler is not None and handles_unscaling(optimizer):
            scaler.unscale_(optimizer)
        else:
            self.precision.unscale_gradients(optimizer)

    def join(
        self,
        module: Module,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> DataParallelJoin:
        """Train on uneven inputs in a hand-written loop: ``with fabric.strategy.join(model):``.

        ``model`` is what ``fabric.setup`` returned. Ranks that run out of batches shadow the
        others' synchronised steps until all have, then every rank holds the same parameters
        (``lit_dp.DataParallel.join``; the arguments are torch DDP's ``join``'s).
        """
        inner = forward_module(module)
        if not isinstance(inner, DataParallel):
            raise TypeError(
                f"{type(self).__name__}.join expects the module returned by fabric.setup (a lit_dp.DataParallel "
                f"inside), got {type(inner).__name__}."
            )
        return inner.join(divide_by_initial_world_size, enable, throw_on_early_termination)

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        if self._fault_tolerance is not None:  # dealt step by step to the replica groups present
            return self._fault_tolerance.process_dataloader(dataloader)
        return super().process_dataloader(dataloader)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        if self._fault_tolerance is not None:  # applied only if every replica group commits the step
            return self._fault_tolerance.optimizer_step(partial(super().optimizer_step, optimizer, **kwargs))
        return super().optimizer_step(optimizer, **kwargs)

    @override
    def module_to_device(self, module: Module) -> None:
        module.to(self.root_device)

    @override
    def all_reduce(
        self, tensor: Tensor, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor:
        if isinstance(tensor, Tensor):
            with self._watched("all_reduce"):
                return sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        with self._watched("barrier"):
            barrier(self.root_device)

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        with self._watched("broadcast"):
            return broadcast_object(obj, src)

    @override
    def save_checkpoint(
        self, path: Any, state: dict[str, Any], storage_options: Any | None = None, filter: Any | None = None
    ) -> None:
        # Rank 0 writes while the others go on to a barrier: a known phase of the hang watchdog.
        watchdog = self._hang_watchdog
        with watchdog.phase("saving a checkpoint") if watchdog is not None and self.is_global_zero else nullcontext():
            super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)

    @property
    def _hang_watchdog(self) -> HangWatchdog | None:
        """The hang watchdog of the model set up last, which watches the strategy's collectives (issue 27)."""
        return self._wrapped.watchdog if self._wrapped is not None else None

    def _watched(self, name: str) -> AbstractContextManager:
        # Through the model's waiter, watchdog or not: it also times the wait (the straggler report's exposed wait).
        return self._wrapped.waiter.outside(f"strategy.{name}") if self._wrapped is not None else nullcontext()

    @override
    def get_module_state_dict(self, module: Module) -> dict[str, Any]:
        for optimizer in self._sharded:  # with sharding_overlap the last gather may be in flight
            optimizer.wait_for_parameters()
        if isinstance(module, DataParallel):
            module = module.module
        return super().get_module_state_dict(module)

    @override
    def load_module_state_dict(self, module: Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        if isinstance(module, DataParallel):
            module = module.module
        super().load_module_state_dict(module=module, state_dict=state_dict, strict=strict)

    @override
    def teardown(self) -> None:
        log.debug("%s: tearing down strategy", type(self).__name__)
        for optimizer in self._sharded:
            optimizer.wait_for_parameters()
        self._wrapped, self._sharded = None, []
        if self._fault_tolerance is not None:
            self._fault_tolerance.ft.close()
        super().teardown()
        self._leave_process_group()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistryType) -> None:
        register_families(strategy_registry, cls)


class _PaddleDPBackwardSyncControl(BackwardSyncControl):
    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        """``DataParallel.no_sync``: forward and backward inside accumulate gradients locally."""
        if not enabled:
            return nullcontext()
        if not isinstance(module, DataParallel):
            raise TypeError(
                "Blocking backward sync is only possible if the module passed to"
                f" `{self.__class__.__name__}.no_backward_sync` is wrapped in `lit_dp.DataParallel`."
                f" Got: {module.__class__.__name__}."
            )
        return module.no_sync()


PaddleDPStrategy.__doc__ = PaddleDPStrategy.__doc__.format(options=options_doc(FABRIC))
# `import lit_dp` loads this module once Lightning is imported (see lit_dp/__init__.py).
PaddleDPStrategy.register_strategies(STRATEGY_REGISTRY)
