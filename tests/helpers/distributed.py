"""Run a function in several real processes that rendezvous through a launcher's variables.

``run_ranks`` exports what Paddle's launcher exports by default; ``launcher="torchrun"`` or
``launcher="slurm"`` exports what torchrun or SLURM's ``srun`` would (``LAUNCHERS``).

A child's exception is re-raised in the parent with its rank and traceback; ranks that do not
finish within the timeout fail the test by name, and every child is killed: the suite never
hangs on a stuck rank.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import random
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any


def free_port(low: int | None = None, high: int | None = None) -> int:
    """A port nothing listens on now: any the OS picks, or one in ``[low, high]``."""
    if low is None or high is None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]
    for port in random.sample(range(low, high + 1), k=min(200, high - low + 1)):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [{low}, {high}]")


def paddle_environ(rank: int, world_size: int, port: int, **extra: str) -> dict[str, str]:
    endpoints = [f"127.0.0.1:{port + i}" for i in range(world_size)]
    return {
        "PADDLE_TRAINER_ID": str(rank),
        "PADDLE_TRAINERS_NUM": str(world_size),
        "PADDLE_TRAINER_ENDPOINTS": ",".join(endpoints),
        "PADDLE_CURRENT_ENDPOINT": endpoints[rank],
        "PADDLE_DISTRI_BACKEND": "gloo",
        **extra,
    }


def torchrun_environ(rank: int, world_size: int, port: int, **extra: str) -> dict[str, str]:
    """What ``torchrun --nproc-per-node=<world_size>`` exports to one worker of a single node
    (its static rendezvous: rank 0 hosts the store, no agent store)."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": "lit_dp_test",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        **extra,
    }


# SLURM exports no rendezvous address: Lightning's SLURMEnvironment derives the port from the
# job id's last four digits plus 15000, so the port comes from that range.
SLURM_PORTS = (15000, 24999)


def slurm_environ(rank: int, world_size: int, port: int, **extra: str) -> dict[str, str]:
    """What ``srun --ntasks-per-node=<world_size>`` exports to one task of a single-node job whose
    id ends in ``port - 15000`` (no ``MASTER_ADDR``/``MASTER_PORT``: they are derived)."""
    assert SLURM_PORTS[0] <= port <= SLURM_PORTS[1], f"SLURM derives ports in {SLURM_PORTS}, not {port}"
    return {
        "SLURM_JOB_ID": f"7{port - SLURM_PORTS[0]:04d}",
        "SLURM_JOB_NAME": "lit_dp_test",
        "SLURM_NTASKS": str(world_size),
        "SLURM_NTASKS_PER_NODE": str(world_size),
        "SLURM_NNODES": "1",
        "SLURM_NODELIST": "localhost",
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank),
        "SLURM_NODEID": "0",
        **extra,
    }


# How each launcher's variables are made, and the ports it may use.
LAUNCHERS = {
    "paddle": (paddle_environ, (None, None)),
    "torchrun": (torchrun_environ, (None, None)),
    "slurm": (slurm_environ, SLURM_PORTS),
}


# Ranks start from multiprocessing's fork server, which imported these once: a spawned rank imported
# them itself, 3 to 10 s of CPU per rank on a slow 2-core machine, most of the suite's time. The
# server only imported them (no thread pool, process group or CUDA yet), so a rank forked from it
# starts as clean as a spawned one.
RANK_PRELOAD = ["torch", "lit_dp", "lightning.pytorch", "pytest"]


def rank_context() -> Any:
    """The multiprocessing context the helpers start ranks with."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(RANK_PRELOAD)
    return context


def parent_state(environ: dict[str, str]) -> tuple[dict[str, str], str, list[str]]:
    """What a spawned rank inherits from the test now (its environment with ``environ`` on top, its
    working directory, its ``sys.path``), which a rank forked from the fork server must take on:
    it would otherwise have the server's, from when the first test started it."""
    return {**os.environ, **environ}, os.getcwd(), list(sys.path)


def take_on(state: tuple[dict[str, str], str, list[str]]) -> None:
    environ, cwd, path = state
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    sys.path[:] = path


def _child(fn: Callable[..., Any], rank: int, state: tuple, results: Any, args: tuple) -> None:
    take_on(state)
    import torch

    torch.set_num_threads(1)  # 2-3 ranks share 2 cores; more threads only contend
    try:
        results.put((rank, True, fn(rank, *args)))
    except BaseException:  # noqa: BLE001 - everything a rank raises must reach the parent
        results.put((rank, False, traceback.format_exc()))


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 90.0,
    ranks: list[int] | None = None,
    expect_failure: bool = False,
    launcher: str = "paddle",
    **environ: str,
) -> dict[int, Any]:
    """Run ``fn(rank, *args)`` in one process per rank (``rank_context``); return ``{rank: result}``.

    Each rank gets ``launcher``'s variables (a key of ``LAUNCHERS``) plus ``environ``.
    ``ranks`` starts only some of the ranks (to simulate a missing one). With
    ``expect_failure`` the failures are returned (rank -> traceback) instead of raised, once
    every started rank has reported.
    """
    make_environ, ports = LAUNCHERS[launcher]
    context = rank_context()
    results = context.Queue()
    port = free_port(*ports)
    started = list(range(world_size)) if ranks is None else ranks
    processes = {
        rank: context.Process(
            target=_child,
            args=(fn, rank, parent_state(make_environ(rank, world_size, port, **environ)), results, args),
            daemon=True,
        )
        for rank in started
    }
    for process in processes.values():
        process.start()
    outcomes: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcomes) < len(started):
            remaining = deadline - time.monotonic()
            try:
                rank, ok, payload = results.get(timeout=max(0.1, min(remaining, 1.0)))
            except queue.Empty:
                dead = [r for r, p in processes.items() if r not in outcomes and not p.is_alive() and p.exitcode != 0]
                if dead:
                    # Give a dying rank's last message a moment to arrive before blaming a crash.
                    time.sleep(0.5)
                    if results.empty():
                        raise AssertionError(
                            f"rank(s) {dead} exited with code(s) {[processes[r].exitcode for r in dead]} "
                            "without reporting"
                        ) from None
                if remaining <= 0:
                    missing = sorted(set(started) - set(outcomes))
                    raise AssertionError(f"rank(s) {missing} did not finish within {timeout:g}s") from None
                continue
            outcomes[rank] = (ok, payload)
            if not ok and not expect_failure:
                raise AssertionError(f"rank {rank} failed:\n{payload}")
    finally:
        for process in processes.values():
            if process.is_alive():
                process.kill()
            process.join(timeout=5)
    if expect_failure:
        return {rank: payload for rank, (ok, payload) in outcomes.items() if not ok}
    return {rank: payload for rank, (_, payload) in outcomes.items()}


def _launcher(fn: Callable[..., Any], state: tuple, results: Any, args: tuple) -> None:
    take_on(state)
    os.setsid()  # its own session: on a timeout the launcher and the ranks it forked die together
    try:
        results.put((True, fn(*args)))
    except BaseException:  # noqa: BLE001 - everything the launch raises must reach the test
        results.put((False, traceback.format_exc()))


def launch_forking(fn: Callable[..., Any], *args: Any, timeout: float = 120.0) -> Any:
    """Run ``fn(*args)``, which forks ranks (``start_method="fork"``), in a fresh process (``rank_context``).

    Forking from pytest's own process is unsafe once an earlier test ran there: a child inherits
    OpenMP's thread team without its threads (its first parallel op waits forever) and autograd's
    threads ("Unable to handle autograd's threading in combination with fork-based
    multiprocessing"), and Lightning refuses to fork once CUDA was queried (this suite's skipifs).
    A fresh launcher has done none of that, as a user's script has not.
    """
    context = rank_context()
    results = context.Queue()
    launcher = context.Process(target=_launcher, args=(fn, parent_state({}), results, args))
    launcher.start()
    try:
        ok, payload = results.get(timeout=timeout)
    except queue.Empty:
        raise AssertionError(
            f"{fn.__name__} did not finish within {timeout:g}s (its forked ranks hang)"
        ) from None
    finally:
        launcher.join(timeout=5)
        if launcher.is_alive():
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.join()
    assert ok, f"{fn.__name__} failed:\n{payload}"
    return payload
