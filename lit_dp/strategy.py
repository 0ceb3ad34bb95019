"""``PaddleDPStrategy``: ``Trainer(strategy="paddle_dp")``.

Lightning launches the processes (or Paddle's launcher / torchrun / SLURM did); in each one the
strategy brings up the process group with ``init_parallel_env`` and wraps the LightningModule
in ``lit_dp.DataParallel``. On one device too: a group of one rank, as under ``"ddp"``.

The registered names copy Lightning's ``ddp`` families; what this strategy shares with the Fabric
one in ``lit_dp.fabric`` is in ``lit_dp.strategy_base``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator
from contextlib import contextmanager
from datetime import timedelta
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
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.strategy import TBroadcast, _ForwardRedirection
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.nn import Module
from typing_extensions import override

from lit_dp.autotune import AUTO, check_comm_buffer_size
from lit_dp.backends import check_backend
from lit_dp.broadcast import sync_params_buffers
from lit_dp.cluster_environment import PaddleEnvironment
from lit_dp.comm_hooks import describe_comm_hook, merge_lightning_names
from lit_dp.comm_stats import CommStatsMonitor
from lit_dp.config import check_local_sgd_options
from lit_dp.data_parallel import DataParallel
from lit_dp.local_sgd import LocalSGD
from lit_dp.process_group import barrier, broadcast_object, destroy_parallel_env
from lit_dp.strategy_base import (
    DataParallelStrategyMixin,
    lightning_name,
    register_families,
)

CHECKPOINT_KEY = "lit_dp"  # the strategy's own entry in Lightning checkpoints

# Lightning's own sentence (`DDPStrategy.on_exception`), which is what users search for, then ours.
LIGHTNING_UNUSED_PARAMETERS_MESSAGE = (
    "It looks like your LightningModule has parameters that were not used in producing the loss returned by "
    "training_step. If this is intentional, you must enable the detection of unused parameters in lit_dp, either "
    "by setting the string value `strategy='paddle_dp_find_unused_parameters_true'` or by setting the flag in the "
    "strategy with `strategy=PaddleDPStrategy(find_unused_parameters=True)` "
    "(`strategy.find_unused_parameters=true` on a recipe's command line)."
)

class PaddleDPStrategy(DataParallelStrategyMixin, ParallelStrategy):
    """Data parallelism with lit_dp's bucketed reducer, one process per device.

    Args:
        comm_buffer_size: bucket size limit in MB, or ``"auto"``: tuned during the first steps
            (``lit_dp.autotune``), then stored in checkpoints so a resumed run keeps it.
        last_comm_buffer_size: size limit in MB of the last bucket reduced in backward.
        find_unused_parameters: tolerate parameters that get no gradient in an iteration.
        gradient_as_bucket_view: make ``.grad`` tensors views into the bucket buffers.
        backend: ``"auto"`` (NCCL for CUDA devices, Gloo otherwise) or any backend
            torch.distributed reports available, passed through (``"gloo"``, ``"mpi"``,
            ``"cpu:gloo,cuda:nccl"``, ...), like ``DDPStrategy(process_group_backend=...)``.
        nrings: communicators to spread buckets over (1..8); default ``FLAGS_nccl_nrings`` or 1.
        timeout: bound on the rendezvous and every collective (timedelta or seconds); default
            ``PADDLE_PG_TIMEOUT`` or 30 minutes.
        start_method: ``"popen"`` runs the script again per process (like ``"ddp"``);
            ``"spawn"``/``"fork"``/``"forkserver"`` use multiprocessing (like ``"ddp_spawn"``).
        local_sgd_steps: LocalSGD (``lit_dp.LocalSGD``): after the warm-up, average the models
            every K optimizer steps instead of all-reducing gradients; None: off.
        local_sgd_warmup_steps: ordinary data-parallel optimizer steps before LocalSGD starts.
        local_sgd_adaptive: recompute K at each average from the loss and learning rate
            (Paddle's ``adaptive_localsgd``; automatic optimization only).
        model_averaging_period: Lightning's ``DDPStrategy`` name for ``local_sgd_steps``.
        comm_hook: a torch DDP communication hook ``hook(state, bucket)``, or by name ``"fp16"``,
            ``"bf16"``, ``"powersgd"`` (see docs/comm_hooks.md).
        comm_state: the state passed to a callable ``comm_hook`` (e.g. a ``PowerSGDState``).
        comm_wrapper: wraps ``comm_hook``, e.g. torch's ``fp16_compress_wrapper``.
        comm_dtype: ``"fp16"`` or ``"bf16"``: Paddle's half-precision all-reduce; with a
            ``comm_hook``, wraps it in torch's compress wrapper of that dtype.
        powersgd_rank / powersgd_start_iter: ``comm_hook="powersgd"``'s matrix approximation
            rank and first compressed iteration (torch's defaults: 1 and 1000).
        ddp_comm_hook / ddp_comm_state / ddp_comm_wrapper: Lightning ``DDPStrategy``'s names for
            ``comm_hook`` / ``comm_state`` / ``comm_wrapper``.
        comm_stats: log ``comm/*`` communication statistics every ``log_every_n_steps``
            (``lit_dp.comm_stats.CommStatsMonitor``).
        trace_dir: write a Chrome trace of the communication there, ``rank{R}.json``.
        trace_steps: the synchronised steps traced, ``(start, stop)``.
        bucket_cap_mb / process_group_backend: Lightning ``DDPStrategy``'s names for
            ``comm_buffer_size`` / ``backend``, so a ``DDPStrategy(...)`` moves by renaming the class.
    """

    strategy_name = "paddle_dp"
    _launchers = (_SubprocessScriptLauncher, _MultiProcessingLauncher)
    _unused_parameters_message = LIGHTNING_UNUSED_PARAMETERS_MESSAGE

    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        comm_buffer_size: float = 25,
        last_comm_buffer_size: float = 1,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        backend: str = "auto",
        nrings: int | None = None,
        timeout: timedelta | float | None = None,
        start_method: str = "popen",
        local_sgd_steps: int | None = None,
        local_sgd_warmup_steps: int = 0,
        local_sgd_adaptive: bool = False,
        model_averaging_period: int | None = None,
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
        bucket_cap_mb: float | None = None,
        process_group_backend: str | None = None,
    ) -> None:
        comm_buffer_size = lightning_name(
            "comm_buffer_size", comm_buffer_size, 25, "bucket_cap_mb", bucket_cap_mb, check_comm_buffer_size
        )
        backend = lightning_name("backend", backend, "auto", "process_group_backend", process_group_backend, check_backend)
        comm_hook = merge_lightning_names("comm_hook", comm_hook, "ddp_comm_hook", ddp_comm_hook)
        comm_state = merge_lightning_names("comm_state", comm_state, "ddp_comm_state", ddp_comm_state)
        comm_wrapper = merge_lightning_names("comm_wrapper", comm_wrapper, "ddp_comm_wrapper", ddp_comm_wrapper)
        local_sgd_steps = check_local_sgd_options(
            local_sgd_steps=local_sgd_steps,
            local_sgd_warmup_steps=local_sgd_warmup_steps,
            local_sgd_adaptive=local_sgd_adaptive,
            model_averaging_period=model_averaging_period,
            comm_hook=comm_hook,
        )
        if cluster_environment is None and PaddleEnvironment.detect():
            cluster_environment = PaddleEnvironment()
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
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
        self._forward_redirection = _ManualOptimizationRedirection()
        self._local_sgd_steps = local_sgd_steps
        self._local_sgd_warmup_steps = local_sgd_warmup_steps
        self._local_sgd_adaptive = local_sgd_adaptive
        self._local_sgd: LocalSGD | None = None
        self._local_sgd_resumed: dict[str, Any] | None = None  # from the checkpoint, until setup
        self._tuned_buffer_size: float | None = None  # with "auto": restored, or chosen by a finished fit

    @property
    def comm_buffer_size(self) -> float | str:
        """The bucket size in MB: with ``"auto"``, the tuned size once chosen (or restored)."""
        return self.tuned_comm_buffer_size or self._comm_buffer_size

    @property
    def tuned_comm_buffer_size(self) -> float | None:
        """With ``comm_buffer_size="auto"``: the size chosen in this run or restored from a checkpoint."""
        if self._tuned_buffer_size is not None:
            return self._tuned_buffer_size
        tuner = self.model.autotuner if isinstance(self.model, DataParallel) else None
        return tuner.chosen_mb if tuner is not None else None

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
        return (
            f"strategy=paddle_dp backend={self.process_group_backend} world_size={self.world_size} "
            f"devices={[str(d) for d in self.parallel_devices or []]} "
            f"comm_buffer_size={self._comm_buffer_size}{'' if self._comm_buffer_size == AUTO else 'MB'} "
            f"last_comm_buffer_size={self._last_comm_buffer_size}MB find_unused_parameters={self._find_unused_parameters} "
            f"gradient_as_bucket_view={self._gradient_as_bucket_view} local_sgd_steps={self._local_sgd_steps} "
            f"local_sgd_warmup_steps={self._local_sgd_warmup_steps} local_sgd_adaptive={self._local_sgd_adaptive} "
            f"comm_hook={describe_comm_hook(**self._comm_hook_options)} comm_stats={self._comm_stats}"
        )

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if fitting:
            self.model = self._setup_model(self.model)
            self._local_sgd = self._setup_local_sgd()
            self.setup_optimizers(trainer)
        elif dist.is_initialized():
            sync_params_buffers(self.model)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
        if fitting and (self._comm_stats or self._comm_buffer_size == AUTO):
            if not any(isinstance(callback, CommStatsMonitor) for callback in trainer.callbacks):
                trainer.callbacks.append(CommStatsMonitor())

    @override
    def _setup_model(self, model: Module) -> Module:
        if self._tuned_buffer_size is not None:
            size = self._tuned_buffer_size
            rank_zero_info(f"[lit_dp] comm_buffer_size=auto: {size:g} MB, tuned before (checkpoint or earlier fit)")
        return self._wrap(model, self.comm_buffer_size)

    def _setup_local_sgd(self) -> LocalSGD | None:
        if self._local_sgd_steps is None or not isinstance(self.model, DataParallel):
            return None
        assert self.lightning_module is not None
        if self._local_sgd_adaptive and not self.lightning_module.automatic_optimization:
            raise ValueError(
                "local_sgd_adaptive=True is not supported with manual optimization: the adaptive period needs the "
                "training loss, which only automatic optimization hands to the strategy. Use a fixed local_sgd_steps."
            )
        local_sgd = LocalSGD(
            self.model,
            self._local_sgd_steps,
            self._local_sgd_warmup_steps,
            adaptive=self._local_sgd_adaptive,
            comm_buffer_size=self._comm_buffer_size,
        )
        if self._local_sgd_resumed is not None:
            local_sgd.load_state_dict(self._local_sgd_resumed)
            self._local_sgd_resumed = None
        return local_sgd

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        # Every optimizer step counts, under automatic and manual optimization alike (manual steps
        # come through LightningOptimizer.step); accumulated micro-batches do not.
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._local_sgd is not None:
            loss = output if self._local_sgd_adaptive else None
            self._local_sgd.step(loss, optimizer.param_groups[0]["lr"])
        return output

    @override
    def on_train_end(self) -> None:
        if self._local_sgd is not None:
            self._local_sgd.finish()

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
        model = self.model
        if not isinstance(model, DataParallel) or model.reducer is None:
            return
        assert self.lightning_module is not None
        if not self.lightning_module.automatic_optimization and model.grad_need_sync and not model.skip_grad_sync:
            model.reducer.prepare_for_backward(closure_loss)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        barrier(self.root_device)

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        return broadcast_object(obj, src)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

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
        if tuned is not None and self._comm_buffer_size == AUTO:
            self._tuned_buffer_size = tuned
        self._local_sgd_resumed = own.get("local_sgd")
        return checkpoint

    @override
    def teardown(self) -> None:
        lightning_module = self.lightning_module
        self._local_sgd = None
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
