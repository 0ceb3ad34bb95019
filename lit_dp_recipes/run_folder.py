"""The name of a recipe run's folder: the ``lit_dp.job_folder`` resolver of ``conf/hydra/default.yaml``.

Under torchrun, SLURM or Paddle's launcher the folder is named after the job
(``lit_dp.job.restart.JobAttempt``), so that a restarted attempt finds what the previous one
wrote; else after the time, as Hydra's default. ``hydra.run.dir=...`` wins. Kept apart from
``lit_dp_recipes.resume`` because the command line is checked with it before Lightning loads
(``lit_dp_recipes.cli``).
"""

from __future__ import annotations

from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from lit_dp.job.restart import JobAttempt

JOB_FOLDER_RESOLVER = "lit_dp.job_folder"


def register_resolvers() -> None:
    """``${lit_dp.job_folder:FALLBACK[,PARENT]}``: the job's id under a launcher, else ``FALLBACK``.

    Cached per config, as Hydra's ``now`` is: Lightning resolves ``hydra.run.dir`` again to start
    ranks 1.., and must get the folder that rank 0 claimed, not the next free one.
    """
    OmegaConf.register_new_resolver(JOB_FOLDER_RESOLVER, job_folder, replace=True, use_cache=True)


def job_folder(fallback: str, parent: str | None = None) -> str:
    """``torchrun-<run id>``, ``slurm-<job id>``, ``paddle-<job id>``, or ``fallback`` (a time stamp).

    With ``parent``, in a Hydra run, the time-stamped folder is claimed by creating it: a run that
    starts in the same second as another of the same task gets ``<time>_1`` (``_2``, ...) rather
    than sharing its folder, whose checkpoints ``ckpt_path=auto`` would resume as its own.
    """
    job_id = JobAttempt.from_environ().job_id
    if job_id:
        return job_id
    if parent is None or not HydraConfig.initialized():  # composing a config (tests, --cfg): nothing to claim
        return fallback
    name, taken = fallback, 0
    while True:
        try:
            (Path(parent) / name).mkdir(parents=True)
            return name
        except FileExistsError:
            taken += 1
            name = f"{fallback}_{taken}"
