"""Which attempt of which job this process belongs to, from the launcher's variables.

A job restarted by its launcher runs the same script again: torchrun (``--max-restarts``)
restarts every worker and exports ``TORCHELASTIC_RUN_ID``, ``TORCHELASTIC_RESTART_COUNT`` and
``TORCHELASTIC_MAX_RESTARTS``; SLURM requeues the job under the same ``SLURM_JOB_ID`` and
exports ``SLURM_RESTART_COUNT``. Paddle's launcher restarts its workers (``--max_restart``) but
exports no restart count; its job id reaches the workers as ``PADDLE_JOB_ID`` when set in the
environment (the launcher reads the same variable as ``--job_id``).

``JobAttempt`` gives the rendezvous a key that differs between attempts (so that a restarted
job never meets an earlier attempt's keys in a store that outlived it), and the recipes a job
id that does not (so that every attempt finds the same run folder and checkpoints).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NoReturn

_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # safe inside a path and a store key


@dataclass(frozen=True)
class Restart:
    """One launcher's restart counter: ``count`` restarts so far, of at most ``limit`` (None: unknown)."""

    launcher: str
    count: int
    limit: int | None

    def describe(self) -> str:
        """``restart 1 of 3`` (torchrun), ``SLURM requeue 2`` (SLURM sets no limit it tells)."""
        what = "SLURM requeue" if self.launcher == "slurm" else "restart"
        return f"{what} {self.count}" + ("" if self.limit is None else f" of {self.limit}")


@dataclass(frozen=True)
class JobAttempt:
    """This process's job and attempt, as its launchers describe them.

    Attributes:
        job_id: the id that every attempt of the job shares, prefixed by the launcher that gave
            it (``slurm-123``, ``torchrun-<run id>``, ``paddle-<job id>``); None outside a
            launcher that names its jobs, and for torchrun's default run id ``none`` (its static
            rendezvous without ``--rdzv-id``) and Paddle's ``default``, which every job shares. SLURM's wins over torchrun's when torchrun runs inside
            a SLURM job: a requeue starts a new torchrun (with a new run id) under the same
            ``SLURM_JOB_ID``.
        restarts: the restart counters of the launchers in effect, outermost first (SLURM, then
            torchrun); empty when no launcher counts restarts.
        agent_store: ``(MASTER_ADDR, MASTER_PORT)`` when torchrun's agent already serves a store
            there (``TORCHELASTIC_USE_AGENT_STORE=True``): the store outlives each attempt.
    """

    job_id: str | None = None
    restarts: tuple[Restart, ...] = ()
    agent_store: tuple[str, int] | None = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> JobAttempt:
        """Read the launcher variables (default ``os.environ``); a malformed one is a ValueError naming it."""
        env = os.environ if environ is None else environ
        restarts = []
        job_id = None
        slurm_job = _read_id(env, "SLURM_JOB_ID")
        if slurm_job is not None:
            job_id = f"slurm-{slurm_job}"
            restarts.append(Restart("slurm", _read_count(env, "SLURM_RESTART_COUNT"), None))
        run_id = _read_id(env, "TORCHELASTIC_RUN_ID")
        if run_id is not None:
            # "none" is torchrun's default --rdzv-id outside --standalone: every such job shares it.
            job_id = job_id or (f"torchrun-{run_id}" if run_id != "none" else None)
            count = _read_count(env, "TORCHELASTIC_RESTART_COUNT")
            limit = _read_count(env, "TORCHELASTIC_MAX_RESTARTS") if "TORCHELASTIC_MAX_RESTARTS" in env else None
            if limit is not None and count > limit:
                _fail("TORCHELASTIC_RESTART_COUNT", str(count), f"at most TORCHELASTIC_MAX_RESTARTS={limit}")
            restarts.append(Restart("torchrun", count, limit))
        paddle_job = _read_id(env, "PADDLE_JOB_ID")
        if job_id is None and paddle_job is not None and paddle_job != "default":
            job_id = f"paddle-{paddle_job}"  # "default" is the launcher's own default, shared by every job
        return cls(job_id, tuple(restarts), _agent_store(env))

    @property
    def is_restart(self) -> bool:
        """True when a launcher says this attempt is not the job's first."""
        return any(restart.count > 0 for restart in self.restarts)

    @property
    def is_last(self) -> bool:
        """True when the innermost launcher will not restart the job again (its limit is reached)."""
        return bool(self.restarts) and self.restarts[-1].limit is not None and self.restarts[-1].count >= self.restarts[-1].limit

    @property
    def key(self) -> str:
        """A store-key fragment that differs between attempts of one job: ``slurm_1/torchrun_0``."""
        return "/".join(f"{restart.launcher}_{restart.count}" for restart in self.restarts) or "attempt_0"

    def describe(self) -> str:
        """``restart 1 of 3`` (torchrun), ``SLURM requeue 2``, both joined, or ``first attempt``."""
        return ", ".join(restart.describe() for restart in self.restarts) or "first attempt"


def _fail(variable: str, value: str, expected: str) -> NoReturn:
    raise ValueError(f"{variable}={value!r} is invalid: expected {expected}.")


def _read_count(env: Mapping[str, str], variable: str) -> int:
    raw = (env.get(variable) or "0").strip()
    if not raw.isdigit():
        _fail(variable, raw, "a restart count, an integer >= 0")
    return int(raw)


def _read_id(env: Mapping[str, str], variable: str) -> str | None:
    raw = env.get(variable)
    if raw is None or not raw.strip():
        return None
    if not _ID_PATTERN.match(raw.strip()):
        _fail(variable, raw, "a job id of letters, digits, '.', '_' or '-'")
    return raw.strip()


def _agent_store(env: Mapping[str, str]) -> tuple[str, int] | None:
    # torch's own test (`torch.distributed.rendezvous._agent_store_serves`): the flag promises a
    # server only at the MASTER_ADDR:MASTER_PORT the agent exported beside it.
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if not addr or not port or not port.strip().isdigit():
        return None
    return addr.strip().strip("[]"), int(port)
