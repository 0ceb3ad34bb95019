"""lit_dp: Paddle-style data parallelism for PyTorch and Lightning.

``import lit_dp`` registers ``"paddle_dp"`` and the rest of its families (``_spawn``, ``_fork``,
``_notebook``, each with ``_find_unused_parameters_true|false``) in the Trainer's strategy
registry (``lit_dp.PaddleDPStrategy``) and in Fabric's (``lit_dp.fabric.PaddleDPStrategy``).
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lit_dp import fabric
from lit_dp.broadcast import sync_params_buffers
from lit_dp.buckets import assign_group_by_size
from lit_dp.cluster_environment import PaddleEnvironment
from lit_dp.data_parallel import DataParallel, fused_allreduce_gradients
from lit_dp.env import ParallelEnv
from lit_dp.local_sgd import LocalSGD
from lit_dp.process_group import destroy_parallel_env, get_rings, init_parallel_env
from lit_dp.reducer import Reducer
from lit_dp.strategy import PaddleDPStrategy

PaddleDPStrategy.register_strategies(StrategyRegistry)
fabric.PaddleDPStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)

__all__ = [
    "DataParallel",
    "LocalSGD",
    "PaddleDPStrategy",
    "PaddleEnvironment",
    "ParallelEnv",
    "Reducer",
    "assign_group_by_size",
    "destroy_parallel_env",
    "fused_allreduce_gradients",
    "get_rings",
    "init_parallel_env",
    "sync_params_buffers",
]
