"""Where Hydra's launcher meets Lightning's: the ranks of one Hydra job, in a run or in a sweep.

Hydra's launcher runs jobs (one for a run; one per element of a ``-m`` sweep, one after the
other in this process with the default launcher). In each job, Lightning's script launcher
(``strategy.start_method=popen``, the default) starts ranks 1..N-1 of the node by running the
script again. Lightning builds that command (``_hydra_subprocess_cmd`` in
``lightning.fabric.strategies.launchers.subprocess_script``) from ``sys.argv`` as it is, plus
``hydra.run.dir=<hydra.run.dir>``, ``hydra.job.name=train_ddp_process_<rank>`` and
``hydra.output_subdir=null``. Right for a run; wrong in a sweep, where ``sys.argv`` is the
whole sweep with its ``-m``: every rank re-ran every job of the sweep in lockstep with rank 0,
printed "Launching N jobs" again and wrote a ``multirun/`` folder of its own. And Lightning
leaves its variables (``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_PORT``, ...) in the launching
process: in the next job Lightning's environment took ``LOCAL_RANK`` for a sign that a
launcher outside had started the processes, started none, and ``trainer.devices=2,3`` waited
for ever for its third rank.

``JobScriptLauncher`` starts each rank with the command line of the job itself: the script,
the job's own overrides (Hydra's ``overrides.task``: one element of the sweep), the user's
other Hydra overrides, ``hydra.mode=RUN`` and the job's folder as ``hydra.run.dir``. When the
job ends it restores the launching process's environment and destroys its process group, so
that the next job of a sweep starts as the first one did.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Callable

import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import get_original_cwd, to_absolute_path
from lightning.pytorch.strategies import Strategy
from typing_extensions import override

from lit_dp.job.orphans import launcher_environment
from lit_dp.strategies.lightning_private import TrainerScriptLauncher, replace_launcher
from lit_dp.strategies.preemption import BoundScriptLauncher

# What Lightning's script launcher exports into the launching process (_call_children_scripts).
LAUNCHER_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE")
# Hydra's command-line flags that select the config, with their values; -m/--multirun is not one.
CONFIG_FLAGS = ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd")
# Hydra overrides that belong to the sweep or that the rank's command sets itself.
SWEEP_KEYS = ("hydra.mode", "hydra.run.", "hydra.sweep.", "hydra.sweeper", "hydra/sweeper", "hydra.launcher",
              "hydra/launcher", "hydra.job.name", "hydra.job.num", "hydra.job.id", "hydra.output_subdir")


@contextmanager
def sweep_job() -> Iterator[None]:
    """Around a job's fit: in a sweep, the job leaves the next neither a process group nor its
    environment. ``JobScriptLauncher`` restores both for a job whose ranks it started; a job on
    one device starts none, and its group of one rank and its ``RANK``, ``WORLD_SIZE``, ... made
    the next job's ``trainer.devices=2`` fail, or wait for ever for a rank (issue 47)."""
    sweeping = HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    saved = dict(os.environ)
    try:
        yield
    finally:
        if sweeping:
            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
            os.environ.clear()
            os.environ.update(saved)


def use_job_launcher(strategy: Strategy) -> None:
    """Start ``strategy``'s ranks with ``JobScriptLauncher`` where Lightning would re-run ``sys.argv`` under Hydra."""
    launcher = getattr(strategy, "launcher", None)
    if type(launcher) in (TrainerScriptLauncher, BoundScriptLauncher) and HydraConfig.initialized():
        # The launcher is used when the Trainer runs, so replacing it before `fit` is enough.
        job_launcher = JobScriptLauncher(launcher.cluster_environment, launcher.num_processes, launcher.num_nodes)
        # Lightning's own (strategy=ddp) leaves stop signals outside the fit to the default, as Lightning does.
        job_launcher.stops_outside_the_fit = isinstance(launcher, BoundScriptLauncher)
        replace_launcher(strategy, job_launcher)


class JobScriptLauncher(BoundScriptLauncher):
    """lit_dp's script launcher, with each rank's command line taken from the Hydra job, not ``sys.argv``;
    its ranks end with it (``lit_dp.job.orphans``), under any strategy."""

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        saved = {name: os.environ.get(name) for name in LAUNCHER_VARIABLES}
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        finally:
            if self.procs:  # this process started the ranks
                for name, value in saved.items():
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value
                if dist.is_available() and dist.is_initialized():
                    dist.destroy_process_group()

    @override
    def _call_children_scripts(self) -> None:
        self._check_can_spawn_children()
        self.procs = []
        os.environ["MASTER_ADDR"] = self.cluster_environment.main_address
        os.environ["MASTER_PORT"] = str(self.cluster_environment.main_port)
        os.environ["NODE_RANK"] = str(self.cluster_environment.node_rank())
        os.environ["LOCAL_RANK"] = str(self.cluster_environment.local_rank())
        os.environ["WORLD_SIZE"] = f"{self.num_processes * self.num_nodes}"
        for local_rank in range(1, self.num_processes):
            env = launcher_environment({**os.environ, "LOCAL_RANK": str(local_rank)})
            if os.environ.get("PL_GLOBAL_SEED") is None:
                env.pop("PL_GLOBAL_SEED", None)
            self.procs.append(subprocess.Popen(rank_command(local_rank), env=env, cwd=get_original_cwd()))


def rank_command(local_rank: int, argv: Sequence[str] | None = None) -> list[str]:
    """The command line of rank ``local_rank`` of the current Hydra job (see the module docstring)."""
    argv = list(sys.argv if argv is None else argv)
    hydra_cfg = HydraConfig.get()
    import __main__  # the script, or the module of `python -m`; imported here as Lightning does (lightning#15218)

    spec = getattr(__main__, "__spec__", None)
    command = [sys.executable, to_absolute_path(argv[0])] if spec is None else [sys.executable, "-m", spec.name]
    return command + job_arguments(argv[1:]) + [
        "hydra.mode=RUN",
        f'hydra.run.dir="{hydra_cfg.runtime.output_dir}"',
        f"hydra.job.name=train_ddp_process_{local_rank}",
        "hydra.output_subdir=null",  # rank 0 alone writes the job's .hydra/ folder
    ]


def job_arguments(arguments: Sequence[str]) -> list[str]:
    """The command-line arguments that run the current Hydra job alone: the config flags of
    ``arguments``, the job's own overrides (one element of a sweep), and the user's Hydra
    overrides but those of the sweep."""
    overrides = HydraConfig.get().overrides
    return [
        *config_flags(arguments),
        *overrides.task,
        *(o for o in overrides.hydra if not _override_key(o).startswith(SWEEP_KEYS)),
    ]


def config_flags(arguments: Sequence[str]) -> list[str]:
    """The flags of ``arguments`` that choose the config (``-cn NAME``, ``--config-dir=DIR``, ...), with their values."""
    kept, arguments = [], list(arguments)
    for index, argument in enumerate(arguments):
        flag = argument.split("=", 1)[0]
        if flag in CONFIG_FLAGS:
            kept.append(argument)
            if "=" not in argument and index + 1 < len(arguments):
                kept.append(arguments[index + 1])
    return kept


def _override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")
