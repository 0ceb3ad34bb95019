"""What the Trainer's and Fabric's strategies share: options, process layout, process group, wrapping.

``lit_dp.PaddleDPStrategy`` (``Trainer(strategy="paddle_dp")``) and
``lit_dp.fabric.PaddleDPStrategy`` (``Fabric(strategy="paddle_dp")``) derive from different
Lightning base classes, as Lightning's two ``DDPStrategy`` classes do; what lit_dp adds to both
lives here once: the registered names, the options they keep (and torch DDP's own arguments,
which Lightning's ``DDPStrategy`` passes through to ``DistributedDataParallel``), how a process
finds its device, brings up the process group and wraps the model; the constructor, which
builds the features (``lit_dp.strategies.registry``), and what the features answer for both
(the tuned bucket size, fault tolerance, the strategy's own collectives, the data loaders).

The process group outlives the strategy, as under Lightning's ``"ddp"``: teardown leaves it
alive, so ``torch.distributed`` calls and ``strategy.barrier()`` work after ``fit``, and a
later ``fit`` or ``test`` in the same process adopts it instead of meeting the other ranks
again. Under NCCL it is destroyed when the process exits, as Lightning does.
"""

from __future__ import annotations

import atexit
import inspect
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lit_dp.data_parallel import DataParallel
from lit_dp.job.env import ParallelEnv
from lit_dp.job.launcher import PADDLE, describe_job, detect_launcher
from lit_dp.job.process_group import barrier, broadcast_object, destroy_parallel_env, init_parallel_env, resolve_timeout
from lit_dp.options import Options, declared_options
from lit_dp.options.backends import AUTO
from lit_dp.options.signature import takes_options
from lit_dp.options.spelling import Spellings
from lit_dp.sharding import ShardedOptimizer
from lit_dp.strategies.checkpoint_io import AtomicCheckpointIO
from lit_dp.fault_tolerance.manager import FaultTolerance
from lit_dp.strategies.fault_tolerance import FaultToleranceFeature
from lit_dp.strategies.feature import Feature
from lit_dp.strategies.lightning_private import StrategyRegistryType, WrappingCheckpointIO
from lit_dp.strategies.registry import build_features
from lit_dp.strategies.tuned_size import TunedBufferSize

log = logging.getLogger(__name__)

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

    It comes before Lightning's ``ParallelStrategy`` (the Trainer's or Fabric's) in a strategy's
    bases: the Lightning overrides here are the same in both, and Lightning's two
    ``DDPStrategy`` classes write them twice. A concrete strategy names its Lightning launchers
    in ``_launchers`` (script launcher, multiprocessing launcher), the front door its options are
    checked for in ``_options_scope``, the name its Lightning base gives the precision plugin in
    ``_precision_argument``, and the model it wrapped in ``_data_parallel``.

    The first five arguments are Lightning's, set by the Trainer or Fabric (the fifth is the
    precision plugin, also taken by the base's name for it: ``precision_plugin`` under the
    Trainer, ``precision`` under Fabric). The options are keyword arguments, or one
    ``options=Options.build(...)`` already validated.
    """

    # The concrete strategy's.
    _launchers: tuple[type, type]
    _options_scope: str
    _precision_argument: str
    # Lightning's ParallelStrategy's.
    cluster_environment: ClusterEnvironment | None
    parallel_devices: list[torch.device] | None
    local_rank: int
    node_rank: int
    global_rank: int
    world_size: int
    _launcher: Any
    _checkpoint_io: Any
    is_global_zero: bool

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: Any = None,
        precision: Any = None,
        options: Options | None = None,
        **values: Any,
    ) -> None:
        precision = values.pop(self._precision_argument, precision)
        super().__init__(  # type: ignore[call-arg]
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=default_cluster_environment(cluster_environment),
            # Kept unset unless given, as under "ddp": Lightning refuses a strategy's own next to the
            # user's `plugins`; the default is supplied when read (`checkpoint_io`).
            checkpoint_io=checkpoint_io,
            **{self._precision_argument: precision},
        )
        self._keep_options(options, values)
        self._atomic_checkpoint_io = AtomicCheckpointIO()
        # What the strategy does beside wrapping, each doing nothing until the run sets it up.
        self._features = build_features(self._options, self._options_scope)
        self._init_front_door()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "_options_scope" in cls.__dict__:  # a front door (not a registered name's class, which keeps its own)
            cls.__init__ = _front_door_init(cls._options_scope, cls._precision_argument)  # type: ignore[method-assign]

    def _init_front_door(self) -> None:
        """The rest of the constructor, the concrete strategy's own."""

    @property
    def checkpoint_io(self) -> Any:
        """The user's plugin as given (``plugins=[...]`` or ``checkpoint_io=``), else ``AtomicCheckpointIO``,
        also under a wrapping plugin given without its own base (``AsyncCheckpointIO()``), where
        Lightning puts its default."""
        if self._checkpoint_io is None:
            return self._atomic_checkpoint_io
        if isinstance(self._checkpoint_io, WrappingCheckpointIO):
            self._checkpoint_io.checkpoint_io = self._atomic_checkpoint_io  # sets only a base not yet given
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: Any) -> None:
        self._checkpoint_io = io

    @property
    def _data_parallel(self) -> DataParallel | None:
        """The model this strategy wrapped (Fabric: the one set up last), while it runs."""
        raise NotImplementedError

    def feature(self, kind: type[Feature]) -> Any:
        """This strategy's feature of class ``kind`` (``lit_dp.strategies.registry``), None when its options
        leave it off or its front door has none: what a feature offers is read on it, with no strategy edit
        (``strategy.feature(LocalSGDSchedule).local_sgd``)."""
        return self._features.find(kind)

    @property
    def comm_buffer_size(self) -> float | str:
        """The bucket size in MB: the fixed size; with ``"auto"``, the tuned size once chosen or
        kept (restored from a checkpoint, or chosen by an earlier run: ``tuned_comm_buffer_size``),
        the default while the first steps tune (``DataParallel.comm_buffer_size``), and ``"auto"``
        before a model is wrapped."""
        if self.tuned_comm_buffer_size is not None:
            return self.tuned_comm_buffer_size
        if self._data_parallel is not None:
            return self._data_parallel.comm_buffer_size
        return self._options.comm_buffer_size

    @property
    def tuned_comm_buffer_size(self) -> float | None:
        """With ``comm_buffer_size="auto"``: the size chosen in this run, or kept from an earlier one or a checkpoint."""
        tuned = self._features.find(TunedBufferSize)
        return tuned.size if tuned is not None else None

    @property
    def fault_tolerance(self) -> FaultTolerance | None:
        """With ``fault_tolerance="torchft"``: its ``committed_steps``, ``metrics()`` and ``manager``."""
        feature = self._features.find(FaultToleranceFeature)
        return feature.ft if feature is not None else None

    @property
    def joined(self) -> bool:
        """This rank has no batch of its own for the current step and takes the others' collectives
        without one (the Trainer's ``uneven_inputs``)."""
        return self._features.joined

    @contextmanager
    def _collective(self, name: str) -> Iterator[None]:
        """One of the strategy's own collectives, inside each feature's ``collective`` (uneven inputs
        refuse one that cannot be matched; the hang watchdog's thread watches its wait)."""
        with self._features.collective(name):
            yield

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        with self._collective("barrier"):
            barrier(self.root_device)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        with self._collective("broadcast"):
            return broadcast_object(obj, src)

    def process_dataloader(self, dataloader: Any) -> Any:
        # Under the Trainer: called after Lightning restored the loops and before the first batch is fetched.
        return super().process_dataloader(self._features.process_dataloader(dataloader))  # type: ignore[misc]

    def _wrap_for_run(self, module: Module, run: Any) -> DataParallel:
        """``module`` in ``DataParallel`` with the arguments the features give (``Feature.wrapper_arguments``)."""
        arguments = self._features.wrapper_arguments(run, {"options": self._options})
        return self._wrap(module, **arguments)

    def _keep_options(self, options: Options | None, values: dict[str, Any]) -> None:
        """Keep ``options`` (validated where they entered, e.g. a recipe's config), or validate
        the keyword ``values`` once (a ``ValueError`` naming the option); keep torch DDP's own
        arguments among ``values`` for the wrapper (``wrapper_arguments``)."""
        if values.get("process_group_backend", AUTO) is None:
            del values["process_group_backend"]  # Lightning's default: the device's own backend, our "auto"
        self._ddp_kwargs = {name: value for name, value in values.items() if name in DDP_ARGUMENTS}
        self._wrapper_arguments = wrapper_arguments(values, self._options_scope)
        values = {name: value for name, value in values.items() if name not in self._wrapper_arguments}
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

    def _get_process_group_backend(self) -> str:
        """Lightning ``DDPStrategy``'s name for ``process_group_backend``."""
        return self.process_group_backend

    @property
    def _timeout(self) -> timedelta:
        """The process group's timeout in effect (Lightning ``DDPStrategy``'s attribute): the
        ``timeout`` option, else ``PADDLE_PG_TIMEOUT``, else 30 minutes, as under ``"ddp"``."""
        paddle = {name: os.environ[name] for name in ("PADDLE_PG_TIMEOUT",) if name in os.environ}
        return resolve_timeout(self._options.timeout, ParallelEnv(paddle))

    @property
    def _start_method(self) -> str:
        """Lightning ``DDPStrategy``'s attribute: ``popen``, ``spawn``, ``fork`` or ``forkserver``."""
        return self._options.start_method

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
        """Ranks, then the process group: one rank's own for a single process, as under ``"ddp"``;
        a group that exists already (an earlier ``fit`` in this process, the user's) is adopted."""
        name = type(self).__name__
        log.debug("%s: setting up distributed...", name)
        self.set_world_ranks()
        environment = lightning_parallel_env(
            self.cluster_environment, self.global_rank, self.world_size, self.root_device, self._options.nrings
        )
        adopting = dist.is_initialized()
        if adopting and dist.get_world_size() != self.world_size:
            raise RuntimeError(
                f"{name}: a process group of world size {dist.get_world_size()} already exists in this process, but "
                f"this run has world size {self.world_size}. The group of an earlier run outlives it (as under "
                '"ddp"), and a forked rank inherits the launching process\'s. Call '
                "torch.distributed.destroy_process_group() before this run, or start it in fresh processes "
                "(start_method 'popen' or 'spawn')."
            )
        if adopting:
            log.debug(
                "%s: adopting the existing process group (backend %s, world size %d) instead of creating one",
                name,
                dist.get_backend(),
                dist.get_world_size(),
            )
        else:
            auto = f" (backend=auto, device {self.root_device})" if self._options.backend == AUTO else ""
            log.debug(
                "%s: creating the process group: rank %d of %d from %s, backend %s%s, timeout %s, %d ring(s)",
                name,
                self.global_rank,
                self.world_size,
                type(self.cluster_environment).__name__,
                self.process_group_backend,
                auto,
                self._timeout,
                environment.nrings,
            )
        init_parallel_env(
            self.process_group_backend, self._options.timeout, parallel_env=environment, one_process_group=True
        )
        if not adopting:
            # At exit, as Lightning does under NCCL (torch warns of an NCCL group never destroyed);
            # under Gloo too: a group alive while the interpreter ends can abort the process
            # ("terminate called without an active exception") after a fit that finished.
            atexit.register(destroy_parallel_env)

    def _leave_process_group(self) -> None:
        """Teardown's part: nothing, as under ``"ddp"`` (the group serves ``dist.*`` calls after ``fit``)."""
        if dist.is_initialized():
            log.debug(
                "%s: leaving the process group alive, as \"ddp\" does (torch.distributed.destroy_process_group() "
                "ends it)",
                type(self).__name__,
            )

    def _shard(self, optimizer: Optimizer, model: Module | None) -> Optimizer:
        """``optimizer`` rebuilt over this rank's parameters under ``sharding_stage``; unchanged otherwise."""
        if self._options.sharding.stage is None or isinstance(optimizer, ShardedOptimizer):
            return optimizer
        if not isinstance(model, DataParallel):
            raise RuntimeError(
                f"sharding_stage={self._options.sharding.stage}: set up the model (lit_dp.DataParallel) before its "
                "optimizers, so that they know which parameters this rank owns."
            )
        log.debug(
            "%s: sharding.stage=%s: %s rebuilt over this rank's parameters (lit_dp.ShardedOptimizer)",
            type(self).__name__,
            self._options.sharding.stage,
            type(optimizer).__name__,
        )
        return ShardedOptimizer(optimizer, model)

    def _check_sharding_precision(self, precision: Any) -> None:
        """Refuse a gradient scaler with stage 2: it looks for infs in this rank's gradients only, so
        ranks could disagree on skipping a step."""
        if self._options.sharding.stage == 2 and getattr(precision, "scaler", None) is not None:
            raise ValueError(
                "sharding_stage=2 with precision='16-mixed' (a gradient scaler) is invalid: each rank holds only its "
                "own gradients, so the scaler's inf checks would differ between ranks; expected precision "
                "'bf16-mixed' or '32-true', or sharding_stage=1."
            )

    def _wrap(self, module: Module, options: Options, **features_arguments: Any) -> DataParallel:
        """``module`` in ``DataParallel``; with a torchft ``manager`` among ``features_arguments``, over its replica groups."""
        name = type(self).__name__
        arguments = {**self._wrapper_arguments, **features_arguments}
        shown = "".join(f", {key}={value!r}" for key, value in arguments.items())
        log.debug("%s: wrapping %s in lit_dp.DataParallel with %s%s", name, type(module).__name__, options, shown)
        wrapped = DataParallel(module, options=options, **arguments)
        if wrapped.watchdog is not None:
            log.debug("%s: hang watchdog started (hang_timeout=%ss)", name, options.hang_timeout)
        else:
            log.debug(
                "%s: no hang watchdog (hang_timeout=%s, world size %d)", name, options.hang_timeout, self.world_size
            )
        return wrapped


def _front_door_init(scope: str, precision_argument: str) -> Callable[..., None]:
    """The shared constructor as one front door shows it: its Lightning base's name for the precision
    plugin (which it takes through ``**values``) and every option of ``scope`` as a typed keyword
    (``lit_dp.options.signature``): what ``inspect.signature``, ``help()`` and LightningCLI read."""

    def __init__(self: DataParallelStrategyMixin, *args: Any, **values: Any) -> None:
        DataParallelStrategyMixin.__init__(self, *args, **values)

    shared = inspect.signature(DataParallelStrategyMixin.__init__, eval_str=True)
    parameters = [p.replace(name=precision_argument) if p.name == "precision" else p for p in shared.parameters.values()]
    __init__.__signature__ = shared.replace(parameters=parameters)  # type: ignore[attr-defined]
    __init__.__doc__ = DataParallelStrategyMixin.__init__.__doc__
    return takes_options(scope)(__init__)


# torch DDP's constructor arguments (without ``self``). Lightning's DDPStrategy passes those it
# is given to DistributedDataParallel (its ``**kwargs``); these strategies take the same.
DDP_ARGUMENTS = tuple(inspect.signature(DistributedDataParallel.__init__).parameters)[1:]
# What the strategy decides itself, as Lightning's does, with what to do instead.
SET_BY_THE_STRATEGY = {
    "module": "the strategy wraps the LightningModule (Trainer) or the module given to fabric.setup (Fabric)",
    "device_ids": "one process per device: each rank's device comes from the Trainer's or Fabric's devices=",
    "output_device": "one process per device: outputs stay on each rank's device, from devices=",
    "process_group": "the strategy creates the process group (init_parallel_env) or adopts an existing one; for "
    "a group of your own, wrap the model in lit_dp.DataParallel(model, group=...) in a loop of your own",
    "device_mesh": "the strategy creates the process group (init_parallel_env) or adopts an existing one; for "
    "a group of your own, wrap the model in lit_dp.DataParallel(model, group=...) in a loop of your own",
}


def wrapper_arguments(values: dict[str, Any], scope: str) -> dict[str, Any]:
    """torch DDP's own arguments among ``values`` (those no lit_dp option of ``scope`` takes), for
    ``lit_dp.DataParallel``, which implements each that it names.

    Raises:
        ValueError: for an argument the strategy sets itself, or one ``DataParallel`` does not take.
    """
    ours = Spellings(declared_options(scope), scope, nested=False)
    taken = inspect.signature(DataParallel.__init__).parameters
    arguments = {}
    for name, value in values.items():
        if name in SET_BY_THE_STRATEGY:
            raise ValueError(f"{name}={value!r}: the strategy sets it itself ({SET_BY_THE_STRATEGY[name]}).")
        if name not in DDP_ARGUMENTS or name in ours.accepted or name in ours.groups:
            continue
        if name not in taken:
            raise ValueError(
                f"{name}={value!r} is an argument of torch's DistributedDataParallel that lit_dp.DataParallel does "
                "not take: docs/strategy.md (\"Moving from ddp\") says what lit_dp does instead."
            )
        arguments[name] = value
    return arguments


def register_families(registry: StrategyRegistryType, strategy: type) -> None:
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
    None: Lightning then detects torchrun, SLURM, ... itself, in the order ``init_parallel_env``
    follows too: ``lit_dp.job.launcher``, whose refusals apply here alike)."""
    # Imported here: importing cluster_environment first imports Lightning, whose import loads
    # this module (lit_dp/__init__.py); a module-level import would meet it half-initialised.
    from lit_dp.job.cluster_environment import PaddleEnvironment

    if given is None and detect_launcher() == PADDLE:
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
    return describe_job(
        global_rank,
        world_size,
        cluster_environment.main_address,
        cluster_environment.main_port,
        device.index or 0,
        nrings=nrings,
    )
