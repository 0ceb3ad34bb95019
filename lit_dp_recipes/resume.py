"""A recipe job that resumes itself after its launcher restarts it.

- Its run folder survives a restart: ``conf/hydra/default.yaml`` names it with the
  ``lit_dp.job_folder`` resolver, the job's id under torchrun, SLURM or Paddle's launcher
  (``lit_dp.job.restart.JobAttempt``), else the time as before. ``hydra.run.dir=...`` wins.
- ``ckpt_path=auto`` (the default) resumes from the newest complete checkpoint in that folder
  when there is one: a restarted job finds what its previous attempt wrote. A path wins;
  ``null`` starts from scratch.
- When the launcher's last restart fails too, the error says so and names the checkpoint the
  job would have resumed from, in the worker's traceback and in torchrun's closing summary.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.strategies import Strategy
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from lit_dp.job.restart import JobAttempt
from lit_dp.strategies.checkpoint_io import AtomicCheckpointIO

AUTO = "auto"
JOB_FOLDER_RESOLVER = "lit_dp.job_folder"
# What a checkpoint needs for training to go on where it stopped (Lightning's own keys); a
# `save_weights_only` checkpoint has only the first.
RESUMABLE_KEYS = ("state_dict", "optimizer_states", "loops", "global_step", "epoch")


def register_resolvers() -> None:
    """``${lit_dp.job_folder:FALLBACK}``: the job's id under a launcher, else ``FALLBACK``."""
    OmegaConf.register_new_resolver(JOB_FOLDER_RESOLVER, job_folder, replace=True)


def job_folder(fallback: str) -> str:
    """``torchrun-<run id>``, ``slurm-<job id>``, ``paddle-<job id>``, or ``fallback`` (a time stamp)."""
    return JobAttempt.from_environ().job_id or fallback


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint a fit can resume from: its path and the global step it was taken at."""

    path: Path
    step: int
    modified: float


def read_checkpoint(path: Path) -> Checkpoint | None:
    """``path`` as a ``Checkpoint``, or None when it does not load (half-written) or cannot resume a fit.

    The tensors are memory-mapped, not read: only the pickled structure is loaded.
    """
    try:
        # The job's own files (a Lightning checkpoint holds hyperparameter objects, so not weights_only).
        content = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except Exception:  # noqa: BLE001 - any failure to load means "not a checkpoint to resume from"
        return None
    if not isinstance(content, dict) or not all(key in content for key in RESUMABLE_KEYS):
        return None
    return Checkpoint(path, int(content["global_step"]), path.stat().st_mtime)


def newest_checkpoint(folders: list[Path]) -> Checkpoint | None:
    """The complete checkpoint of the highest step in ``folders`` (``*.ckpt``), the newest on a tie."""
    paths = {path.resolve() for folder in folders if folder.is_dir() for path in folder.glob("*.ckpt")}
    found = [checkpoint for path in paths if path.is_file() and (checkpoint := read_checkpoint(path))]
    return max(found, key=lambda c: (c.step, c.modified), default=None)


def checkpoint_folders(cfg: DictConfig) -> list[Path]:
    """Where the job's checkpoints are: the run folder (Lightning's SLURM ``hpc_ckpt_*.ckpt``)
    and every configured callback's ``dirpath`` (``ModelCheckpoint``)."""
    folders = [Path(cfg.paths.output_dir)]
    for node in (cfg.get("callbacks") or {}).values():
        if node is not None and node.get("dirpath"):
            folders.append(Path(node.dirpath))
    return list(dict.fromkeys(folders))


def use_atomic_checkpoints(strategy: Any) -> Any:
    """``strategy``, writing its checkpoints atomically if it would use Lightning's default writer
    (``paddle_dp`` already does; ``"ddp"`` too, in the recipes, so that both resume alike)."""
    if isinstance(strategy, Strategy) and type(strategy.checkpoint_io) is TorchCheckpointIO:
        strategy.checkpoint_io = AtomicCheckpointIO()
    return strategy


def check_checkpoint_every_n_steps(value: Any) -> int | None:
    """A positive number of optimizer steps, or None (checkpoints once an epoch)."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(
            f"checkpoint_every_n_steps={value!r} is invalid: expected a positive number of optimizer steps, "
            "or null for one checkpoint an epoch."
        )
    return value


def resolve_ckpt_path(ckpt_path: str | None, folders: list[Path], attempt: JobAttempt) -> str | None:
    """What ``trainer.fit(ckpt_path=...)`` gets: ``auto`` becomes the newest complete checkpoint
    in ``folders`` (or None: from scratch); any other value is the user's and passes through."""
    if ckpt_path != AUTO:
        return ckpt_path
    newest = newest_checkpoint(folders)
    if newest is None:
        if attempt.is_restart:
            _say(f"[lit_dp] {attempt.describe()}, but no complete checkpoint in {folders[0]}: starting from scratch")
        return None
    why = attempt.describe() if attempt.is_restart else "a checkpoint of this job is already in its folder"
    _say(f"[lit_dp] resuming from {newest.path} (step {newest.step}, {why})")
    return str(newest.path)


class LauncherTerminated(RuntimeError):
    """The launcher stopped this worker (SIGTERM): another worker of the attempt failed."""


@contextmanager
def last_attempt_report(folders: list[Path], attempt: JobAttempt) -> Iterator[None]:
    """On the launcher's last attempt, a failure names the restart count and the checkpoint to resume from.

    When a rank dies, torchrun stops the others with SIGTERM, often before their own collective
    fails; without a handler they die silently and torchrun's summary shows only signals. So on
    the last attempt SIGTERM raises ``LauncherTerminated`` (Lightning's own SIGTERM handler
    calls ours too), and the report goes to the worker's traceback and to its torchrun error
    file, which the agent prints in its closing summary: the last thing the user sees.
    """
    if not attempt.is_last or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    except Exception as error:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the launcher's SIGTERM must not cut the report short
        newest = newest_checkpoint(folders)
        where = (
            f"{newest.path} (step {newest.step}); resume by hand with ckpt_path={newest.path}, or run again with "
            "the same hydra.run.dir"
            if newest
            else f"nowhere: no complete checkpoint in {folders[0]}"
        )
        report = RuntimeError(
            f"[lit_dp] {attempt.describe()} failed, and the launcher allows no more restarts: "
            f"{type(error).__name__}: {error}\nThe job would have resumed from {where}."
        )
        try:
            raise report from error
        except RuntimeError:
            _record_for_torchrun(report)  # its traceback ends with the report
            raise
    finally:
        signal.signal(signal.SIGTERM, previous)


def _raise_terminated(signum: int, frame: Any) -> None:
    raise LauncherTerminated(f"stopped by the launcher (signal {signum}): another rank of this attempt failed")


def _record_for_torchrun(error: BaseException) -> None:
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        ErrorHandler().record_exception(error)


def _say(message: str) -> None:
    # Before the Trainer exists: Lightning's rank from the launcher's variables (RANK, LOCAL_RANK, SLURM_PROCID).
    if rank_zero_only.rank == 0:
        print(message, flush=True)
