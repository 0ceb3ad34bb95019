"""What the Trainer's and Fabric's strategies share: options, process layout, collectives, features.

``lit_dp.PaddleDPStrategy`` (``Trainer(strategy="paddle_dp")``) and
``lit_dp.fabric.PaddleDPStrategy`` (``Fabric(strategy="paddle_dp")``) derive from different
Lightning base classes, as Lightning's two ``DDPStrategy`` classes do; what lit_dp adds to both
lives here once: the registered names, the constructor (the options, torch DDP's own arguments,
which Lightning's ``DDPStrategy`` passes through to ``DistributedDataParallel``, and the
features, ``lit_dp.strategies.registry``), the process layout, the strategy's own collectives
and the class's attributes that the features expose (``Feature.exposes``, made by
``lit_dp.strategies.exposed`` as the class is defined). The strategies keep front-door glue only: the
process group is brought up by ``lit_dp.strategies.process_group``, a model wrapped by
``lit_dp.strategies.wrapping``, and everything else is a feature's.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from lightning.fabric.plugins import ClusterEnvironment
from typing_extensions import override

from lit_dp.job.process_group import barrier, broadcast_object
from lit_dp.options import Options
from lit_dp.options.backends import AUTO
from lit_dp.options.signature import takes_options
from lit_dp.strategies import process_group
from lit_dp.strategies.checkpoint_io import AtomicCheckpointIO
from lit_dp.strategies.exposed import expose

from lit_dp.strategies.checkpointing import Checkpointing
from lit_dp.strategies.feature import Feature
from lit_dp.strategies.lightning_private import StrategyRegistryType, WrappingCheckpointIO
from lit_dp.strategies.process_group import default_backend, default_cluster_environment, process_group_timeout
from lit_dp.strategies.registry import build_features, serving
from lit_dp.strategies.wrapping import DDP_ARGUMENTS, Wrapping

# Lightning's `ddp`, `ddp_spawn`, `ddp_fork`, `ddp_notebook` with their start methods
# (lightning/pytorch/strategies/ddp.py); each also gets `_find_unused_parameters_true|false`.
FAMILIES = (
    ("paddle_dp", "popen"),
    ("paddle_dp_spawn", "spawn"),
    ("paddle_dp_fork", "fork"),
    ("paddle_dp_notebook", "fork"),
)

class DataParallelStrategyMixin:
    """Kept options, process layout, collectives and features, for both front doors.

    It comes before Lightning's ``ParallelStrategy`` (the Trainer's or Fabric's) in a strategy's
    bases: the Lightning overrides here are the same in both, and Lightning's two
    ``DDPStrategy`` classes write them twice. A concrete strategy names its Lightning launchers
    in ``_launchers`` (script launcher, multiprocessing launcher), the front door its options are
    checked for in ``_options_scope``, and the name its Lightning base gives the precision plugin
    in ``_precision_argument``; ``front_door`` gives its constructor the signature its options make.

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
    _launcher: Any
    _checkpoint_io: Any

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
        if values.get("process_group_backend", AUTO) is None:
            del values["process_group_backend"]  # Lightning's default: the device's own backend, our "auto"
        # Lightning DDPStrategy's attribute: torch DDP's arguments as given.
        self._ddp_kwargs = {name: value for name, value in values.items() if name in DDP_ARGUMENTS}
        self._wrapping = Wrapping(type(self).__name__, values, self._options_scope)
        values = {name: value for name, value in values.items() if name not in self._wrapping.arguments}
        if options is None:
            options = Options.build(values, self._options_scope)
        elif values:
            raise TypeError(
                f"{type(self).__name__}: pass options= or keyword options, not both (got {sorted(values)})."
            )
        self._options = options
        # Lightning DDPStrategy's attributes, the values in effect: ``strategy._timeout`` is the documented one.
        self._timeout = process_group_timeout(options)
        self._start_method = options.start_method
        self._num_nodes = 1
        self._atomic_checkpoint_io = AtomicCheckpointIO()
        # How checkpoints are written and read (state_dict_type, async_save), and the save in flight.
        self._checkpointing = Checkpointing(options, self._timeout)
        self._failed = False  # the run raised (on_exception): its end waits for no other rank
        # What the strategy does beside wrapping, each doing nothing until the run sets it up.
        self._features = build_features(options, self._options_scope)

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

    def feature(self, kind: type[Feature]) -> Any:
        """This strategy's feature of class ``kind`` (``lit_dp.strategies.registry``), None when its options
        leave it off or its front door has none: what a feature offers is read on it, with no strategy edit
        (``strategy.feature(LocalSGDSchedule).local_sgd``), or on the strategy where the feature exposes it
        (``strategy.local_sgd``)."""
        return self._features.find(kind)

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        # Inside each feature's `collective`: uneven inputs refuse one that cannot be matched; the hang
        # watchdog's thread watches its wait.
        with self._features.collective("barrier"):
            barrier(self.root_device)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        with self._features.collective("broadcast"):
            return broadcast_object(obj, src)

    def process_dataloader(self, dataloader: Any) -> Any:
        # Under the Trainer: called after Lightning restored the loops and before the first batch is fetched.
        return super().process_dataloader(self._features.process_dataloader(dataloader))  # type: ignore[misc]

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

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        script_launcher, multiprocessing_launcher = self._launchers
        if self._options.start_method == "popen":
            self._launcher = script_launcher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = multiprocessing_launcher(self, start_method=self._options.start_method)

    def set_world_ranks(self) -> None:
        """Lightning DDPStrategy's: this rank's place in the cluster environment (the Trainer calls it as it is
        built; both doors as the process group starts)."""
        process_group.set_world_ranks(self)

    @classmethod
    def register_strategies(cls, strategy_registry: StrategyRegistryType) -> None:
        register_families(strategy_registry, cls)


Strategy = TypeVar("Strategy", bound=type)


def front_door(cls: Strategy) -> Strategy:
    """Give a front door's class the attributes its features expose (``lit_dp.strategies.exposed``), and its
    constructor (its own, else the shared one) the signature its options make: its Lightning base's name for
    the precision plugin (which it takes through ``**values``) and every option of its scope as a typed keyword
    (``lit_dp.options.signature``): what ``inspect.signature``, ``help()`` and LightningCLI read."""
    # Before __init__ is replaced by the one below: the names the class's own __init__ sets are taken.
    expose(cls, serving(cls._options_scope))
    own: Callable[..., None] = cls.__init__

    def __init__(self: DataParallelStrategyMixin, *args: Any, **values: Any) -> None:
        own(self, *args, **values)

    shared = inspect.signature(DataParallelStrategyMixin.__init__, eval_str=True)
    parameters = [
        p.replace(name=cls._precision_argument) if p.name == "precision" else p for p in shared.parameters.values()
    ]
    __init__.__signature__ = shared.replace(parameters=parameters)  # type: ignore[attr-defined]
    __init__.__doc__ = DataParallelStrategyMixin.__init__.__doc__
    __init__.__qualname__ = f"{cls.__qualname__}.__init__"
    cls.__init__ = takes_options(cls._options_scope)(__init__)  # type: ignore[misc]
    return cls


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
