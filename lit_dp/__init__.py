"""lit_dp: Paddle-style data parallelism for PyTorch and Lightning.

``"paddle_dp"`` and the rest of its families (``_spawn``, ``_fork``, ``_notebook``, each with
``_find_unused_parameters_true|false``) are registered in the Trainer's strategy registry
(``lit_dp.PaddleDPStrategy``) and in Fabric's (``lit_dp.fabric.PaddleDPStrategy``) as soon as
both ``lit_dp`` and ``lightning`` are imported, in either order.

``import lit_dp`` itself imports torch and lit_dp's options only; each other public name loads
its module when it is first used. The Lightning layer (``lit_dp.strategies``) loads when
Lightning does, or when one of its names is first used. Importing Lightning costs seconds and,
through torchmetrics, loads matplotlib wherever it is installed; a user of ``DataParallel``
alone pays for neither. ``DataParallel``'s module loads torch's compiler (dynamo, about a second
more): a recipe's check of its command line, which needs only the options, pays for none of it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import Any

from lit_dp.job.orphans import bind_to_launcher as _bind_to_launcher
from lit_dp.options import Options
from lit_dp.options.warning import install as _install_warning_format

# The other public names, each loaded with its module on first use (PEP 562); the Lightning
# layer's among them.
_LAZY = {
    "DataParallel": ("lit_dp.data_parallel", "DataParallel"),
    "fused_allreduce_gradients": ("lit_dp.gradients.fused", "fused_allreduce_gradients"),
    "sync_params_buffers": ("lit_dp.gradients.broadcast", "sync_params_buffers"),
    "assign_group_by_size": ("lit_dp.gradients.buckets", "assign_group_by_size"),
    "Reducer": ("lit_dp.gradients.reducer", "Reducer"),
    "ParallelEnv": ("lit_dp.job.env", "ParallelEnv"),
    "destroy_parallel_env": ("lit_dp.job.process_group", "destroy_parallel_env"),
    "get_rings": ("lit_dp.job.process_group", "get_rings"),
    "init_parallel_env": ("lit_dp.job.process_group", "init_parallel_env"),
    "LocalSGD": ("lit_dp.local_sgd", "LocalSGD"),
    "ReplicaBatches": ("lit_dp.fault_tolerance.replica_data", "ReplicaBatches"),
    "ShardedOptimizer": ("lit_dp.sharding", "ShardedOptimizer"),
    "PaddleDPStrategy": ("lit_dp.strategies.trainer", "PaddleDPStrategy"),
    "PaddleEnvironment": ("lit_dp.job.cluster_environment", "PaddleEnvironment"),
    "fabric": ("lit_dp.fabric", None),
    "forecast": ("lit_dp.forecast", None),
}
# Each registers its strategy families when it is imported; the last gives each registered name
# of the Trainer's a class of that name, for LightningCLI (``--trainer.strategy=paddle_dp`` with options).
_REGISTERING_MODULES = ("lit_dp.strategies.trainer", "lit_dp.strategies.fabric", "lit_dp.strategies.registered_names")


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'lit_dp' has no attribute {name!r}")
    module_name, attribute = _LAZY[name]
    module = importlib.import_module(module_name)
    return module if attribute is None else getattr(module, attribute)


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


def _load_lightning_layer() -> None:
    for module_name in _REGISTERING_MODULES:
        importlib.import_module(module_name)


class _AfterLightningLoads(importlib.abc.MetaPathFinder):
    """Loads the Lightning layer right after ``lightning`` is imported, so its registries know us.

    Lightning has no entry point for third-party strategies; its registries are filled at
    import. Finding ``lightning``'s own spec and running our step after its module executes is
    the standard post-import hook; the finder removes itself on first use.
    """

    def find_spec(self, fullname: str, path: Any = None, target: ModuleType | None = None) -> Any:
        if fullname != "lightning":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or not isinstance(spec.loader, importlib.machinery.SourceFileLoader):
            return spec
        execute = spec.loader.exec_module

        def execute_then_load_ours(module: ModuleType) -> None:
            execute(module)
            _load_lightning_layer()

        spec.loader.exec_module = execute_then_load_ours  # type: ignore[method-assign]
        return spec


_install_warning_format()  # lit_dp's warnings read as its other lines, one `[lit_dp] ...` line each
_bind_to_launcher()  # a rank lit_dp's launcher started ends with it (lit_dp.job.orphans)

if "lightning" in sys.modules:
    _load_lightning_layer()
else:
    sys.meta_path.insert(0, _AfterLightningLoads())

__all__ = [
    "DataParallel",
    "LocalSGD",
    "Options",
    "PaddleDPStrategy",
    "PaddleEnvironment",
    "ParallelEnv",
    "Reducer",
    "ReplicaBatches",
    "ShardedOptimizer",
    "assign_group_by_size",
    "destroy_parallel_env",
    "fused_allreduce_gradients",
    "get_rings",
    "init_parallel_env",
    "sync_params_buffers",
]
