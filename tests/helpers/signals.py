"""Real signals to real recipe runs: a run started as a user starts it, whose ranks say their pids.

``RecipeRun`` starts ``python recipes/<name>.py ...`` from a fresh working directory, in a
session of its own; ``AnnouncePids`` (added to the run as a callback) makes each rank write its
pid once training has reached a step, and then slows each step down, so that a signal the test
sends arrives while training is still going on. Every wait has a deadline whose failure names
the ranks that were missing or still alive, with the end of the run's output; at the end every
process the run started is killed, by pid.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as pl

from tests.helpers.recipes import QUIET, ROOT

ANNOUNCE = f"+callbacks.announce._target_={__name__}.AnnouncePids"


class AnnouncePids(pl.Callback):
    """From optimizer step ``step`` on: write ``<folder>/rank<R>.pid`` once, then sleep ``pause``
    seconds after every batch."""

    def __init__(self, folder: str, step: int = 3, pause: float = 0.05) -> None:
        self.folder = Path(folder)
        self.step = step
        self.pause = pause
        self._written = False

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        if trainer.global_step < self.step:
            return
        if not self._written:
            partial = self.folder / f".rank{trainer.global_rank}.pid"
            partial.write_text(str(os.getpid()))
            partial.rename(self.folder / f"rank{trainer.global_rank}.pid")  # whole, or absent
            self._written = True
        time.sleep(self.pause)


class PauseIn(pl.Callback):
    """On rank 0, the first time the fit reaches ``hook`` (``on_validation_start``, ``on_save_checkpoint``):
    write ``<folder>/<hook>`` and sleep ``seconds`` there, so that a signal the test sends on seeing
    the file arrives at that moment of the fit."""

    def __init__(self, folder: str, hook: str, seconds: float = 3.0) -> None:
        self.folder, self.hook, self.seconds = Path(folder), hook, seconds
        self._done = False
        setattr(self, hook, self._pause)

    def _pause(self, trainer: pl.Trainer, *args, **kwargs) -> None:
        if trainer.sanity_checking or trainer.global_rank != 0 or self._done:
            return
        self._done = True
        (self.folder / self.hook).write_text(str(trainer.global_step))
        time.sleep(self.seconds)


class RecipeRun:
    """``python recipes/<name>.py overrides...`` run from ``cwd``, its output in ``cwd/output.txt``."""

    def __init__(self, name: str, cwd: Path, *overrides: str, step: int = 3, pause: float = 0.05) -> None:
        self.cwd = cwd
        self.pids_folder = cwd / "pids"
        self.pids_folder.mkdir(parents=True, exist_ok=True)
        self.output_path = cwd / "output.txt"
        self.script = ROOT / "recipes" / f"{name}.py"
        announce = [ANNOUNCE, f"+callbacks.announce.folder={self.pids_folder}", f"+callbacks.announce.step={step}",
                    f"+callbacks.announce.pause={pause}"]
        command = [sys.executable, str(self.script), *QUIET, "~logger", *announce, *overrides]
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        with open(self.output_path, "w") as output:
            self.process = subprocess.Popen(
                command, cwd=cwd, stdout=output, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "PYTHONPATH": path},
            )
        self.pids: dict[int, int] = {}

    @property
    def output(self) -> str:
        return self.output_path.read_text(errors="replace")

    def wait_for_ranks(self, world_size: int, timeout: float = 180) -> dict[int, int]:
        """``{rank: pid}`` once every rank has reached the announcing step; fails naming the missing ranks."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.pids = {
                rank: int((self.pids_folder / f"rank{rank}.pid").read_text())
                for rank in range(world_size)
                if (self.pids_folder / f"rank{rank}.pid").exists()
            }
            if len(self.pids) == world_size:
                return self.pids
            if self.process.poll() is not None:
                break
            time.sleep(0.1)
        missing = sorted(set(range(world_size)) - set(self.pids))
        self.kill()
        raise AssertionError(
            f"rank(s) {missing} never reached the announcing step (exit status {self.process.returncode}):\n"
            f"{self.output[-4000:]}"
        )

    def wait_for_file(self, name: str, timeout: float = 180) -> None:
        """Until ``<cwd>/<name>`` exists (a ``PauseIn`` marker); fails with the end of the output."""
        deadline = time.monotonic() + timeout
        while not (self.cwd / name).exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"{name} never appeared (exit status {self.process.returncode}):\n{self.output[-4000:]}")
            time.sleep(0.05)

    def wait_for_started_ranks(self, count: int, timeout: float = 180) -> dict[int, int]:
        """``{rank: pid}`` of the ``count`` ranks the launcher (rank 0) starts, as soon as their processes exist."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            started = _children(self.process.pid)
            if len(started) >= count:
                self.pids = {0: self.process.pid, **{rank: pid for rank, pid in enumerate(started[:count], start=1)}}
                return self.pids
            if self.process.poll() is not None:
                break
            time.sleep(0.02)
        self.kill()
        raise AssertionError(f"the launcher started no {count} ranks (exit status {self.process.returncode}):\n"
                             f"{self.output[-4000:]}")

    def send(self, rank: int, signum: int) -> None:
        """``signum`` to rank ``rank``'s process (rank 0 is the launcher under Lightning's script launcher)."""
        os.kill(self.pids[rank], signum)

    def wait(self, timeout: float) -> int:
        """The launcher's exit status; fails, naming the ranks still alive, if it is not out in ``timeout`` s."""
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            alive = self.alive()
            self.kill()
            raise AssertionError(
                f"the run did not end within {timeout:.0f} s; alive: launcher pid {self.process.pid}, ranks "
                f"{alive}:\n{self.output[-4000:]}"
            ) from None

    def alive(self) -> dict[int, int]:
        """The ranks whose process still exists (not a zombie), ``{rank: pid}``."""
        return {rank: pid for rank, pid in self.pids.items() if _exists(pid)}

    def assert_all_gone(self, timeout: float = 15) -> None:
        """Every rank's process has exited within ``timeout`` s after the launcher did."""
        deadline = time.monotonic() + timeout
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        alive = self.alive()
        if alive:
            self.kill()
            raise AssertionError(f"ranks {alive} (rank: pid) outlived the launcher by {timeout:.0f} s")

    def kill(self) -> None:
        """SIGKILL to this run's processes: the launcher's session and each announced rank, by pid."""
        for pid in [self.process.pid, *self.pids.values()]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait(timeout=30)


def _children(pid: int) -> list[int]:
    """The pids of ``pid``'s child processes, oldest first (``/proc``)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append((int(fields[19]), int(stat.parent.name)))
    return [child for _, child in sorted(found)]


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False
