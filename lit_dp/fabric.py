"""``lit_dp.fabric.PaddleDPStrategy``: ``Fabric(strategy="paddle_dp")`` for hand-written loops.

The Fabric twin of ``lit_dp.PaddleDPStrategy``, as Lightning has a ``DDPStrategy`` in
``lightning.fabric.strategies`` next to the Trainer's: same options, same registered names, the
same ``lit_dp.DataParallel``. ``fabric.setup(model, optimizer)`` wraps the model,
``fabric.backward`` synchronises, ``fabric.no_backward_sync(model)`` is ``DataParallel.no_sync``,
and checkpoints hold the bare module's state (no wrapper prefix).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.strategies import ParallelStrategy
from lightning.fabric.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.strategies.strategy import TBroadcast, _BackwardSyncControl
from lightning.fabric.utilities.distributed import ReduceOp, _sync_ddp_if_available
from torch import Tensor
from torch.nn import Module
from typing_extensions import override

from lit_dp.cluster_environment import PaddleEnvironment
from lit_dp.comm_hooks import merge_lightning_names
from lit_dp.data_parallel import DataParallel
from lit_dp.process_group import barrier, broadcast_object, destroy_parallel_env
from lit_dp.strategy_base import DataParallelStrategyMixin, register_families

FABRIC_UNUSED_PARAMETERS_MESSAGE = (
    "It looks like your model has parameters that were not used in producing the loss passed to "
    "fabric.backward. If this is intentional, you must enable the detection of unused parameters in lit_dp, either "
    "by setting the string value `Fabric(strategy='paddle_dp_find_unused_parameters_true')` or by setting the flag "
    "in the strategy with `Fabric(strategy=lit_dp.fabric.PaddleDPStrategy(find_unused_parameters=True))`."
)


class PaddleDPStrategy(DataParallelStrategyMixin, ParallelStrategy):
    """Data parallelism with lit_dp's bucketed reducer in Fabric, one process per device.

    Options as ``lit_dp.PaddleDPStrategy`` (the Trainer's): ``comm_buffer_size``,
    ``last_comm_buffer_size``, ``find_unused_parameters``, ``gradient_as_bucket_view``,
    ``backend``, ``nrings``, ``timeout``, ``start_method``, the communication hooks
    (``comm_hook``, ``comm_state``, ``comm_wrapper``, ``comm_dtype``, ``powersgd_rank``,
    ``powersgd_start_iter`` and Lightning's ``ddp_comm_*`` names), ``comm_stats``, ``trace_dir``
    and ``trace_steps`` (read the statistics with ``module.comm_stats()``). LocalSGD, which
    acts after each optimizer step, is ``lit_dp.LocalSGD`` in a Fabric loop. One device gets a
    process group of one rank and a wrapped model, as under Fabric's ``"ddp"``.
    """

    _launchers = (_SubprocessScriptLauncher, _MultiProcessingLauncher)
    _unused_parameters_message = FABRIC_UNUSED_PARAMETERS_MESSAGE

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        comm_buffer_size: float = 25,
        last_comm_buffer_size: float = 1,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        backend: str = "auto",
        nrings: int | None = None,
        timeout: timedelta | float | None = None,
        start_method: str = "popen",
        comm_hook: str | Callable | None = None,
        comm_state: object = None,
        comm_wrapper: Callable | None = None,
        comm_dtype: str | None = None,
        powersgd_rank: int | None = None,
        powersgd_start_iter: int | None = None,
        ddp_comm_hook: Callable | None = None,
        ddp_comm_state: object = None,
        ddp_comm_wrapper: Callable | None = None,
        comm_stats: bool = False,
        trace_dir: str | None = None,
        trace_steps: tuple[int, int] = (1, 4),
    ) -> None:
        comm_hook = merge_lightning_names("comm_hook", comm_hook, "ddp_comm_hook", ddp_comm_hook)
        comm_state = merge_lightning_names("comm_state", comm_state, "ddp_comm_state", ddp_comm_state)
        comm_wrapper = merge_lightning_names("comm_wrapper", comm_wrapper, "ddp_comm_wrapper", ddp_comm_wrapper)
        if cluster_environment is None and PaddleEnvironment.detect():
            cluster_environment = PaddleEnvironment()
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
        )
        self._keep_options(
            comm_buffer_size=comm_buffer_size,
            last_comm_buffer_size=last_comm_buffer_size,
            find_unused_parameters=find_unused_parameters,
            gradient_as_bucket_view=gradient_as_bucket_view,
            backend=backend,
            nrings=nrings,
            timeout=timeout,
            start_method=start_method,
            comm_hook=comm_hook,
            comm_state=comm_state,
            comm_wrapper=comm_wrapper,
            comm_dtype=comm_dtype,
            powersgd_rank=powersgd_rank,
            powersgd_start_iter=powersgd_start_iter,
            comm_stats=comm_stats,
            trace_dir=trace_dir,
            trace_steps=trace_steps,
        )
        self._backward_sync_control = _PaddleDPBackwardSyncControl()

    @property
    def comm_buffer_size(self) -> float:
        return self._comm_buffer_size

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._init_process_group()

    @override
    def setup_module(self, module: Module) -> DataParallel:
        return self._wrap(module, self._comm_buffer_size)

    @override
    def module_to_device(self, module: Module) -> None:
        module.to(self.root_device)

    @override
    def all_reduce(
        self, tensor: Tensor, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        barrier(self.root_device)

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        return broadcast_object(obj, src)

    @override
    def get_module_state_dict(self, module: Module) -> dict[str, Any]:
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
        super().teardown()
        destroy_parallel_env()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register_families(strategy_registry, cls)


class _PaddleDPBackwardSyncControl(_BackwardSyncControl):
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
