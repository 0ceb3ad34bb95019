"""What the Trainer's and Fabric's strategies share: options, process layout, process group, wrapping.

``lit_dp.PaddleDPStrategy`` (``Trainer(strategy="paddle_dp")``) and
``lit_dp.fabric.PaddleDPStrategy`` (``Fabric(strategy="paddle_dp")``) derive from different
Lightning base classes, as Lightning's two ``DDPStrategy`` classes do; what lit_dp adds to both
lives here once: the registered names, the options they keep, how a process finds its device,
brings up the process group and wraps the model.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Callable

import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch.nn import Module
from typing_extensions import override

from lit_dp.autotune import AUTO
from lit_dp.backends import check_backend
from lit_dp.comm_hooks import resolve_comm_hook
from lit_dp.comm_stats import check_trace_steps
from lit_dp.config import check_strategy_options
from lit_dp.data_parallel import DataParallel
from lit_dp.env import ParallelEnv
from lit_dp.process_group import init_parallel_env

# Lightning's `ddp`, `ddp_spawn`, `ddp_fork`, `ddp_notebook` with their start methods
# (lightning/pytorch/strategies/ddp.py); each also gets `_find_unused_parameters_true|false`.
FAMILIES = (
    ("paddle_dp", "popen"),
    ("paddle_dp_spawn", "spawn"),
    ("paddle_dp_fork", "fork"),
    ("paddle_dp_notebook", "fork"),
)



class DataParallelStrategyMixin:
    """Kept options, process layout, process group and wrapping, for both front doors.

    A concrete strategy hands its options to ``_keep_options`` (which validates them), names
    its Lightning launchers in ``_launchers`` (script launcher, multiprocessing launcher) and
    gives the sentence that opens a missing-gradient error in ``_unused_parameters_message``
    (Lightning's own, which is what users search for).
    """

    _launchers: tuple[type, type]
    _unused_parameters_message: str
    cluster_environment: ClusterEnvironment | None
    parallel_devices: list[torch.device] | None

    def _keep_options(
        self,
        *,
        comm_buffer_size: float | str,
        last_comm_buffer_size: float,
        find_unused_parameters: bool,
        gradient_as_bucket_view: bool,
        backend: str,
        nrings: int | None,
        timeout: timedelta | float | None,
        start_method: str,
        comm_hook: str | Callable | None,
        comm_state: object,
        comm_wrapper: Callable | None,
        comm_dtype: str | None,
        powersgd_rank: int | None,
        powersgd_start_iter: int | None,
        comm_stats: bool,
        trace_dir: str | None,
        trace_steps: tuple[int, int],
    ) -> None:
        """Validate the options (a ``ValueError`` naming the option) and keep them."""
        comm_hook_options = dict(
            comm_hook=comm_hook,
            comm_wrapper=comm_wrapper,
            comm_dtype=comm_dtype,
            powersgd_rank=powersgd_rank,
            powersgd_start_iter=powersgd_start_iter,
        )
        check_strategy_options(
            comm_buffer_size=comm_buffer_size,
            last_comm_buffer_size=last_comm_buffer_size,
            find_unused_parameters=find_unused_parameters,
            gradient_as_bucket_view=gradient_as_bucket_view,
            backend=backend,
            nrings=nrings,
            timeout=timeout,
            start_method=start_method,
            comm_state=comm_state,
            comm_stats=comm_stats,
            trace_dir=trace_dir,
            trace_steps=trace_steps,
            **comm_hook_options,
        )
        # Hydra hands integers (`comm_buffer_size=5`) to this Any-typed option; sizes are floats.
        self._comm_buffer_size = comm_buffer_size if comm_buffer_size == AUTO else float(comm_buffer_size)
        self._last_comm_buffer_size = last_comm_buffer_size
        self._find_unused_parameters = find_unused_parameters
        self._gradient_as_bucket_view = gradient_as_bucket_view
        self._backend = check_backend("backend", backend)
        self._nrings = nrings
        self._timeout = timeout
        self._start_method = start_method
        self._comm_hook_options = comm_hook_options
        self._comm_state = comm_state
        self._comm_stats = comm_stats
        self._trace_dir = trace_dir
        self._trace_steps = check_trace_steps("trace_steps", trace_steps)
        self._num_nodes = 1

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
    def comm_stats(self) -> bool:
        return self._comm_stats

    @property
    def process_group_backend(self) -> str:
        """The backend in effect: ``auto`` resolved against this process's device."""
        return self._backend if self._backend != AUTO else default_backend(self.root_device)

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
        script_launcher, multiprocessing_launcher = self._launchers
        if self._start_method == "popen":
            self._launcher = script_launcher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = multiprocessing_launcher(self, start_method=self._start_method)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def _init_process_group(self) -> None:
        """Ranks, then the process group: one rank's own for a single process, as under ``"ddp"``."""
        self.set_world_ranks()
        environment = lightning_parallel_env(
            self.cluster_environment, self.global_rank, self.world_size, self.root_device, self._nrings
        )
        init_parallel_env(self.process_group_backend, self._timeout, parallel_env=environment, one_process_group=True)

    def _wrap(self, module: Module, comm_buffer_size: float | str) -> DataParallel:
        wrapped = DataParallel(
            module,
            comm_buffer_size=comm_buffer_size,
            last_comm_buffer_size=self._last_comm_buffer_size,
            find_unused_parameters=self._find_unused_parameters,
            gradient_as_bucket_view=self._gradient_as_bucket_view,
            comm_stats=self._comm_stats,
            trace_dir=self._trace_dir,
            trace_steps=self._trace_steps,
        )
        if wrapped.reducer is not None:
            wrapped.reducer.unused_parameters_opening = self._unused_parameters_message
        # Built here, in each process: PowerSGD's state belongs to the process group.
        registration = resolve_comm_hook(comm_state=self._comm_state, **self._comm_hook_options)
        if registration is not None:
            wrapped.register_comm_hook(*registration)
        return wrapped


def lightning_name(
    option: str, value: Any, default: Any, lightning: str, lightning_value: Any, check: Callable[[str, Any], Any]
) -> Any:
    """``lightning_value`` (``DDPStrategy``'s spelling) when given, unless ``option`` says otherwise.

    ``check(name, value)`` validates it under the name the user typed.
    """
    if lightning_value is None:
        return value
    check(lightning, lightning_value)
    if value != default and value != lightning_value:
        raise ValueError(
            f"{option}={value!r} and {lightning}={lightning_value!r} disagree: they are the same option "
            f"({lightning} is Lightning's DDPStrategy name); pass one of them."
        )
    return lightning_value


def register_families(registry: _StrategyRegistry, strategy: type) -> None:
    """Register ``FAMILIES`` and their ``_find_unused_parameters_true|false`` forms for ``strategy``.

    Lower-case, like Lightning's: the Trainer and Fabric lower-case a name before looking it up.
    """
    for family, start_method in FAMILIES:
        registry.register(
            family,
            strategy,
            description=f"lit_dp bucketed data parallelism, start_method {start_method!r}",
            override=True,
            start_method=start_method,
        )
        for find_unused in (False, True):
            registry.register(
                f"{family}_find_unused_parameters_{str(find_unused).lower()}",
                strategy,
                description=f"lit_dp with find_unused_parameters={find_unused}, start_method {start_method!r}",
                override=True,
                find_unused_parameters=find_unused,
                start_method=start_method,
            )


def default_backend(device: torch.device) -> str:
    """What ``backend="auto"`` means for ``device``: NCCL for CUDA, Gloo otherwise (as under ``"ddp"``)."""
    return "nccl" if device.type == "cuda" else "gloo"


def lightning_parallel_env(
    cluster_environment: ClusterEnvironment | None,
    global_rank: int,
    world_size: int,
    device: torch.device,
    nrings: int | None,
) -> ParallelEnv:
    """The job as ``init_parallel_env`` reads it, from whichever Lightning cluster environment is in use.

    Paddle's ``FLAGS_nccl_nrings`` and ``PADDLE_PG_TIMEOUT`` still apply unless the
    strategy's own options override them.
    """
    assert cluster_environment is not None
    environ = {
        "PADDLE_TRAINER_ID": str(global_rank),
        "PADDLE_TRAINERS_NUM": str(world_size),
        "MASTER_ADDR": cluster_environment.main_address,
        "MASTER_PORT": str(cluster_environment.main_port),
        "FLAGS_selected_gpus": str(device.index or 0),
        "FLAGS_nccl_nrings": str(nrings or os.environ.get("FLAGS_nccl_nrings", "")),
        "PADDLE_PG_TIMEOUT": os.environ.get("PADDLE_PG_TIMEOUT", ""),
    }
    return ParallelEnv(environ)
