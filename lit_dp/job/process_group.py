"""Bringing up torch.distributed from the launcher's description: Paddle's ``init_parallel_env``.

Steps: find the launcher and the job it describes (``lit_dp.job.launcher``); adopt a process
group that already exists, checked against it; otherwise resolve the backend, select the
device (NCCL), rendezvous through a ``TCPStore`` hosted by rank 0 (or by torchrun's agent) with
a named-rank arrival check, create the default process group, then the extra ring
communicators (``FLAGS_nccl_nrings``) the reducer spreads buckets over.

Every key of a rendezvous, the process group's own included (Gloo's and NCCL's address
exchange), lives under a prefix naming the job's attempt and this process's rendezvous count
(``lit_dp/torchrun_1/init_0/...``). Under torchrun the store on ``MASTER_PORT`` is the agent's
and outlives each attempt: without the prefix, a restarted worker read its peers' addresses
from the previous attempt and failed in Gloo's ``connectFullMesh`` ("Connection refused"),
and the arrival counter, already at the world size, let it through without waiting
(docs/process_group.md, "Restarts").
"""

from __future__ import annotations

import os
import socket
import time
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import NoReturn, TypeVar

import torch
import torch.distributed as dist

from lit_dp.job.env import ParallelEnv, format_endpoint
from lit_dp.job.launcher import Launch, detect_launch
from lit_dp.job.restart import JobAttempt
from lit_dp.options.backends import AUTO, check_backend, uses_nccl
from lit_dp.options.declare import parse_timeout
from lit_dp.options.warning import LitDPWarning

_ARRIVED = "lit_dp/arrived/{}"
_ARRIVED_COUNT = "lit_dp/arrived"
_MISSING = "lit_dp/missing"
_ACKNOWLEDGED = "lit_dp/acknowledged"
_DEVICE = "lit_dp/device/{}"
_POLL_SECONDS = 0.05
_GRACE_SECONDS = 2.0

T = TypeVar("T")

# The extra ring communicators (ring 0 is the default group itself), keyed weakly on the default
# group they were created with: once torch lets go of it (`destroy_process_group()` drops every
# group), its rings go too, in this process. A strong reference would defer a destroyed Gloo
# group's destructor to whatever next drops it: under a fork launcher, the child's
# `init_parallel_env`, where the parent's Gloo worker threads do not exist and the destructor
# waits for them forever (see docs/fabric.md).
_extra_rings_by_world: weakref.WeakKeyDictionary[dist.ProcessGroup, list[dist.ProcessGroup]] = (
    weakref.WeakKeyDictionary()
)


def resolve_backend(backend: str) -> str:
    """``auto`` becomes NCCL when CUDA is available, else Gloo; NCCL without CUDA is an error.

    Any other backend torch.distributed reports available (``mpi``, ``ucc``, the per-device
    ``"cpu:gloo,cuda:nccl"``) passes through unchanged.
    """
    name = check_backend("backend", backend)
    if name == AUTO:
        return "nccl" if torch.cuda.is_available() else "gloo"
    if uses_nccl(name) and not torch.cuda.is_available():
        raise ValueError(
            f"backend={name!r} needs CUDA, but torch.cuda.is_available() is False on this machine: "
            "use backend='gloo' (or 'auto') for CPU training."
        )
    return name


def resolve_timeout(timeout: timedelta | float | None, env: ParallelEnv) -> timedelta:
    """The argument (a timedelta or seconds) wins; else ``PADDLE_PG_TIMEOUT`` (milliseconds)."""
    if timeout is None:
        return timedelta(milliseconds=env.pg_timeout)
    return parse_timeout("timeout", timeout)


def init_parallel_env(
    backend: str | None = None,
    timeout: timedelta | float | None = None,
    *,
    parallel_env: ParallelEnv | None = None,
    one_process_group: bool = False,
    attempt: JobAttempt | None = None,
) -> dist.ProcessGroup | None:
    """Create torch.distributed's default process group from the launcher's variables, or adopt it.

    The launcher is found by one rule shared with the Lightning strategies (``lit_dp.job.launcher``:
    Paddle's launcher, torchrun, SLURM, LSF, MPI, torch's env:// variables, in that order).

    Args:
        backend: ``"auto"`` or any backend torch.distributed reports available (``"gloo"``,
            ``"nccl"``, ``"cpu:gloo,cuda:nccl"``, ...); defaults to ``PADDLE_DISTRI_BACKEND``.
        timeout: bounds the rendezvous and every collective (timedelta or seconds); defaults to
            ``PADDLE_PG_TIMEOUT``.
        parallel_env: the job description; defaults to the detected launcher's. The Lightning
            strategies pass one built from Lightning's cluster environment.
        one_process_group: at world size 1, create a group of one rank instead of none, so that
            code calling ``torch.distributed`` runs unchanged on one device (what the Lightning
            strategies ask for, like Lightning's ``"ddp"``). A job torchrun, SLURM, LSF, MPI or
            torch's env:// variables describe gets one too, as from ``init_process_group``.
        attempt: which attempt of a restarted job this is; defaults to
            ``JobAttempt.from_environ()`` (torchrun's, SLURM's restart counts).

    Returns:
        The default process group, or None (with a warning, Paddle's documented behaviour) for
        a world size of 1 described by Paddle's variables or by none. A group that already
        exists (``torch.distributed.init_process_group``, an earlier call) is adopted.

    Raises:
        RuntimeError: an existing group disagrees with the launcher's rank or world size, or
            with the backend asked for; the message names each value and where it came from.
    """
    launch = Launch.given(parallel_env) if parallel_env is not None else detect_launch()
    env = launch.parallel_env
    if dist.is_initialized():
        return _adopt(launch, backend, timeout)
    if env.world_size < 2 and not (one_process_group or launch.expects_process_group):
        described = launch.world_size_source or "no launcher variables are set"
        warnings.warn(
            f"init_parallel_env: world size is 1 ({described}); "
            "no process group is created and training runs in this single process.",
            LitDPWarning,
            stacklevel=2,
        )
        return None
    chosen = resolve_backend(env.backend if backend is None else backend)
    deadline = resolve_timeout(timeout, env)
    if env.world_size > 1 and (env.master_addr is None or env.master_port is None):
        raise ValueError(
            f"init_parallel_env: world size is {env.world_size} but no rendezvous address is set: expected "
            "MASTER_ADDR and MASTER_PORT, PADDLE_MASTER, or PADDLE_TRAINER_ENDPOINTS."
        )
    device = device_id = None
    if uses_nccl(chosen):
        _select_cuda_device(env.device_id, launch.device_source)
        device = cuda_device_identity(env.device_id)
        # NCCL's eager init, bound to this device (Lightning's DDPStrategy passes it too).
        device_id = torch.device("cuda", env.device_id)

    arguments = {"rank": env.rank, "world_size": env.world_size, "timeout": deadline, "device_id": device_id}
    if env.world_size > 1:
        attempt = JobAttempt.from_environ() if attempt is None else attempt
        dist.init_process_group(chosen, store=_rendezvous(env, deadline, device, attempt), **arguments)
    elif env.master_addr is not None and env.master_port is not None:
        # One rank has nobody to meet: the group is created with the very call Lightning's "ddp"
        # makes (torch's env:// rendezvous at the launcher's address), so that a script or test
        # that checks the call (Lightning's own test_set_timeout) sees the same one.
        with _address_in_environ(env.master_addr, env.master_port):
            dist.init_process_group(chosen, **arguments)
    else:
        # Nobody to meet and no address to meet at: an in-memory store, no port bound.
        dist.init_process_group(chosen, store=dist.HashStore(), **arguments)
    world = dist.group.WORLD
    # Only extra rings are recorded: with one ring nothing refers to the group, so a test that
    # mocks `init_process_group` (Lightning's own do; the group is then None) runs unharmed.
    if env.nrings > 1:
        _add_rings(world, env.nrings, chosen, deadline)
    return world


@contextmanager
def _address_in_environ(address: str, port: int) -> Iterator[None]:
    """``MASTER_ADDR`` and ``MASTER_PORT``, where torch's env:// rendezvous reads them, for one
    call: Lightning's ``DDPStrategy`` exports them for good; here the process's environment is
    left as it was."""
    given = {name: os.environ.get(name) for name in ("MASTER_ADDR", "MASTER_PORT")}
    os.environ.update(MASTER_ADDR=address, MASTER_PORT=str(port))
    try:
        yield
    finally:
        for name, value in given.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _adopt(launch: Launch, backend: str | None, timeout: timedelta | float | None) -> dist.ProcessGroup:
    """The existing default group, once its rank, world size and backend agree with ``launch``."""
    env = launch.parallel_env
    world = dist.group.WORLD
    rank, world_size = dist.get_rank(), dist.get_world_size()
    running = dist.get_backend_config(world)
    layout = []
    if launch.world_size_source is not None and world_size != env.world_size:
        layout.append(f"world size {env.world_size} ({launch.world_size_source})")
    if launch.rank_source is not None and rank != env.rank:
        layout.append(f"rank {env.rank} ({launch.rank_source})")
    problems = [f"{launch.who} describes {' and '.join(layout)}"] if layout else []
    asked = env.backend if backend is None else check_backend("backend", backend)
    if asked != AUTO and not backends_agree(running, asked):
        source = "the backend argument" if backend is not None else "PADDLE_DISTRI_BACKEND"
        problems.append(f"backend={asked!r} was asked for ({source})")
    if problems:
        shown = dist.get_backend(world)
        raise RuntimeError(
            f"init_parallel_env: a process group of world size {world_size} exists (rank {rank}, "
            f"{running if shown == 'undefined' else shown}), but {'; and '.join(problems)}. Create the group from the "
            "launcher's own values (torch.distributed.init_process_group() reads RANK and WORLD_SIZE), or let "
            "init_parallel_env create it."
        )
    if env.nrings > 1 and world not in _extra_rings_by_world:
        _add_rings(world, env.nrings, None, resolve_timeout(timeout, env))
    return world


def backends_agree(running: str, asked: str) -> bool:
    """Whether a group configured as ``running`` (torch's ``"cpu:gloo,cuda:gloo"`` form, from
    ``get_backend_config``) runs ``asked`` for every device type both name, and they share one."""
    have = dist.BackendConfig(dist.Backend(running)).get_device_backend_map()
    want = dist.BackendConfig(dist.Backend(asked)).get_device_backend_map()
    common = have.keys() & want.keys()
    return bool(common) and all(have[device] == want[device] for device in common)


def _add_rings(world: dist.ProcessGroup, nrings: int, backend: str | None, timeout: timedelta) -> None:
    _extra_rings_by_world[world] = [dist.new_group(backend=backend, timeout=timeout) for _ in range(nrings - 1)]


def destroy_parallel_env() -> None:
    """Destroy the default group and its rings, releasing the rendezvous port for a later init."""
    _extra_rings_by_world.clear()
    if dist.is_initialized():
        dist.destroy_process_group()


def get_rings() -> list[dist.ProcessGroup]:
    """The communicators buckets are spread over: ring 0 is the default group.

    Empty when no process group exists; just the default group when it was not created by
    ``init_parallel_env`` (for example by torchrun code calling ``init_process_group`` itself).
    """
    if not dist.is_initialized():
        return []
    world = dist.group.WORLD
    return [world, *_extra_rings_by_world.get(world, [])]


def _select_cuda_device(device_id: int, source: str) -> None:
    count = torch.cuda.device_count()
    if device_id >= count:
        raise ValueError(
            f"{source} selects CUDA device {device_id}, but this process sees {count} CUDA device(s): "
            f"expected an id in [0, {count})."
        )
    torch.cuda.set_device(device_id)


def cuda_device_identity(device_id: int) -> str:
    """This process's CUDA device as ``host/uuid (cuda:N)``: the same physical GPU gives the same
    host and uuid whatever ``CUDA_VISIBLE_DEVICES`` renumbers it to."""
    return f"{socket.gethostname()}/{torch.cuda.get_device_properties(device_id).uuid} (cuda:{device_id})"


def register_device(store: dist.Store, rank: int, identity: str) -> None:
    """Record that ``rank`` drives the device ``identity`` (before the rendezvous completes)."""
    key = _DEVICE.format(identity.split(" ")[0])
    store.set(f"{key}/{store.add(key, 1)}", str(rank))


def check_device_unshared(store: dist.Store, env: ParallelEnv, identity: str) -> None:
    """Raise, on every rank involved, if another rank registered the same device.

    NCCL refuses two ranks on one GPU only after a long wait ("Duplicate GPU detected"); the
    registrations are complete once every rank arrived, so this costs one store round trip.
    """
    key = _DEVICE.format(identity.split(" ")[0])
    count = store.add(key, 0)
    if count < 2:
        return
    ranks = sorted(int(store.get(f"{key}/{n}")) for n in range(1, count + 1))
    raise ValueError(
        f"rank {env.rank}: ranks {ranks} all resolve to the same CUDA device {identity} under NCCL, which needs "
        "one device per rank: give each local rank its own device with FLAGS_selected_gpus (Paddle's launcher), "
        "LOCAL_RANK (torchrun, Lightning) or CUDA_VISIBLE_DEVICES, or use backend='gloo' to share a device."
    )


def _rendezvous(
    env: ParallelEnv, timeout: timedelta, device: str | None = None, attempt: JobAttempt | None = None
) -> dist.Store:
    """Connect to the job's store and wait until every rank of this attempt has checked in.

    Returns the store under this rendezvous's own prefix: the process group built on it keeps
    its keys (Gloo's and NCCL's addresses) apart from any earlier attempt's.

    torch's own store rendezvous reports a missing peer only as a bare timeout. Here each rank
    bumps a counter; rank 0 decides when the timeout passes, publishes the ranks that never
    arrived, and waits briefly for the others to read it, so every rank names them. A rank that
    drives a CUDA device under NCCL (``device``) registers it first, and all check for sharing.
    """
    attempt = JobAttempt() if attempt is None else attempt
    address = format_endpoint(env.master_addr, env.master_port)
    seconds = timeout.total_seconds()
    # Under torchrun the agent already serves the store at MASTER_ADDR:MASTER_PORT; rank 0
    # joins it as a client rather than fail to bind the port.
    hosted_by_agent = attempt.agent_store == (env.master_addr, env.master_port)
    try:
        server = dist.TCPStore(
            env.master_addr,
            env.master_port,
            world_size=env.world_size,
            is_master=env.rank == 0 and not hosted_by_agent,
            timeout=timeout,
            wait_for_workers=False,
        )
    except (RuntimeError, OSError) as error:
        role = "host" if env.rank == 0 and not hosted_by_agent else "reach"
        host = "torchrun's agent" if hosted_by_agent else "rank 0"
        raise RuntimeError(
            f"rank {env.rank} could not {role} the rendezvous store at {address} within {seconds:g}s "
            f"({host} hosts it; is it running, and is the port free?): {error}"
        ) from error
    store = dist.PrefixStore(_rendezvous_prefix(server, attempt, env.rank), server)
    where = f"{address} ({attempt.describe()})"
    if device is not None:
        register_device(store, env.rank, device)
    store.set(_ARRIVED.format(env.rank), "1")
    store.add(_ARRIVED_COUNT, 1)
    # Other ranks give rank 0 a moment longer, so the verdict (and its list of names) is rank 0's.
    deadline = time.monotonic() + seconds + (0 if env.rank == 0 else _GRACE_SECONDS)
    try:
        while store.add(_ARRIVED_COUNT, 0) < env.world_size:
            if env.rank != 0 and store.check([_MISSING]):
                store.add(_ACKNOWLEDGED, 1)
                _raise_missing(env, where, seconds, store.get(_MISSING).decode())
            if time.monotonic() >= deadline:
                if env.rank != 0:
                    raise RuntimeError(f"rank {env.rank}: rank 0 gave no verdict on the rendezvous at {where}")
                missing = [r for r in range(env.world_size) if not store.check([_ARRIVED.format(r)])]
                store.set(_MISSING, str(missing))
                _await_acknowledgements(store, env.world_size - len(missing) - 1)
                _raise_missing(env, where, seconds, str(missing))
            time.sleep(_POLL_SECONDS)
    except dist.DistError as error:
        raise RuntimeError(
            f"rank {env.rank}: the rendezvous store at {where} went away before all "
            f"{env.world_size} ranks arrived: {error}"
        ) from error
    if device is not None:
        check_device_unshared(store, env, device)
    return store


def _rendezvous_prefix(server: dist.Store, attempt: JobAttempt, rank: int) -> str:
    """``lit_dp/<attempt>/init_<n>/``: this rank's n-th rendezvous in this attempt.

    Every rank rebuilds the group the same number of times (destroyed and created again; the
    strategies adopt a live group without a rendezvous), so the n-th rendezvous of each rank
    meet, apart from the earlier ones still in a store that outlives them (torchrun's agent store).
    """
    count = server.add(f"lit_dp/{attempt.key}/rendezvous_count/{rank}", 1)
    return f"lit_dp/{attempt.key}/init_{count - 1}/"


def _raise_missing(env: ParallelEnv, where: str, seconds: float, missing: str) -> NoReturn:
    raise RuntimeError(
        f"rank {env.rank}: rank(s) {missing} of world size {env.world_size} did not arrive at the rendezvous "
        f"{where} within {seconds:g}s (PADDLE_PG_TIMEOUT or timeout=)."
    )


def _await_acknowledgements(store: dist.Store, expected: int) -> None:
    deadline = time.monotonic() + _GRACE_SECONDS
    while store.add(_ACKNOWLEDGED, 0) < expected and time.monotonic() < deadline:
        time.sleep(_POLL_SECONDS)


def barrier(device: torch.device) -> None:
    """A barrier on the default group, if there is one; under NCCL on this rank's ``device``."""
    if not dist.is_initialized():
        return
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def broadcast_object(obj: T, src: int = 0) -> T:
    """``obj`` as global rank ``src`` has it (itself without a process group)."""
    if not dist.is_initialized():
        return obj
    container = [obj]
    dist.broadcast_object_list(container, src)
    return container[0]
