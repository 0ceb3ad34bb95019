"""What the Trainer's and Fabric's strategies share: options, process layout, process group, wrapping.

``lit_dp.PaddleDPStrategy`` (``Trainer(strategy="paddle_dp")``) and
``lit_dp.fabric.PaddleDPStrategy`` (``Fabric(strategy="paddle_dp")``) derive from different
Lightning base classes, as Lightning's two ``DDPStrategy`` classes do; what lit_dp adds to both
lives here once: the registered names, the options they keep, how a process finds its device,
brings up the process group and wraps the model.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lit_dp.data_parallel import DataParallel
from lit_dp.job.backends import AUTO
from lit_dp.job.env import ParallelEnv
from lit_dp.job.process_group import init_parallel_env
from lit_dp.options import Options
from lit_dp.sharding import ShardedOptimizer

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

    A concrete strategy builds its ``Options`` (``_keep_options``), names its Lightning
    launchers in ``_launchers`` (script launcher, multiprocessing launcher) and gives the
    sentence that opens a missing-gradient error in ``_unused_parameters_message`` (Lightning's
    own, which is what users search for).
    """

    _launchers: tuple[type, type]
    _unused_parameters_message: str
    _options_scope: str
    cluster_environment: ClusterEnvironment | None
    parallel_devices: list[torch.device] | None

    def _keep_options(self, options: Options | None, values: dict[str, Any]) -> None:
        """Keep ``options`` (validated where they entered, e.g. a recipe's config), or validate
        the keyword ``values`` once (a ``ValueError`` naming the option)."""
        if options is None:
            options = Options.build(values, self._options_scope)
        elif values:
            raise TypeError(f"{type(self).__name__}: pass options= or keyword options, not both (got {sorted(values)}).")
        self._options = options
        self._num_nodes = 1

    @property
    def options(self) -> Options:
        """The options in effect (``lit_dp.options``)."""
        return self._options

    @property
    def find_unused_parameters(self) -> bool:
        return self._options.find_unused_parameters

    @property
    def process_group_backend(self) -> str:
        """The backend in effect: ``auto`` resolved against this process's device."""
        backend = self._options.backend
        return backend if backend != AUTO else default_backend(self.root_device)

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
        if self._options.start_method == "popen":
            self._launcher = script_launcher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = multiprocessing_launcher(self, start_method=self._options.start_method)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def _init_process_group(self) -> None:
        """Ranks, then the process group: one rank's own for a single process, as under ``"ddp"``."""
        self.set_world_ranks()
        environment = lightning_parallel_env(
            self.cluster_environment, self.global_rank, self.world_size, self.root_device, self._options.nrings
        )
        init_parallel_env(
            self.process_group_backend, self._options.timeout, parallel_env=environment, one_process_group=True
        )

    def _shard(self, optimizer: Optimizer, model: Module | None) -> Optimizer:
        """``optimizer`` rebuilt over this rank's parameters under ``sharding_stage``; unchanged otherwise."""
        if self._options.sharding_stage is None or isinstance(optimizer, ShardedOptimizer):
            return optimizer
        if not isinstance(model, DataParallel):
            raise RuntimeError(
                f"sharding_stage={self._options.sharding_stage}: set up the model (lit_dp.DataParallel) before its "
                "optimizers, so that they know which parameters this rank owns."
            )
        return ShardedOptimizer(optimizer, model)

    def _check_sharding_precision(self, precision: Any) -> None:
        """Refuse a gradient scaler with stage 2: it looks for infs in this rank's gradients only, so
        ranks could disagree on skipping a step."""
        if self._options.sharding_stage == 2 and getattr(precision, "scaler", None) is not None:
            raise ValueError(
                "sharding_stage=2 with precision='16-mixed' (a gradient scaler) is invalid: each rank holds only its "
                "own gradients, so the scaler's inf checks would differ between ranks; expected precision "
                "'bf16-mixed' or '32-true', or sharding_stage=1."
            )

    def _wrap(self, module: Module, options: Options, manager: Any = None) -> DataParallel:
        return DataParallel(
            module, options=options, unused_parameters_message=self._unused_parameters_message, manager=manager
        )


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


def default_cluster_environment(given: ClusterEnvironment | None) -> ClusterEnvironment | None:
    """``given``, else ``PaddleEnvironment`` when Paddle's launcher started this process (else
    None: Lightning then detects torchrun, SLURM, ... itself)."""
    # Imported here: importing cluster_environment first imports Lightning, whose import loads
    # this module (lit_dp/__init__.py); a module-level import would meet it half-initialised.
    from lit_dp.job.cluster_environment import PaddleEnvironment

    if given is None and PaddleEnvironment.detect():
        return PaddleEnvironment()
    return given


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
