"""The strategies' process group: the cluster environment, the ranks, the backend and timeout, the group.

Both front doors bring their ranks up the same way, as Lightning's ``"ddp"`` does: the ranks from
the cluster environment (Paddle's launcher's, else the one Lightning detects), then the process
group, with ``init_parallel_env``, of one rank too for a single process.

The process group outlives the strategy, as under Lightning's ``"ddp"``: teardown leaves it
alive, so ``torch.distributed`` calls and ``strategy.barrier()`` work after ``fit``, and a
later ``fit`` or ``test`` in the same process adopts it instead of meeting the other ranks
again. Under NCCL it is destroyed when the process exits, as Lightning does.
"""

from __future__ import annotations

import atexit
import logging
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

from lit_dp.job import in_flight
from lit_dp.job.env import ParallelEnv
from lit_dp.job.launcher import PADDLE, describe_job, detect_launcher
from lit_dp.job.process_group import destroy_parallel_env, init_parallel_env, resolve_timeout
from lit_dp.options import Options
from lit_dp.options.backends import AUTO

log = logging.getLogger(__name__)


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


def process_group_timeout(options: Options) -> timedelta:
    """The process group's timeout in effect: the ``timeout`` option, else ``PADDLE_PG_TIMEOUT``, else
    30 minutes, as under ``"ddp"``."""
    paddle = {name: os.environ[name] for name in ("PADDLE_PG_TIMEOUT",) if name in os.environ}
    return resolve_timeout(options.timeout, ParallelEnv(paddle))


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


def set_world_ranks(strategy: Any) -> None:
    """``strategy``'s rank and world size in its cluster environment, and for Lightning's ``rank_zero_only``."""
    if strategy.cluster_environment is not None:
        strategy.cluster_environment.set_global_rank(strategy.node_rank * strategy.num_processes + strategy.local_rank)
        strategy.cluster_environment.set_world_size(strategy.num_nodes * strategy.num_processes)
    rank_zero_only.rank = utils_rank_zero_only.rank = strategy.global_rank


def start_process_group(strategy: Any) -> None:
    """``strategy``'s ranks, then the process group: one rank's own for a single process, as under ``"ddp"``;
    a group that exists already (an earlier ``fit`` in this process, the user's) is adopted."""
    name = type(strategy).__name__
    options = strategy.options
    log.debug("%s: setting up distributed...", name)
    set_world_ranks(strategy)
    environment = lightning_parallel_env(
        strategy.cluster_environment, strategy.global_rank, strategy.world_size, strategy.root_device, options.nrings
    )
    adopting = dist.is_initialized()
    if adopting and dist.get_world_size() != strategy.world_size:
        raise RuntimeError(
            f"{name}: a process group of world size {dist.get_world_size()} already exists in this process, but "
            f"this run has world size {strategy.world_size}. The group of an earlier run outlives it (as under "
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
        auto = f" (backend=auto, device {strategy.root_device})" if options.backend == AUTO else ""
        log.debug(
            "%s: creating the process group: rank %d of %d from %s, backend %s%s, timeout %s, %d ring(s)",
            name,
            strategy.global_rank,
            strategy.world_size,
            type(strategy.cluster_environment).__name__,
            strategy.process_group_backend,
            auto,
            process_group_timeout(options),
            environment.nrings,
        )
    init_parallel_env(strategy.process_group_backend, options.timeout, parallel_env=environment, one_process_group=True)
    if not adopting:
        # At exit, as Lightning does under NCCL (torch warns of an NCCL group never destroyed).
        atexit.register(_end_process_group_at_exit)


def _end_process_group_at_exit() -> None:
    # Gloo's workers first let go of the features' last exchanges (`lit_dp.job.in_flight`): once
    # the interpreter has begun to end, a worker that frees one aborts the process.
    in_flight.wait_before_exit()
    destroy_parallel_env()


def leave_process_group(strategy: Any) -> None:
    """Teardown's part: nothing, as under ``"ddp"`` (the group serves ``dist.*`` calls after ``fit``)."""
    if dist.is_initialized():
        log.debug(
            "%s: leaving the process group alive, as \"ddp\" does (torch.distributed.destroy_process_group() ends it)",
            type(strategy).__name__,
        )
