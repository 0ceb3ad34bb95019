"""Replica groups as real processes around a real torchft lighthouse, for the fault-tolerance tests.

``Replicas`` starts each replica group as its own process (one torchrun per group in real use),
can SIGKILL one and start it again, and waits for them with a deadline that names the replica
that did not finish (its id, pid and the end of its log). Every process it started is killed by
pid when the test ends, and the test fails if one is still alive.
"""

from __future__ import annotations

import json
import os
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
