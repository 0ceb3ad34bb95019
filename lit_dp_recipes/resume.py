"""Where a recipe run writes, what it resumes from, and what it tells the user about both.

- Its run folder survives a restart: ``conf/hydra/default.yaml`` names it with the
  ``lit_dp.job_folder`` resolver (``lit_dp_recipes.run_folder``). ``hydra.run.dir=...`` wins.
- ``ckpt_path=auto`` (the default) resumes from the newest good checkpoint of that folder, a file
  (``strategy.state_dict_type=full``) or a folder (``sharded``). A checkpoint that does not load
  (truncated by a crash or a full disk, empty; a folder missing a rank's file) or cannot resume a
  fit (weights only) is skipped, and the line saying what was resumed names it and why; when
  there are checkpoints but none is good, the run stops before any work, naming each. Outside a
  launcher a rerun of the same command gets a new time-stamped folder: ``auto`` then resumes the
  newest run of the same command (same task, same overrides) that did not finish. A path wins;
  ``null`` starts from scratch.
- Rank 0 prints the run folder, the checkpoint folder and the command that resumes the run at
  the start, and after any failure or interrupt which checkpoint a rerun resumes from. On the
  launcher's last restart the failure itself says so, in the worker's traceback and in
  torchrun's closing summary.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.strategies import Strategy
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from lit_dp.checkpoint.sharded import META as SHARDED_META
from lit_dp.checkpoint.sharded import ShardedCheckpoint, is_sharded
from lit_dp.job.restart import JobAttempt
from lit_dp.strategies.checkpoint_io import AtomicCheckpointIO
from lit_dp.fault_tolerance.commit import QuorumUnreachable
from lit_dp.strategies.preemption import Preempted
from lit_dp_recipes.launch import job_arguments

AUTO = "auto"
# What a checkpoint needs for training to go on where it stopped (Lightning's own keys); a
# `save_weights_only` checkpoint has only the first.
RESUMABLE_KEYS = ("state_dict", "optimizer_states", "loops", "global_step", "epoch")
# Lightning's script launcher starts ranks 1.. inside `fit`, each running the recipe again: they
# take rank 0's choice from this variable rather than choosing again (an earlier run's folder is
# not theirs to find: their command line names rank 0's folder).
RESUME_FROM_ENV = "LIT_DP_RESUME_FROM"
FINISHED_MARKER = ".lit_dp_finished"  # in a run folder whose fit ended normally


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint a fit can resume from: its path, the global step it was taken at and the epochs it had
    completed (what the Trainer's ``current_epoch`` is once it is restored)."""

    path: Path
    step: int
    modified: float
    epoch: int = 0


@dataclass(frozen=True)
class Unusable:
    """A ``*.ckpt`` file no fit can resume from, and why."""

    path: Path
    modified: float
    reason: str

    def describe(self) -> str:
        return f"{self.path} ({self.reason})"


class NoUsableCheckpoint(RuntimeError):
    """``ckpt_path=auto`` found checkpoints, and none a fit can resume from."""


def read_checkpoint(path: Path) -> Checkpoint | Unusable:
    """``path`` as a ``Checkpoint``, or as ``Unusable`` with the reason (damaged, or no training state).

    Only the pickled structure is loaded (the tensors are memory-mapped, not read): a truncated
    file has lost the zip directory at its end and fails here; a bit flipped inside a tensor's
    bytes is not looked for. A sharded checkpoint's folder must hold ``meta.pt`` and the index of
    its tensors, and every file that index names, long enough for what it says is there.
    """
    if path.is_dir():
        return _read_folder(path)
    modified = path.stat().st_mtime
    size = path.stat().st_size
    if size == 0:
        return Unusable(path, modified, "damaged: empty")
    if not zipfile.is_zipfile(path):
        reason = f"damaged: {size} bytes without the zip directory a checkpoint ends with, truncated"
        return Unusable(path, modified, reason)
    try:
        # The job's own files (a Lightning checkpoint holds hyperparameter objects, so not weights_only).
        content = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except Exception as error:  # noqa: BLE001 - whatever fails, the file cannot be resumed from; the reason is kept
        first_sentence = str(error).split(". ")[0].strip()
        return Unusable(path, modified, f"damaged: does not load: {type(error).__name__}: {first_sentence}")
    missing = [key for key in RESUMABLE_KEYS if not isinstance(content, dict) or key not in content]
    if missing:
        return Unusable(path, modified, f"cannot resume a fit: no {', '.join(missing)} (saved with weights only?)")
    return Checkpoint(path, int(content["global_step"]), modified, _completed_epochs(content))


def _read_folder(path: Path) -> Checkpoint | Unusable:
    """A sharded checkpoint's folder (``strategy.state_dict_type=sharded``), as ``read_checkpoint`` reads a file."""
    modified = path.stat().st_mtime
    if not is_sharded(path):
        return Unusable(path, modified, f"damaged: a folder without {SHARDED_META}")
    try:
        folder = ShardedCheckpoint(path)
        content = folder.meta(weights_only=False)
    except Exception as error:  # noqa: BLE001 - as for a file
        first_sentence = str(error).split(". ")[0].strip()
        return Unusable(path, modified, f"damaged: does not load: {type(error).__name__}: {first_sentence}")
    if damaged := folder.missing_files():
        return Unusable(path, modified, f"damaged: {damaged}")
    names = folder.names()
    present = {
        "state_dict": "model" in names,
        "optimizer_states": any(name.startswith("optimizer_") for name in names),
        **{key: key in content for key in RESUMABLE_KEYS if key not in ("state_dict", "optimizer_states")},
    }
    missing = [key for key in RESUMABLE_KEYS if not present[key]]
    if missing:
        return Unusable(path, modified, f"cannot resume a fit: no {', '.join(missing)} (saved with weights only?)")
    return Checkpoint(path, int(content["global_step"]), modified, _completed_epochs(content))


def _completed_epochs(content: dict[str, Any]) -> int:
    """The epochs the checkpoint's fit had completed: what Lightning restores as ``trainer.current_epoch``."""
    try:
        return int(content["loops"]["fit_loop"]["epoch_progress"]["current"]["completed"])
    except (KeyError, TypeError):
        return int(content.get("epoch", 0))


def survey(folders: list[Path]) -> tuple[list[Checkpoint], list[Unusable]]:
    """Every ``*.ckpt`` file or folder of ``folders`` (each once, links resolved), usable or not."""
    paths = {path.resolve() for folder in folders if folder.is_dir() for path in folder.glob("*.ckpt")}
    found = [read_checkpoint(path) for path in sorted(paths) if path.is_file() or path.is_dir()]
    return [c for c in found if isinstance(c, Checkpoint)], [u for u in found if isinstance(u, Unusable)]


def newest_checkpoint(folders: list[Path]) -> Checkpoint | None:
    """The good checkpoint of the highest step in ``folders``, the newest on a tie."""
    good, _ = survey(folders)
    return max(good, key=lambda c: (c.step, c.modified), default=None)


def choose_checkpoint(folders: list[Path]) -> tuple[Checkpoint | None, list[Unusable]]:
    """The checkpoint ``ckpt_path=auto`` resumes from, and the unusable files newer than it.

    None when ``folders`` hold no ``*.ckpt`` file; ``NoUsableCheckpoint`` naming each file when
    they hold some and none is good (starting over would overwrite them).
    """
    good, bad = survey(folders)
    if not good and bad:
        listing = "; ".join(u.describe() for u in sorted(bad, key=lambda u: -u.modified))
        raise NoUsableCheckpoint(
            f"ckpt_path=auto: no checkpoint in {', '.join(map(str, folders))} can resume this run: {listing}. "
            "Starting over would overwrite them, so nothing was started: pass ckpt_path=<a good checkpoint> to "
            "resume from one kept elsewhere, or ckpt_path=null to start from scratch."
        )
    chosen = max(good, key=lambda c: (c.step, c.modified), default=None)
    skipped = [u for u in bad if chosen is not None and u.modified >= chosen.modified]
    return chosen, skipped


def check_epochs_left(ckpt_path: str | None, max_epochs: int | None) -> None:
    """A checkpoint past ``trainer.max_epochs`` (a finished run's folder rerun with fewer epochs) is refused in one
    line, naming its epoch and step and what to do, before Lightning's traceback would."""
    if ckpt_path is None or max_epochs is None or max_epochs < 0:
        return
    chosen = read_checkpoint(Path(ckpt_path))
    if isinstance(chosen, Checkpoint) and chosen.epoch > max_epochs:
        raise ValueError(
            f"trainer.max_epochs={max_epochs} is below the checkpoint this run resumes, {chosen.path}, which completed "
            f"{chosen.epoch} epochs (step {chosen.step}): raise trainer.max_epochs above {chosen.epoch} to train on from "
            "there, or pass ckpt_path=null to start over in this folder (hydra.run.dir=<another folder> keeps it)."
        )


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


@dataclass(frozen=True)
class EarlierRun:
    """A run of the same command, outside a launcher, in a folder of its own: what a rerun resumes."""

    folder: Path
    folders: list[Path]


def earlier_run(run_dir: Path, overrides: list[str], folders: list[Path]) -> EarlierRun | None:
    """The newest run folder beside ``run_dir`` of the same command (Hydra's recorded ``overrides``,
    ``ckpt_path`` aside) that has checkpoints, did not finish, and began after the last such run
    that finished; ``folders`` are ``run_dir``'s checkpoint folders, mapped into each candidate."""
    wanted = _task_overrides(overrides)
    runs = []
    for folder in run_dir.parent.iterdir():
        recorded = folder / ".hydra" / "overrides.yaml"
        if folder != run_dir and recorded.is_file() and _task_overrides(_recorded_overrides(recorded)) == wanted:
            runs.append((recorded.stat().st_mtime, folder))
    found = None
    for _, folder in sorted(runs):
        if (folder / FINISHED_MARKER).exists():
            found = None  # what ran before a finished run is not what a rerun continues
            continue
        mapped = [folder / f.relative_to(run_dir) if f.is_relative_to(run_dir) else f for f in folders]
        if any(f.is_dir() and any(f.glob("*.ckpt")) for f in mapped):
            found = EarlierRun(folder, mapped)
    return found


class ResumableRun:
    """One recipe run's folders and resumption, for ``lit_dp_recipes.train.train``.

    ``announce`` (rank 0: where things are), ``resolve`` (what ``fit`` gets as ``ckpt_path``),
    ``fitting`` (around ``fit``: hands the choice to the ranks Lightning starts, reports where a
    rerun resumes after a failure, marks the run finished).
    """

    def __init__(self, cfg: DictConfig, attempt: JobAttempt | None = None) -> None:
        self.run_dir = Path(cfg.paths.output_dir).resolve()
        self.folders = [folder.resolve() for folder in checkpoint_folders(cfg)]
        self.attempt = attempt if attempt is not None else JobAttempt.from_environ()
        self.every_n_steps = cfg.get("checkpoint_every_n_steps")
        self._hydra = HydraConfig.get() if HydraConfig.initialized() else None
        self._from_earlier_run: Checkpoint | None = None  # resumed from another folder's checkpoint
        # Under fault tolerance a restarted replica group takes its state from a peer, checkpoint or not.
        self._recovers_live = bool((cfg.get("strategy") or {}).get("fault_tolerance"))

    @property
    def command(self) -> str | None:
        """The command line that continues this run in this folder (None outside a Hydra run)."""
        if self._hydra is None:
            return None
        # A sweep's job is continued alone, in its own folder: its overrides, not the sweep's command line.
        arguments = job_arguments(sys.argv[1:]) if self._hydra.mode == RunMode.MULTIRUN else sys.argv[1:]
        arguments = [a for a in arguments if not a.startswith(("hydra.run.dir=", "ckpt_path="))]
        return shlex.join(["python", sys.argv[0], *arguments, f"hydra.run.dir={self.run_dir}"])

    def announce(self) -> None:
        """Rank 0: the run folder, the checkpoint folder and how to resume."""
        every = f"every {self.every_n_steps} optimizer steps" if self.every_n_steps else "once an epoch"
        _say(f"[lit_dp] run folder: {self.run_dir}")
        _say(f"[lit_dp] checkpoints: {self.folders[-1]} ({every}; ckpt_path=auto resumes from the newest good one)")
        if self.command is not None:
            launcher = " under the same launcher" if self.attempt.job_id else ""
            _say(f"[lit_dp] to resume this run{launcher}: {self.command}")

    def resolve(self, ckpt_path: str | None) -> str | None:
        """What ``trainer.fit(ckpt_path=...)`` gets: ``auto`` becomes the checkpoint to resume from
        (or None: from scratch); any other value is the user's and passes through."""
        if ckpt_path != AUTO:
            return ckpt_path
        if RESUME_FROM_ENV in os.environ:  # a rank Lightning started: rank 0 chose
            return os.environ[RESUME_FROM_ENV] or None
        chosen, skipped = choose_checkpoint(self.folders)
        if chosen is None and not skipped and (earlier := self._earlier_run()) is not None:
            chosen, skipped = choose_checkpoint(earlier.folders)
            self._from_earlier_run = chosen
            why = f"the newest run of this command, {earlier.folder}, did not finish"
        elif self.attempt.is_restart:
            why = self.attempt.describe()
        else:
            why = "a checkpoint of this run is already in its folder"
        if chosen is None:
            if self.attempt.is_restart and self._recovers_live:
                _say(f"[lit_dp] {self.attempt.describe()}: this replica group takes a peer's state at its first quorum")
            elif self.attempt.is_restart:
                _say(f"[lit_dp] {self.attempt.describe()}, but no checkpoint in {self.folders[-1]}: starting from scratch")
            return None
        line = f"[lit_dp] resuming from {chosen.path} (step {chosen.step}, {why})"
        if skipped:
            line += "; skipped, newer but unusable: " + "; ".join(u.describe() for u in skipped)
        _say(line)
        return str(chosen.path)

    def _earlier_run(self) -> EarlierRun | None:
        """Outside a launcher, in Hydra's time-stamped folder: the run this one continues, if any."""
        hydra = self._hydra
        if hydra is None or self.attempt.job_id or hydra.mode != RunMode.RUN:
            return None
        if any(o.startswith("hydra.run.dir=") for o in hydra.overrides.hydra):
            return None  # a folder of the user's choice: a rerun there finds its checkpoints itself
        return earlier_run(self.run_dir, list(hydra.overrides.task), self.folders)

    @contextmanager
    def fitting(self, ckpt_path: str | None) -> Iterator[None]:
        """Around ``trainer.fit``: the ranks Lightning starts resume from ``ckpt_path`` too; a failure
        or interrupt says which checkpoint a rerun resumes from (and, on the launcher's last
        restart, that no restart follows); a fit that ends normally marks the run finished."""
        handed = RESUME_FROM_ENV not in os.environ
        if handed:
            os.environ[RESUME_FROM_ENV] = ckpt_path or ""
        try:
            with _last_attempt_report(self):
                yield
        except BaseException as stop:
            if not isinstance(stop, _LastAttemptFailed):  # that one says it already
                _say(f"[lit_dp] the run stopped: {_describe(stop)}")
                for note in getattr(stop, "__notes__", ()):  # e.g. which rank died (lit_dp.strategies.lost_ranks)
                    _say(f"[lit_dp] {note.removeprefix('lit_dp: ')}")
                logs = sorted(self.run_dir.glob("*.log"))
                if logs and isinstance(stop, Exception):
                    _say(f"[lit_dp] the ranks' logs: {', '.join(map(str, logs))}")
                _say(f"[lit_dp] {self.where_a_rerun_resumes()}")
            raise
        finally:
            if handed:
                del os.environ[RESUME_FROM_ENV]
        if rank_zero_only.rank == 0:
            (self.run_dir / FINISHED_MARKER).touch()

    def where_a_rerun_resumes(self) -> str:
        """One line: the checkpoint a rerun resumes from, and the command (or: from scratch)."""
        newest = newest_checkpoint(self.folders) or self._from_earlier_run
        if newest is None:
            return f"no checkpoint in {self.folders[-1]} yet: a rerun starts from scratch"
        if self.command is None:
            return f"a rerun with ckpt_path=auto in {self.run_dir} resumes from {newest.path} (step {newest.step})"
        launcher = " under the same launcher" if self.attempt.job_id else ""
        # Still the earlier run's checkpoint: this folder's explicit rerun must be pointed at it.
        elsewhere = f" ckpt_path={shlex.quote(str(newest.path))}" if newest is self._from_earlier_run else ""
        return f"a rerun{launcher} resumes from {newest.path} (step {newest.step}): {self.command}{elsewhere}"


class LauncherTerminated(RuntimeError):
    """The launcher stopped this worker (SIGTERM): another worker of the attempt failed."""


class _LastAttemptFailed(RuntimeError):
    """The launcher's last restart failed too: the message names the checkpoint a rerun resumes from."""


@contextmanager
def _last_attempt_report(run: ResumableRun) -> Iterator[None]:
    """On the launcher's last attempt, a failure names the restart count and the checkpoint to resume from.

    When a rank dies, torchrun stops the others with SIGTERM, often before their own collective
    fails; without a handler they die silently and torchrun's summary shows only signals. So on
    the last attempt SIGTERM raises ``LauncherTerminated`` outside ``fit`` (inside it,
    ``lit_dp.strategies.preemption`` stops every rank at a step boundary instead), and the
    report goes to the worker's traceback and to its torchrun error file, which the agent prints
    in its closing summary: the last thing the user sees.
    """
    attempt = run.attempt
    if not attempt.is_last or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    except Exception as error:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the launcher's SIGTERM must not cut the report short
        report = _LastAttemptFailed(
            f"[lit_dp] {attempt.describe()} failed, and the launcher allows no more restarts: "
            f"{type(error).__name__}: {error}\n{run.where_a_rerun_resumes()}"
        )
        try:
            raise report from error
        except RuntimeError:
            _record_for_torchrun(report)  # its traceback ends with the report
            raise
    finally:
        signal.signal(signal.SIGTERM, previous)


def _recorded_overrides(path: Path) -> list[str]:
    """Hydra's ``overrides.yaml`` as typed: an interpolation there (``${paths.output_dir}``) is text."""
    return OmegaConf.to_container(OmegaConf.load(path), resolve=False)


def _task_overrides(overrides: list[str]) -> list[str]:
    return sorted(o for o in overrides if not o.startswith("ckpt_path="))


def _describe(stop: BaseException) -> str:
    if isinstance(stop, (Preempted, QuorumUnreachable)):
        return f"{stop.reason}; exit status {stop.code}"
    # Lightning turns Ctrl-C into `sys.exit(1)` once it has shut the ranks down.
    if isinstance(stop, KeyboardInterrupt) or isinstance(stop.__context__, KeyboardInterrupt):
        return "interrupted: Ctrl-C"
    if isinstance(stop, SystemExit):
        return f"exit status {stop.code}"
    lines = str(stop).strip().splitlines()
    return f"{type(stop).__name__}: {lines[0]}" if lines else type(stop).__name__


def _raise_terminated(signum: int, frame: Any) -> None:
    raise LauncherTerminated(f"stopped by the launcher (signal {signum}): another rank of this attempt failed")


def _record_for_torchrun(error: BaseException) -> None:
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        ErrorHandler().record_exception(error)


def _say(message: str) -> None:
    # Before the Trainer exists: Lightning's rank from the launcher's variables (RANK, LOCAL_RANK, SLURM_PROCID).
    if rank_zero_only.rank == 0:
        print(message, flush=True)
