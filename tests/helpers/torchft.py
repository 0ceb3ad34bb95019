"""Replica groups as real processes around a real torchft lighthouse, for the fault-tolerance tests.

``Replicas`` starts each replica group as its own process (one torchrun per group in real use),
can SIGKILL one and start it again, and waits for them with a deadline that names the replica
that did not finish (its id, pid and the end of its log). Every process it started is killed by
pid when the test ends, and the test fails if one is still alive.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def lighthouse(min_replicas: int = 1, join_timeout_ms: int = 1000, heartbeat_timeout_ms: int = 1500) -> Iterator[str]:
    """A torchft lighthouse in this process; yields its address (``http://host:port``)."""
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(
        bind="[::]:0",
        min_replicas=min_replicas,
        join_timeout_ms=join_timeout_ms,
        quorum_tick_ms=10,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )
    try:
        yield server.address()
    finally:
        server.shutdown()


@dataclass
class Replica:
    group: int
    command: list[str]
    log: Path
    process: subprocess.Popen | None = None
    pids: list[int] = field(default_factory=list)  # every process started for this group

    def tail(self, lines: int = 30) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


class Replicas:
    """Replica groups ``0 .. n-1``, each ``command + [group]`` in its own process (see the module docstring)."""

    def __init__(self, command: list[str], groups: int, directory: Path, lighthouse: str, **environ: str) -> None:
        self.directory = directory
        self.environ = {
            **os.environ,
            "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "TORCHFT_LIGHTHOUSE": lighthouse,
            "OMP_NUM_THREADS": "1",
            **environ,
        }
        self.replicas = [Replica(g, command, directory / f"replica{g}.log") for g in range(groups)]

    def start(self, group: int) -> None:
        replica = self.replicas[group]
        with replica.log.open("a") as log:
            replica.process = subprocess.Popen(
                replica.command, env={**self.environ, "REPLICA_GROUP_ID": str(group)},
                stdout=log, stderr=subprocess.STDOUT, cwd=self.directory,  # what a run writes where it runs
            )  # fmt: skip
        replica.pids.append(replica.process.pid)

    def start_all(self) -> None:
        for replica in self.replicas:
            self.start(replica.group)

    def kill(self, group: int) -> None:
        """SIGKILL the replica group's process and reap it."""
        process = self.replicas[group].process
        assert process is not None
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)

    def wait_for(self, what: str, predicate, timeout: float, killed: Replica | None = None) -> None:
        """Poll ``predicate()`` until true; on timeout (or a replica exiting with an error, other than
        the one the test ``killed``) fail naming them."""
        deadline = time.monotonic() + timeout
        while not predicate():
            failed = [
                r for r in self.replicas if r is not killed and r.process is not None and r.process.poll() not in (None, 0)
            ]
            if failed or time.monotonic() > deadline:
                culprits = failed or [r for r in self.replicas if r.process is not None and r.process.poll() is None]
                raise AssertionError(f"waiting for {what}: " + self._describe(culprits, timeout))
            time.sleep(0.05)

    def wait_all(self, timeout: float) -> None:
        """Every replica group's current process exits 0 within ``timeout`` seconds."""
        self.wait_for(
            "every replica group to finish",
            lambda: all(r.process is not None and r.process.poll() == 0 for r in self.replicas),
            timeout,
        )

    def _describe(self, replicas: list[Replica], timeout: float) -> str:
        parts = []
        for replica in replicas:
            code = replica.process.poll() if replica.process is not None else None
            state = f"exit code {code}" if code is not None else f"still running after {timeout:.0f} s"
            pid = replica.process.pid if replica.process is not None else None
            parts.append(f"replica group {replica.group} (pid {pid}, {state}); its log ends:\n{replica.tail()}")
        return "\n\n".join(parts)

    def close(self) -> None:
        """Kill, by pid, whatever is still running; fail if a process survives."""
        for replica in self.replicas:
            if replica.process is not None and replica.process.poll() is None:
                replica.process.kill()
                replica.process.wait(timeout=30)
        alive = [pid for replica in self.replicas for pid in replica.pids if _alive(pid)]
        assert not alive, f"processes left behind: {alive}"


def _alive(pid: int) -> bool:
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        waited = pid  # already reaped
    if waited == pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@contextmanager
def replica_groups(command: list[str], groups: int, directory: Path, **kwargs) -> Iterator[Replicas]:
    """``Replicas`` around a fresh lighthouse; closed (and checked for leftovers) at the end."""
    names = ("min_replicas", "join_timeout_ms", "heartbeat_timeout_ms")
    lighthouse_kwargs = {name: kwargs.pop(name) for name in names if name in kwargs}
    with lighthouse(**lighthouse_kwargs) as address:
        replicas = Replicas(command, groups, directory, address, **kwargs)
        try:
            yield replicas
        finally:
            replicas.close()


PYTHON = sys.executable


def read_records(path: Path) -> list[dict]:
    """A replica's JSON lines (``tests.helpers.ft_replica``, ``tests.helpers.ft_lightning_replica``)."""
    return [json.loads(line) for line in path.read_text().splitlines()]


COMMITTED = re.compile(r"- step (\d+)\] should_commit=True")


def workers_of(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (a torchrun's workers), oldest first."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return sorted(children)


class LaunchedGroup:
    """One replica group as docs/fault_tolerance.md launches it: its torchrun (``command`` with ``$group``
    replaced and ``extra`` appended), its output, torchft's log of its rank 0, and every worker it started.

    torchrun starts each worker in a session of its own, out of reach of a signal to torchrun's:
    ``stop`` kills the workers it recorded by pid, then the launcher's session."""

    def __init__(self, number: int, command, cwd: Path, environ: dict[str, str], extra: list[str]) -> None:
        self.number = number
        self.argv = [argument.replace("$group", str(number)) for argument in command.argv] + list(extra)
        self.env = {**environ, **{key: value.replace("$group", str(number)) for key, value in command.env}}
        self.cwd = cwd
        self.log = cwd / f"group{number}.out"
        self.log.write_text("")
        self.run_dir = cwd / "outputs" / "gpt" / f"ft-group{number}"
        self.workers: list[int] = []  # every worker its torchruns started, in order
        self.launches = 0
        self.launcher = self._launch()

    def _launch(self) -> subprocess.Popen:
        self.launches += 1
        with self.log.open("a") as out:
            return subprocess.Popen(
                self.argv, cwd=self.cwd, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def watch(self) -> list[int]:
        """Its torchrun's workers now, recorded."""
        now = workers_of(self.launcher.pid)
        self.workers += [pid for pid in now if pid not in self.workers]
        return now

    def worker(self) -> int | None:
        """Its newest worker now (recorded), if one runs."""
        now = self.watch()
        return now[-1] if now else None

    def kill_worker(self, index: int = -1) -> int:
        """SIGKILL one of its workers now (by default its last rank): a rank's death, which its torchrun
        answers by starting the group's workers again. Returns the pid."""
        now = self.watch()
        assert now, f"replica group {self.number} has no worker to kill:\n{self.describe()}"
        os.kill(now[index], signal.SIGKILL)
        return now[index]

    def relaunch(self) -> None:
        """The group's death: its torchrun and every worker SIGKILLed at once, then its command started again
        (as SLURM requeues a lost node's job); the output goes on in the same file."""
        self.stop()
        self.launcher = self._launch()

    def stop(self) -> None:
        """SIGKILL its workers (by pid) and its torchrun's session, and reap the torchrun."""
        for pid in self.watch():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.launcher.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.launcher.pid, signal.SIGKILL)
        self.launcher.wait()

    def alive_workers(self) -> list[int]:
        """The workers it ever started that still run (not zombies)."""
        return [pid for pid in self.workers if _running(pid)]

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def committed(self) -> int:
        """The newest step its rank 0 committed, from torchft's log in its run folder."""
        path = self.run_dir / f"torchft-group{self.number}.log"
        found = COMMITTED.findall(path.read_text(errors="replace")) if path.exists() else []
        return max(map(int, found), default=-1)

    def describe(self) -> str:
        tail = "\n".join(self.output().replace("\r", "\n").splitlines()[-25:])
        return f"replica group {self.number} (torchrun pid {self.launcher.pid}, workers {self.workers}); its output ends:\n{tail}"


def _running(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    try:
        return "zombie" not in status.read_text()
    except OSError:
        return False


def wait_for_groups(what: str, predicate, groups: list[LaunchedGroup], timeout: float, check=None) -> None:
    """Poll ``predicate()``, recording the groups' workers, until true; fail naming a launcher that exited
    (with an error, or at the end of its run: every wait here is for groups that still train), or every
    group's output after ``timeout`` seconds. ``check()``, if given, runs at each poll and may fail the
    wait sooner (an AssertionError of its own)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        for group in groups:
            group.watch()
        if check is not None:
            check()
        # Else a wait would last its whole timeout for what a launcher that is gone can no longer bring.
        ended = [group for group in groups if group.launcher.poll() is not None]
        if ended:
            if predicate():  # its output may have said it as it ended
                return
            exited = "; ".join(f"replica group {g.number}'s torchrun exited {g.launcher.returncode}" for g in ended)
            raise AssertionError(f"waiting for {what}: {exited}:\n\n" + "\n\n".join(g.describe() for g in ended))
        if time.monotonic() > deadline:
            raise AssertionError(f"waiting for {what} for {timeout:.0f} s:\n\n" + "\n\n".join(g.describe() for g in groups))
        time.sleep(0.2)


def documented_lighthouse(tmp_path: Path, command, exports: dict[str, str], root: Path) -> tuple[Path, dict[str, str], subprocess.Popen]:
    """The documented launch's start, as a user makes it from a fresh folder: the folder (with the
    repository's ``recipes`` and ``conf``), the environment its ``export`` lines give (the
    lighthouse's port a free one), and the lighthouse started with the documented ``command``."""
    from tests.helpers.distributed import free_port

    cwd = tmp_path / "clone"
    cwd.mkdir()
    for name in ("recipes", "conf"):
        (cwd / name).symlink_to(root / name)
    port = free_port()
    documented_port = re.search(r":(\d+)$", exports["TORCHFT_LIGHTHOUSE"]).group(1)
    environ = {
        **os.environ,
        **exports,
        "TORCHFT_LIGHTHOUSE": exports["TORCHFT_LIGHTHOUSE"].replace(documented_port, str(port)),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
    }
    argv = [argument.replace(documented_port, str(port)) for argument in command.argv]
    with (tmp_path / "lighthouse.out").open("w") as out:
        lighthouse = subprocess.Popen(argv, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
    return cwd, environ, lighthouse


def wait_for_groups_to_end(groups: list[LaunchedGroup], timeout: float, check=None) -> None:
    """Every group's torchrun exits 0 by itself within ``timeout`` seconds, its workers recorded meanwhile
    (a restart between two looks would otherwise go unseen); fail naming a group that exited with an
    error, or those still running. ``check()``, if given, runs at each poll (see ``wait_for_groups``)."""
    deadline = time.monotonic() + timeout
    while any(group.launcher.poll() is None for group in groups):
        for group in groups:
            group.watch()
        if check is not None:
            check()
        failed = [group for group in groups if group.launcher.poll() not in (None, 0)]
        if failed:
            raise AssertionError("\n\n".join(f"replica group {g.number}'s torchrun exited {g.launcher.returncode}:\n{g.describe()}" for g in failed))
        if time.monotonic() > deadline:
            running = [group for group in groups if group.launcher.poll() is None]
            raise AssertionError(
                f"replica groups {', '.join(str(g.number) for g in running)} did not end by themselves within {timeout:.0f} s:\n\n"
                + "\n\n".join(g.describe() for g in running)
            )
        time.sleep(0.2)
    failed = [group for group in groups if group.launcher.returncode != 0]
    assert not failed, "\n\n".join(f"replica group {g.number}'s torchrun exited {g.launcher.returncode}:\n{g.describe()}" for g in failed)


FAULT_TOLERANCE_DOC = ROOT / "docs" / "fault_tolerance.md"
LOCAL_SGD = "strategy.local_sgd."


@dataclass(frozen=True)
class DocumentedGroupLaunch:
    """docs/fault_tolerance.md's launch of replica groups of ``ranks`` ranks: the lighthouse's command, a
    group's command per mode (``per_step``, ``diloco``), and what the launch block exports."""

    lighthouse: object  # a tests.helpers.documented.DocumentedCommand
    modes: dict[str, object]
    exports: dict[str, str]


def documented_group_launch(ranks: int) -> DocumentedGroupLaunch:
    """The documented commands for groups of ``ranks`` ranks (``torchrun --nproc-per-node=ranks``). The
    docs show DiLoCo across groups for groups of two ranks; for another size its command is the per-step
    one with the same ``strategy.local_sgd.*`` options added."""
    import shlex

    from tests.helpers.documented import DocumentedCommand, documented_commands

    commands = documented_commands([FAULT_TOLERANCE_DOC])
    lighthouse = next(c for c in commands if c.argv[0] == "torchft_lighthouse")
    runs = [c for c in commands if c.argv[0] == "torchrun" and "recipes/gpt.py" in c.argv]
    sized = [c for c in runs if f"--nproc-per-node={ranks}" in c.argv]
    assert sized, f"docs/fault_tolerance.md shows no launch of groups of {ranks} ranks"
    per_step = next(c for c in sized if not any(a.startswith(LOCAL_SGD) for a in c.argv))
    diloco = next((c for c in runs if "strategy.local_sgd.outer=nesterov" in c.argv), None)
    assert diloco is not None, "docs/fault_tolerance.md shows no DiLoCo launch across groups"
    if f"--nproc-per-node={ranks}" not in diloco.argv:
        options = tuple(a for a in diloco.argv if a.startswith(LOCAL_SGD))
        diloco = DocumentedCommand(per_step.source, per_step.argv + options, per_step.env)
    block = next(b for b in FAULT_TOLERANCE_DOC.read_text().split("```bash")[1:] if f"--nproc-per-node={ranks}" in b)
    exports: dict[str, str] = {}
    for line in block.split("```")[0].splitlines():
        if line.startswith("export "):
            exports.update(word.split("=", 1) for word in shlex.split(line, comments=True)[1:])
    return DocumentedGroupLaunch(lighthouse, {"per_step": per_step, "diloco": diloco}, exports)
