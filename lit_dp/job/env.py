"""Parsing and validation of the job description that Paddle's launcher exports.

``ParallelEnv`` keeps the attribute names and meanings of ``paddle.distributed.ParallelEnv`` so
that a job moved from ``python -m paddle.distributed.launch`` keeps working unchanged. Every
variable is validated when the object is built: a typo must fail here, naming the variable, and
never surface later as a hang inside a collective.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import NoReturn

from lit_dp.options.backends import check_backend
from lit_dp.options.core import MAX_NRINGS

DEFAULT_PG_TIMEOUT_MS = 1_800_000
# Their presence means "Paddle's launcher (or a stand-in) started this process".
PADDLE_LAUNCHER_VARIABLES = ("PADDLE_TRAINER_ID", "PADDLE_TRAINERS_NUM")

_DEVICE_TYPE_PATTERN = re.compile(r"^[a-z][a-z0-9_]*$")


def started_by_paddle(environ: Mapping[str, str] | None = None) -> bool:
    """Whether Paddle's launcher started this process: ``PADDLE_TRAINER_ID`` and ``PADDLE_TRAINERS_NUM`` are set."""
    env = os.environ if environ is None else environ
    return all(variable in env for variable in PADDLE_LAUNCHER_VARIABLES)


def _fail(variable: str, value: str, expected: str) -> NoReturn:
    raise ValueError(f"{variable}={value!r} is invalid: expected {expected}.")


def _read(environ: Mapping[str, str], variable: str) -> str | None:
    """The stripped value of ``variable``, or None when it is unset or blank."""
    value = environ.get(variable)
    if value is None or not value.strip():
        return None
    return value.strip()


def _parse_int(environ: Mapping[str, str], variable: str, default: int, minimum: int, maximum: int | None = None) -> int:
    raw = _read(environ, variable)
    if raw is None:
        return default
    bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
    try:
        value = int(raw)
    except ValueError:
        _fail(variable, raw, f"an integer {bounds}")
    if value < minimum or (maximum is not None and value > maximum):
        _fail(variable, raw, f"an integer {bounds}")
    return value


def parse_port(variable: str, raw: str, shown: str | None = None) -> int:
    """A TCP port in 1..65535, or a ValueError naming ``variable`` and ``shown`` (default ``raw``)."""
    try:
        port = int(raw)
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        _fail(variable, raw if shown is None else shown, "a port number in [1, 65535]")
    return port


def parse_endpoint(variable: str, raw: str) -> tuple[str, int]:
    """Split ``host:port`` (IPv6 hosts in brackets: ``[::1]:6170``) into ``(host, port)``.

    The host comes back without brackets, ready for ``TCPStore``.
    """
    text = raw.strip()
    expected = "'host:port' (IPv6 hosts in brackets, e.g. '[::1]:6170')"
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":") or not host:
            _fail(variable, raw, expected)
        port_text = rest[1:]
    else:
        host, sep, port_text = text.rpartition(":")
        # An unbracketed IPv6 address is ambiguous: "::1:6170" could be host "::1" or "::1:6170".
        if not sep or not host or ":" in host:
            _fail(variable, raw, expected)
    if not port_text or any(c.isspace() for c in host):
        _fail(variable, raw, expected)
    return host, parse_port(variable, port_text, shown=raw)


def format_endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class ParallelEnv:
    """An immutable, validated view of a data-parallel job's launcher variables.

    Attributes keep Paddle's meanings:

    - ``rank`` (``PADDLE_TRAINER_ID``, default 0) and ``world_size`` (``PADDLE_TRAINERS_NUM``,
      default 1); aliases ``nranks``.
    - ``device_type`` (``PADDLE_XCCL_BACKEND``, default ``""``) and ``device_id``: the first id of
      ``FLAGS_selected_gpus``, or of ``FLAGS_selected_<device_type>s`` for a custom device
      (default 0); alias ``dev_id``.
    - ``current_endpoint`` (``PADDLE_CURRENT_ENDPOINT``, ``""`` when unset, as in Paddle) and
      ``trainer_endpoints`` (``PADDLE_TRAINER_ENDPOINTS``, comma separated, empty list when unset).
    - ``nrings`` (``FLAGS_nccl_nrings``, 1..8, default 1) and ``pg_timeout``
      (``PADDLE_PG_TIMEOUT``, milliseconds, default 1800000).

    Additions for PyTorch:

    - ``master_addr`` / ``master_port``: ``MASTER_ADDR`` + ``MASTER_PORT``, else
      ``PADDLE_MASTER`` (``host:port``), else the first trainer endpoint (Paddle's order);
      None when none is set.
    - ``backend``: ``PADDLE_DISTRI_BACKEND`` (``auto``, default, or any backend torch.distributed
      reports available, e.g. ``gloo``, ``nccl``, ``cpu:gloo,cuda:nccl``).
    - ``local_rank`` / ``local_world_size``: this process's index among the processes of its
      node, and their number. ``PADDLE_RANK_IN_NODE`` and ``PADDLE_LOCAL_SIZE`` win when the
      launcher sets them; otherwise they are derived from the endpoint list: the processes of a
      node are the endpoints that share the current endpoint's host, counted in list order.
      Without endpoints the job is taken to be a single node (``local_rank == rank``).
    - ``node_rank``: the index of this host among the distinct hosts of the endpoint list, in
      order of first appearance (0 without endpoints), unless given.

    Args:
        environ: the variables to read; defaults to ``os.environ``. Tests pass a dict.
        node_rank: this node's index when another launcher tells it (torchrun's ``GROUP_RANK``,
            ``SLURM_NODEID``): Paddle's launcher has no variable for it.

    Raises:
        ValueError: for any malformed or inconsistent value, naming the variable, the value and
            what is expected.
    """

    __slots__ = (
        "rank",
        "world_size",
        "device_type",
        "device_id",
        "current_endpoint",
        "_trainer_endpoints",
        "nrings",
        "pg_timeout",
        "master_addr",
        "master_port",
        "backend",
        "local_rank",
        "local_world_size",
        "node_rank",
    )

    def __init__(self, environ: Mapping[str, str] | None = None, *, node_rank: int | None = None) -> None:
        env = os.environ if environ is None else environ
        world_size = _parse_int(env, "PADDLE_TRAINERS_NUM", default=1, minimum=1)
        rank = _parse_int(env, "PADDLE_TRAINER_ID", default=0, minimum=0)
        if rank >= world_size:
            raise ValueError(
                f"PADDLE_TRAINER_ID={rank} is invalid: expected a rank in [0, {world_size}) "
                f"because PADDLE_TRAINERS_NUM={world_size}."
            )
        device_type = _parse_device_type(env)
        endpoints = _parse_endpoint_list(env, world_size)
        current = _parse_current_endpoint(env, endpoints, rank)
        master_addr, master_port = _parse_master(env, endpoints)
        backend = check_backend("PADDLE_DISTRI_BACKEND", _read(env, "PADDLE_DISTRI_BACKEND") or "auto")
        local_rank, local_world_size, derived_node_rank = _node_layout(env, endpoints, current, rank, world_size)

        assign = super().__setattr__
        assign("rank", rank)
        assign("world_size", world_size)
        assign("device_type", device_type)
        assign("device_id", _parse_device_id(env, device_type))
        assign("current_endpoint", current)
        assign("_trainer_endpoints", tuple(endpoints))
        assign("nrings", _parse_int(env, "FLAGS_nccl_nrings", default=1, minimum=1, maximum=MAX_NRINGS))
        assign("pg_timeout", _parse_int(env, "PADDLE_PG_TIMEOUT", default=DEFAULT_PG_TIMEOUT_MS, minimum=1))
        assign("master_addr", master_addr)
        assign("master_port", master_port)
        assign("backend", backend)
        assign("local_rank", local_rank)
        assign("local_world_size", local_world_size)
        assign("node_rank", derived_node_rank if node_rank is None else node_rank)

    def __setattr__(self, name: str, value: object) -> NoReturn:
        raise AttributeError(f"ParallelEnv is immutable; cannot set {name!r}")

    @property
    def nranks(self) -> int:
        return self.world_size

    @property
    def dev_id(self) -> int:
        return self.device_id

    @property
    def trainer_endpoints(self) -> list[str]:
        # A fresh list (Paddle's type), so callers cannot mutate the parsed view.
        return list(self._trainer_endpoints)

    def __repr__(self) -> str:
        fields = ", ".join(f"{name.lstrip('_')}={getattr(self, name)!r}" for name in self.__slots__)
        return f"ParallelEnv({fields})"


def _parse_device_type(env: Mapping[str, str]) -> str:
    device_type = (_read(env, "PADDLE_XCCL_BACKEND") or "").lower()
    if device_type and not _DEVICE_TYPE_PATTERN.match(device_type):
        _fail("PADDLE_XCCL_BACKEND", env["PADDLE_XCCL_BACKEND"], "a device type name such as 'npu' or 'mlu'")
    return device_type


def _parse_device_id(env: Mapping[str, str], device_type: str) -> int:
    variable = f"FLAGS_selected_{device_type}s" if device_type else "FLAGS_selected_gpus"
    raw = _read(env, variable)
    if raw is None:
        return 0
    ids = [item.strip() for item in raw.split(",")]
    if not all(item.isdigit() for item in ids):
        _fail(variable, raw, "a comma-separated list of non-negative device ids, e.g. '0' or '0,1'")
    return int(ids[0])


def _parse_endpoint_list(env: Mapping[str, str], world_size: int) -> list[str]:
    raw = _read(env, "PADDLE_TRAINER_ENDPOINTS")
    if raw is None:
        return []
    items = [item.strip() for item in raw.split(",")]
    if any(not item for item in items):
        _fail("PADDLE_TRAINER_ENDPOINTS", raw, "a comma-separated list of 'host:port' without empty items")
    endpoints = [format_endpoint(*parse_endpoint("PADDLE_TRAINER_ENDPOINTS", item)) for item in items]
    if len(endpoints) != world_size:
        raise ValueError(
            f"PADDLE_TRAINER_ENDPOINTS={raw!r} lists {len(endpoints)} endpoint(s), but "
            f"PADDLE_TRAINERS_NUM={world_size}: expected one endpoint per trainer."
        )
    repeated = sorted({e for e in endpoints if endpoints.count(e) > 1})
    if repeated:
        _fail("PADDLE_TRAINER_ENDPOINTS", raw, f"distinct endpoints, but {', '.join(repeated)} repeats")
    return endpoints


def _parse_current_endpoint(env: Mapping[str, str], endpoints: list[str], rank: int) -> str:
    raw = _read(env, "PADDLE_CURRENT_ENDPOINT")
    if raw is None:
        return endpoints[rank] if endpoints else ""  # Paddle's value when unset
    current = format_endpoint(*parse_endpoint("PADDLE_CURRENT_ENDPOINT", raw))
    if endpoints and current not in endpoints:
        raise ValueError(
            f"PADDLE_CURRENT_ENDPOINT={raw!r} is not in PADDLE_TRAINER_ENDPOINTS={','.join(endpoints)!r}: "
            "expected this trainer's own endpoint."
        )
    if endpoints and endpoints.index(current) != rank:
        raise ValueError(
            f"PADDLE_CURRENT_ENDPOINT={raw!r} is entry {endpoints.index(current)} of PADDLE_TRAINER_ENDPOINTS, "
            f"but PADDLE_TRAINER_ID={rank}: expected entry {rank} ({endpoints[rank]!r})."
        )
    return current


def _parse_master(env: Mapping[str, str], endpoints: list[str]) -> tuple[str | None, int | None]:
    addr, port = _read(env, "MASTER_ADDR"), _read(env, "MASTER_PORT")
    if addr is not None or port is not None:
        if addr is None:
            raise ValueError(f"MASTER_PORT={port!r} is set but MASTER_ADDR is not: expected both or neither.")
        if port is None:
            raise ValueError(f"MASTER_ADDR={addr!r} is set but MASTER_PORT is not: expected both or neither.")
        if any(c.isspace() for c in addr):
            _fail("MASTER_ADDR", addr, "a host name or IP address")
        return addr.strip("[]"), parse_port("MASTER_PORT", port)
    paddle_master = _read(env, "PADDLE_MASTER")
    if paddle_master is not None:
        return parse_endpoint("PADDLE_MASTER", paddle_master)
    if endpoints:
        return parse_endpoint("PADDLE_TRAINER_ENDPOINTS", endpoints[0])
    return None, None


def _node_layout(
    env: Mapping[str, str], endpoints: list[str], current: str, rank: int, world_size: int
) -> tuple[int, int, int]:
    if endpoints and current:
        hosts = [parse_endpoint("PADDLE_TRAINER_ENDPOINTS", e)[0] for e in endpoints]
        host = parse_endpoint("PADDLE_CURRENT_ENDPOINT", current)[0]
        derived_local_rank = hosts[: endpoints.index(current)].count(host)
        derived_local_size = hosts.count(host)
        node_rank = list(dict.fromkeys(hosts)).index(host)
    else:
        derived_local_rank, derived_local_size, node_rank = rank, world_size, 0
    local_world_size = _parse_int(env, "PADDLE_LOCAL_SIZE", default=derived_local_size, minimum=1)
    local_rank = _parse_int(env, "PADDLE_RANK_IN_NODE", default=derived_local_rank, minimum=0)
    if local_rank >= local_world_size:
        raise ValueError(
            f"PADDLE_RANK_IN_NODE={local_rank} is invalid: expected a node-local rank in [0, {local_world_size}) "
            f"(processes on this node: {local_world_size})."
        )
    return local_rank, local_world_size, node_rank
