"""``PaddleDPStrategy``: ``Trainer(strategy="paddle_dp")``.

Lightning launches the processes (or Paddle's launcher / torchrun / SLURM did); in each one the
strategy brings up the process group with ``init_parallel_env`` and wraps the LightningModule
in ``lit_dp.DataParallel``.
"""

from __future__ import annotations

import os
from collections.abc import Generator
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
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.nn import Module
from typing_extensions import override

from lit_dp.autotune import AUTO
from lit_dp.broadcast import sync_params_buffers
from lit_dp.cluster_environment import PaddleEnvironment
from lit_dp.comm_stats import CommStatsMonitor, check_trace_steps
from lit_dp.config import check_strategy_options
from lit_dp.data_parallel import DataParallel
from lit_dp.env import ParallelEnv
from lit_dp.process_group import destroy_parallel_env, init_parallel_env
from lit_dp.reducer import UNUSED_PARAMETERS_HINT

CHECKPOINT_KEY = "lit_dp"  # the strategy's own entry in Lightning checkpoints

LIGHTNING_UNUSED_PARAMETERS_HINT = (
    "If this is intentional, enable unused-parameter detection: "
    "`Trainer(strategy=PaddleDPStrategy(find_unused_parameters=True))`, or "
    "`strategy.find_unused_parameters=true` on a recipe's command line."
)


class PaddleDPStrategy(ParallelStrategy):
    """Data parallelism with lit_dp's bucketed reducer, one process per device.

    Args:
        comm_buffer_size: bucket size limit in MB, or ``"auto"``: tuned during the first steps
            (``lit_dp.autotune``), then stored in checkpoints so a resumed run keeps it.
        last_comm_buffer_size: size limit in MB of the last bucket reduced in backward.
        find_unused_parameters: tolerate parameters that get no gradient in an iteration.
        gradient_as_bucket_view: make ``.grad`` tensors views into the bucket buffers.
        backend: ``"auto"`` (NCCL for CUDA devices, Gloo otherwise), ``"nccl"`` or ``"gloo"``.
        nrings: communicators to spread buckets over (1..8); default ``FLAGS_nccl_nrings`` or 1.
        timeout: bound on the rendezvous and every collective (timedelta or seconds); default
            ``PADDLE_PG_TIMEOUT`` or 30 minutes.
        start_method: ``"popen"`` runs the script again per process (like ``"ddp"``);
            ``"spawn"``/``"fork"``/``"forkserver"`` use multiprocessing (like ``"ddp_spawn"``).
        comm_stats: log ``comm/*`` communication statistics every ``log_every_n_steps``
            (``lit_dp.comm_stats.CommStatsMonitor``).
        trace_dir: write a Chrome trace of the communication there, ``rank{R}.json``.
        trace_steps: the synchronised steps traced, ``(start, stop)``.
    """

    strategy_name = "paddle_dp"

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
        comm_stats: bool = False,
        trace_dir: str | None = None,
        trace_steps: tuple[int, int] = (1, 4),
    ) -> None:
        check_strategy_options(
            comm_buffer_size=comm_buffer_size,
            last_comm_buffer_size=last_comm_buffer_size,
            find_unused_parameters=find_unused_parameters,
            gradient_as_bucket_view=gradient_as_bucket_view,
            backend=backend,
            nrings=nrings,
            timeout=timeout,
            start_method=start_method,
            comm_stats=comm_stats,
            trace_dir=trace_dir,
            trace_steps=trace_steps,
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
        # Hydra hands integers (`comm_buffer_size=5`) to this Any-typed option; sizes are floats.
        self._comm_buffer_size = comm_buffer_size if comm_buffer_size == AUTO else float(comm_buffer_size)
        self._last_comm_buffer_size = last_comm_buffer_size
        self._find_unused_parameters = find_unused_parameters
        self._gradient_as_bucket_view = gradient_as_bucket_view
        self._backend = backend.lower()
        self._nrings = nrings
        self._timeout = timeout
        self._start_method = start_method
        self._num_nodes = 1
        self._forward_redirection = _ManualOptimizationRedirection()
        self._comm_stats = comm_stats
        self._trace_dir = trace_dir
        self._trace_steps = check_trace_steps("trace_steps", trace_steps)
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
    def comm_stats(self) -> bool:
        return self._comm_stats

    @property
    def last_comm_buffer_size(self) -> float:
        return self._last_comm_buffer_size

    @property
    def find_unused_parameters(self) -> bool:
        return self._find_unused_parameters

    @property
    def gradient_as_bucket_view(self) -> bool:
        return self._gradient_as_bucket_view

    @property
    def process_group_backend(self) -> str:
        """The backend in effect: ``auto`` resolved against this process's device."""
        if self._backend != "auto":
            return self._backend
        return "nccl" if self.root_device.type == "cuda" else "gloo"

    @property
    def is_distributed(self) -> bool:
        """Read by Lightning for strategies it does not know, e.g. to add a ``DistributedSampler``."""
        return True

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.setup_distributed()

    def setup_distributed(self) -> None:
        """Seed, ranks, then the process group (none for a single process)."""
        reset_seed()
        self.set_world_ranks()
        if self.world_size < 2:
            return
        init_parallel_env(self.process_group_backend, self._timeout, parallel_env=self._parallel_env())

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def _parallel_env(self) -> ParallelEnv:
        """The job as ``init_parallel_env`` reads it, from whichever cluster environment is in use.

        Paddle's ``FLAGS_nccl_nrings`` and ``PADDLE_PG_TIMEOUT`` still apply unless the
        strategy's own options override them.
        """
        assert self.cluster_environment is not None
        environ = {
            "PADDLE_TRAINER_ID": str(self.global_rank),
            "PADDLE_TRAINERS_NUM": str(self.world_size),
            "MASTER_ADDR": self.cluster_environment.main_address,
            "MASTER_PORT": str(self.cluster_environment.main_port),
            "FLAGS_selected_gpus": str(self.root_device.index or 0),
            "FLAGS_nccl_nrings": str(self._nrings or os.environ.get("FLAGS_nccl_nrings", "")),
            "PADDLE_PG_TIMEOUT": os.environ.get("PADDLE_PG_TIMEOUT", ""),
        }
        return ParallelEnv(environ)

    def describe(self) -> str:
        """One line with the settings in effect, for logs."""
        return (
            f"strategy=paddle_dp backend={self.process_group_backend} world_size={self.world_size} "
            f"devices={[str(d) for d in self.parallel_devices or []]} "
            f"comm_buffer_size={self._comm_buffer_size}{'' if self._comm_buffer_size == AUTO else 'MB'} "
            f"last_comm_buffer_size={self._last_comm_buffer_size}MB find_unused_parameters={self._find_unused_parameters} "
            f"gradient_as_bucket_view={self._gradient_as_bucket_view} comm_stats={self._comm_stats}"
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
        if not dist.is_initialized():
            rank_zero_info("paddle_dp: a single process; the model is not wrapped and no gradients are synchronised.")
            return model
        if self._tuned_buffer_size is not None:
            size = self._tuned_buffer_size
            rank_zero_info(f"[lit_dp] comm_buffer_size=auto: {size:g} MB, tuned before (checkpoint or earlier fit)")
        return DataParallel(
            model,
            comm_buffer_size=self.comm_buffer_size,
            last_comm_buffer_size=self._last_comm_buffer_size,
            find_unused_parameters=self._find_unused_parameters,
            gradient_as_bucket_view=self._gradient_as_bucket_view,
            comm_stats=self._comm_stats,
            trace_dir=self._trace_dir,
            trace_steps=self._trace_steps,
        )

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
        if not self.lightning_module.automatic_optimization and model.grad_need_sync:
            model.reducer.prepare_for_backward(closure_loss)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not dist.is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not dist.is_initialized():
            return obj
        container = [obj]
        dist.broadcast_object_list(container, src)
        return container[0]

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def on_exception(self, exception: BaseException) -> None:
        message = exception.args[0] if exception.args else None
        if isinstance(message, str) and UNUSED_PARAMETERS_HINT in message:
            exception.args = (message.replace(UNUSED_PARAMETERS_HINT, LIGHTNING_UNUSED_PARAMETERS_HINT),)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | os.PathLike, storage_options: Any | None = None
    ) -> None:
        tuned = self.tuned_comm_buffer_size
        if tuned is not None:
            checkpoint[CHECKPOINT_KEY] = {"tuned_comm_buffer_size": tuned}
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: str | os.PathLike, weights_only: bool | None = None) -> dict[str, Any]:
        # Lightning loads the checkpoint before `setup` wraps the model: the restored size
        # replaces "auto" there, and no step is spent tuning again.
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        tuned = checkpoint.get(CHECKPOINT_KEY, {}).get("tuned_comm_buffer_size")
        if tuned is not None and self._comm_buffer_size == AUTO:
            self._tuned_buffer_size = tuned
        return checkpoint

    @override
    def teardown(self) -> None:
        lightning_module = self.lightning_module
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
        for name, start_method in (("paddle_dp", "popen"), ("paddle_dp_spawn", "spawn")):
            strategy_registry.register(
                name,
                cls,
                description=f"lit_dp bucketed data parallelism, start_method '{start_method}'",
                override=True,
                start_method=start_method,
            )


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

