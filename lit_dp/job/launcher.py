"""Which launcher started this process, and the job it describes: one rule for every front door.

``init_parallel_env`` (a plain PyTorch script) and the Lightning strategies (the Trainer's and
Fabric's ``paddle_dp``) must agree on who started a process, or one job trains as one world
through one door and as lone ranks through the other. The rule, first match wins:

1. **Paddle's launcher**: ``PADDLE_TRAINER_ID`` and ``PADDLE_TRAINERS_NUM`` both set
   (``PaddleEnvironment.detect``), read by ``ParallelEnv`` with Paddle's meanings. If torch's
   ``RANK`` or ``WORLD_SIZE`` are set too and disagree with them, both doors refuse: the process
   cannot tell which job it belongs to.
2. **torchrun** (torchelastic): ``TORCHELASTIC_RUN_ID`` is set
   (``torch.distributed.is_torchelastic_launched``, what Lightning's ``TorchElasticEnvironment``
   asks). Above SLURM, as in Lightning: torchrun runs inside SLURM jobs, never the reverse.
3. **SLURM**, then **LSF**, then **MPI**: Lightning's own environments in Lightning's order
   (``_AcceleratorConnector._choose_and_init_cluster_environment``), with their ``detect()`` and
   their readings: SLURM's address from ``SLURM_NODELIST`` and port from ``SLURM_JOB_ID`` unless
   ``MASTER_ADDR``/``MASTER_PORT`` are set. MPI needs mpi4py, as in Lightning; an MPI launcher's
   variables without mpi4py are refused rather than read as a world of one.
4. **torch's env:// variables**: ``WORLD_SIZE`` or ``RANK`` set by no launcher above (a launch by
   hand, Kubeflow's PyTorchJob), read as ``torch.distributed.init_process_group()`` reads them.
   The Trainer uses Lightning's own launcher here (``LightningEnvironment``).
5. **No launcher**: Paddle's variables as far as they are set; world size 1 by default.

Lightning is imported only to look for the launchers of rule 3 (``import lit_dp`` stays
Lightning-free, and jobs started by Paddle's launcher or torchrun never pay for it).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from lit_dp.job.env import ParallelEnv, _fail, _read, parse_port, started_by_paddle

PADDLE = "Paddle's launcher"
TORCHRUN = "torchrun"
SLURM = "SLURM"
LSF = "LSF"
MPI = "MPI"
TORCH_ENV = "torch's env:// rendezvous"
GIVEN = "the parallel_env argument"

# Lightning's environment class for each launcher it detects, in Lightning's order, with the
# variables behind its global rank, world size and local rank (for messages; MPI's come from mpi4py).
_LIGHTNING_ENVIRONMENTS = {
    SLURM: ("SLURMEnvironment", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
    LSF: ("LSFEnvironment", "JSM_NAMESPACE_RANK", "JSM_NAMESPACE_SIZE", "JSM_NAMESPACE_LOCAL_RANK"),
    MPI: ("MPIEnvironment", "MPI.COMM_WORLD rank", "MPI.COMM_WORLD size", "node-local rank"),
}
# The world size an MPI launcher exports (Open MPI, MPICH and Intel MPI's Hydra, MVAPICH2).
_MPI_WORLD_SIZE_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")
# Paddle's own settings, honoured whichever launcher describes the job.
_PADDLE_SETTINGS = ("FLAGS_nccl_nrings", "PADDLE_PG_TIMEOUT", "PADDLE_DISTRI_BACKEND")


@dataclass(frozen=True)
class Launch:
    """The job this process belongs to as its launcher describes it, and where each value came from.

    Attributes:
        launcher: who started the process (``TORCHRUN``, ``SLURM``, ...); None without a launcher.
        parallel_env: the job in ``init_parallel_env``'s terms.
        rank_source, world_size_source: the settings behind the rank and the world size
            (``"RANK=3"``); None where a default was taken.
        device_source: what selects this process's CUDA device under NCCL (``"LOCAL_RANK=1"``).
    """

    launcher: str | None
    parallel_env: ParallelEnv
    rank_source: str | None
    world_size_source: str | None
    device_source: str

    @classmethod
    def given(cls, parallel_env: ParallelEnv) -> Launch:
        """The job a caller passed (the strategies pass Lightning's view of it)."""
        return cls(
            GIVEN,
            parallel_env,
            f"rank={parallel_env.rank}",
            f"world_size={parallel_env.world_size}",
            f"device_id={parallel_env.device_id}",
        )

    @property
    def expects_process_group(self) -> bool:
        """Whether a world of one still gets a process group: under launchers written for
        torch.distributed (all but Paddle's), whose scripts call ``torch.distributed`` as after
        ``init_process_group``. Paddle's variables, or none, keep Paddle's meaning: no group."""
        return self.launcher not in (None, PADDLE, GIVEN)

    @property
    def who(self) -> str:
        """The launcher's name for messages (``"no launcher"`` without one)."""
        return self.launcher or "no launcher"


def detect_launcher() -> str | None:
    """The launcher that started this process, by the module's rule; None without one.

    Raises:
        ValueError: Paddle's and torch's variables describe different jobs, or an MPI launcher
            started the process and mpi4py, which reads it, is missing.
    """
    if started_by_paddle():
        _check_torch_variables_agree_with_paddle()
        return PADDLE
    if dist.is_torchelastic_launched():
        return TORCHRUN
    environments = _lightning_environments()
    for launcher, (class_name, *_) in _LIGHTNING_ENVIRONMENTS.items():
        if getattr(environments, class_name).detect():
            return launcher
    _refuse_mpi_without_mpi4py()
    if _setting_value("WORLD_SIZE") is not None or _setting_value("RANK") is not None:
        return TORCH_ENV
    return None


def detect_launch() -> Launch:
    """The job this process belongs to, read from the launcher ``detect_launcher`` finds.

    Raises:
        ValueError: a launcher's variable is missing or malformed, naming it and its value.
    """
    launcher = detect_launcher()
    if launcher in (TORCHRUN, TORCH_ENV):
        return _torch_launch(launcher)
    if launcher in _LIGHTNING_ENVIRONMENTS:
        return _lightning_launch(launcher)
    env = ParallelEnv()
    device_variable = f"FLAGS_selected_{env.device_type}s" if env.device_type else "FLAGS_selected_gpus"
    return Launch(
        launcher,
        env,
        _setting("PADDLE_TRAINER_ID"),
        _setting("PADDLE_TRAINERS_NUM"),
        _setting(device_variable) or f"{device_variable} unset (device 0)",
    )


def describe_job(
    rank: int,
    world_size: int,
    master_addr: str | None,
    master_port: int | None,
    device_id: int,
    *,
    local_rank: int | None = None,
    local_world_size: int | None = None,
    node_rank: int | None = None,
    nrings: int | None = None,
) -> ParallelEnv:
    """The job another launcher (or Lightning) describes, as a ``ParallelEnv``.

    Paddle's own settings (``FLAGS_nccl_nrings`` unless ``nrings`` is given, ``PADDLE_PG_TIMEOUT``,
    ``PADDLE_DISTRI_BACKEND``) still apply from the environment.
    """
    environ = {name: os.environ[name] for name in _PADDLE_SETTINGS if name in os.environ}
    environ |= {
        "PADDLE_TRAINER_ID": str(rank),
        "PADDLE_TRAINERS_NUM": str(world_size),
        "FLAGS_selected_gpus": str(device_id),
    }
    if master_addr is not None and master_port is not None:
        environ |= {"MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)}
    if local_rank is not None:
        environ["PADDLE_RANK_IN_NODE"] = str(local_rank)
    if local_world_size is not None:
        environ["PADDLE_LOCAL_SIZE"] = str(local_world_size)
    if nrings:
        environ["FLAGS_nccl_nrings"] = str(nrings)
    return ParallelEnv(environ, node_rank=node_rank)


def _torch_launch(launcher: str) -> Launch:
    """torchrun's variables, or torch's env:// ones: what ``init_process_group()`` reads, plus the node layout."""
    evidence = _setting("TORCHELASTIC_RUN_ID") if launcher == TORCHRUN else _setting("WORLD_SIZE") or _setting("RANK")
    world_size = _integer(launcher, evidence, "WORLD_SIZE", minimum=1)
    rank = _integer(launcher, evidence, "RANK", minimum=0)
    _check_below("RANK", rank, "WORLD_SIZE", world_size)
    # torchrun always sets the node layout; a launch by hand may not (one process per node, as Kubeflow's).
    layout_default = None if launcher == TORCHRUN else 0
    local_rank = _integer(launcher, evidence, "LOCAL_RANK", minimum=0, default=layout_default)
    local_world_size = _integer(launcher, evidence, "LOCAL_WORLD_SIZE", minimum=1, default=world_size)
    _check_below("LOCAL_RANK", local_rank, "LOCAL_WORLD_SIZE", local_world_size)
    node_rank = _integer(launcher, evidence, "GROUP_RANK", minimum=0, default=0)
    address, port = _setting_value("MASTER_ADDR"), _setting_value("MASTER_PORT")
    if world_size > 1 and (address is None or port is None):
        missing = " and ".join(name for name, value in (("MASTER_ADDR", address), ("MASTER_PORT", port)) if value is None)
        raise ValueError(
            f"{launcher} ({evidence}) describes world size {world_size}, but {missing} is not set: "
            "torch's env:// rendezvous needs MASTER_ADDR and MASTER_PORT."
        )
    env = describe_job(
        rank,
        world_size,
        address,
        None if port is None else parse_port("MASTER_PORT", port),
        device_id=local_rank,
        local_rank=local_rank,
        local_world_size=local_world_size,
        node_rank=node_rank,
    )
    return Launch(launcher, env, f"RANK={rank}", f"WORLD_SIZE={world_size}", f"LOCAL_RANK={local_rank}")


def _lightning_launch(launcher: str) -> Launch:
    """The job as Lightning's environment for ``launcher`` reads it (the Trainer reads the same)."""
    class_name, rank_variable, world_size_variable, local_rank_variable = _LIGHTNING_ENVIRONMENTS[launcher]
    environment = getattr(_lightning_environments(), class_name)()
    try:
        rank, world_size = environment.global_rank(), environment.world_size()
        local_rank, node_rank = environment.local_rank(), environment.node_rank()
        address, port = environment.main_address, environment.main_port
    except (KeyError, ValueError) as error:
        raise ValueError(
            f"{launcher} started this process, but Lightning's {class_name} could not read the job from its "
            f"variables ({rank_variable}, {world_size_variable}, ...): {type(error).__name__}: {error}"
        ) from error
    _check_below(rank_variable, rank, world_size_variable, world_size)
    env = describe_job(rank, world_size, address, port, device_id=local_rank, local_rank=local_rank, node_rank=node_rank)
    return Launch(
        launcher, env, f"{rank_variable}={rank}", f"{world_size_variable}={world_size}", f"{local_rank_variable}={local_rank}"
    )


def _lightning_environments() -> Any:
    # Imported on first use: `import lit_dp` must not import Lightning (docs/architecture.md).
    import lightning.fabric.plugins.environments as environments

    return environments


def _check_torch_variables_agree_with_paddle() -> None:
    """Paddle's variables win over torch's; two different jobs in one environment are refused."""
    disagreeing = []
    for paddle, torch_name in (("PADDLE_TRAINER_ID", "RANK"), ("PADDLE_TRAINERS_NUM", "WORLD_SIZE")):
        ours, theirs = _setting_value(paddle), _setting_value(torch_name)
        if theirs is not None and ours != theirs:
            disagreeing.append(f"{paddle}={ours} but {torch_name}={theirs}")
    if disagreeing:
        raise ValueError(
            f"Paddle's launcher and torch's variables describe different jobs ({'; '.join(disagreeing)}): lit_dp "
            "reads Paddle's variables when both are set, and these disagree. Unset the variables of the launcher that "
            "did not start this process (e.g. PADDLE_* exported into a torchrun job)."
        )


def _refuse_mpi_without_mpi4py() -> None:
    for variable in _MPI_WORLD_SIZE_VARIABLES:
        raw = _setting_value(variable)
        if raw is None or not raw.isdigit() or int(raw) < 2:
            continue
        if importlib.util.find_spec("mpi4py") is None:
            raise ValueError(
                f"an MPI launcher started this process ({variable}={raw}), but mpi4py is not installed: Lightning's "
                "MPIEnvironment, which lit_dp and the Trainer use to read an MPI job, needs it. Install mpi4py "
                "(pip install mpi4py), or start the job with torchrun, SLURM's srun or Paddle's launcher."
            )


def _integer(launcher: str, evidence: str | None, variable: str, minimum: int, default: int | None = None) -> int:
    raw = _setting_value(variable)
    if raw is None:
        if default is not None:
            return default
        raise ValueError(
            f"{launcher} ({evidence}) describes the job, but {variable} is not set: expected an integer >= {minimum}."
        )
    try:
        value = int(raw)
    except ValueError:
        _fail(variable, raw, f"an integer >= {minimum}")
    if value < minimum:
        _fail(variable, raw, f"an integer >= {minimum}")
    return value


def _check_below(variable: str, value: int, bound_variable: str, bound: int) -> None:
    if value >= bound:
        _fail(variable, str(value), f"a value in [0, {bound}) because {bound_variable}={bound}")


def _setting_value(variable: str) -> str | None:
    """The stripped value of ``variable`` in this process's environment, or None when unset or blank."""
    return _read(os.environ, variable)


def _setting(variable: str) -> str | None:
    """``"VARIABLE=value"`` when ``variable`` is set, for messages; None otherwise."""
    value = _setting_value(variable)
    return None if value is None else f"{variable}={value}"
