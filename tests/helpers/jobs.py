"""Run a job of real processes to its end, however each process ends, and check that none is left.

``tests.helpers.distributed.run_ranks`` fails as soon as a rank dies without reporting; the
hang watchdog's tests need the opposite: every process of the job must end (raising, exiting,
or killed by a peer), and the test looks at how each one did. Each rank's stderr (file
descriptor 2, where ``faulthandler`` writes from C) goes to a file the test reads.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.helpers.distributed import free_port, paddle_environ, parent_state, rank_context, take_on


@dataclass
class RankEnd:
    """How one rank's process ended."""

    exitcode: int | None  # negative: the signal that killed it
    ok: bool | None  # None: it reported nothing (killed, or exited without returning)
    payload: Any  # its result, or its traceback
    stderr: str
    ended_at: float  # time.time() when its exit was seen (within 0.1 s)


def _child(fn: Callable[..., Any], rank: int, state: tuple, stderr: str, results: Any, args: tuple) -> None:
    take_on(state)
    descriptor = os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(descriptor, 2)
    import torch

    torch.set_num_threads(1)  # the ranks share 2 cores; more threads only contend
    try:
        results.put((rank, True, fn(rank, *args)))
    except BaseException:  # noqa: BLE001 - everything a rank raises must reach the parent
        results.put((rank, False, traceback.format_exc()))


def run_job(
    fn: Callable[..., Any], world_size: int, directory: Path, *args: Any, timeout: float = 120.0, **environ: str
) -> dict[int, RankEnd]:
    """Run ``fn(rank, *args)`` in one process per rank (``rank_context``) until every one has exited.

    A process still alive after ``timeout`` seconds fails the test, naming its rank, once every
    process was killed: the suite never keeps a stray process.
    """
    context = rank_context()
    results = context.Queue()
    port = free_port()
    stderr = {rank: directory / f"stderr_rank{rank}.txt" for rank in range(world_size)}
    processes = {
        rank: context.Process(
            target=_child,
            args=(fn, rank, parent_state(paddle_environ(rank, world_size, port, **environ)), str(stderr[rank]), results, args),
            daemon=True,
        )
        for rank in range(world_size)
    }
    started = time.monotonic()
    for process in processes.values():
        process.start()
    ended: dict[int, float] = {}  # rank -> time.time() of its exit
    outcomes: dict[int, tuple[bool, Any]] = {}
    try:
        while len(ended) < world_size and time.monotonic() - started < timeout:
            _drain(results, outcomes, wait=0.1)
            for rank, process in processes.items():
                if rank not in ended and process.exitcode is not None:
                    ended[rank] = time.time()
        alive = sorted(set(processes) - set(ended))
        assert not alive, f"rank(s) {alive} still running {timeout:g}s after the job started"
    finally:
        for process in processes.values():
            if process.is_alive():
                process.kill()
            process.join(timeout=5)
    _drain(results, outcomes, wait=1.0)
    return {
        rank: RankEnd(
            exitcode=processes[rank].exitcode,
            ok=outcomes.get(rank, (None, None))[0],
            payload=outcomes.get(rank, (None, None))[1],
            stderr=stderr[rank].read_text() if stderr[rank].exists() else "",
            ended_at=ended[rank],
        )
        for rank in processes
    }


def _drain(results: Any, outcomes: dict[int, tuple[bool, Any]], wait: float) -> None:
    try:
        while True:
            rank, ok, payload = results.get(timeout=wait)
            outcomes[rank] = (ok, payload)
    except queue.Empty:
        return


def alive(pids: Iterable[int]) -> list[int]:
    """The pids of ``pids`` whose process still runs (a zombie, which only waits to be reaped, has ended)."""
    running = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as file:
                state = file.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in ("Z", "X"):
            running.append(pid)
    return running


def alive_after(pids: Iterable[int], timeout: float) -> list[int]:
    """The pids of ``pids`` still running ``timeout`` s from now, or as soon as none is."""
    pids = list(pids)
    deadline = time.monotonic() + timeout
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive(pids)


def kill_session(process: subprocess.Popen) -> None:
    """SIGKILL to the session ``process`` leads (started with ``start_new_session=True``): no process
    of a test's job is left behind, whatever the test found."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()
