"""``fault_tolerance`` and ``ft.*``: live fault tolerance on torchft (docs/fault_tolerance.md).

``fault_tolerance="torchft"`` turns it on for the strategies (``lit_dp.strategies.fault_tolerance``);
the group ``ft.*`` says where the replica groups meet and how long a step may wait. Plain PyTorch
passes a torchft ``Manager`` to ``DataParallel(manager=...)`` instead, and its options are held
to the same refusals (``refuse_what_replicas_cannot_follow``): what cannot work across replica
groups that come and go is named here, where every option is checked, never later.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Optional

from lit_dp.options.comm_hooks import named_hooks
from lit_dp.options.declare import STRATEGIES, count, flat_name, option, parse_timeout
from lit_dp.options.rules import requires

TORCHFT = "torchft"
ENGINES = (TORCHFT,)
UNDER_MANAGER = "DataParallel(manager=...)"


def check_engine(name: str, value: Any) -> str | None:
    """The ``fault_tolerance`` option: None (off) or an engine's name (lower-cased)."""
    if value is None:
        return None
    if isinstance(value, str) and value.lower() in ENGINES:
        return value.lower()
    raise ValueError(f"{name}={value!r} is invalid: expected {', '.join(map(repr, ENGINES))} or None (off).")


def _address(name: str, value: Any) -> str | None:
    if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(f"{name}={value!r} is invalid: expected the lighthouse's address, e.g. 'http://host:29510', or None.")
    return value


def _replica_group(name: str, value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool) or not str(value).isdigit():
        raise ValueError(
            f"{name}={value!r} is invalid: expected a number, e.g. 0 (torchft numbers the replica groups by it: "
            "distinct per group, kept across the group's restarts), or None."
        )
    return str(value)


def _positive_seconds(name: str, value: Any) -> float:
    return parse_timeout(name, value).total_seconds()


@dataclasses.dataclass(frozen=True)
class FaultToleranceOptions:
    """Where this replica group meets the others and how long a step waits (used with ``fault_tolerance``)."""

    lighthouse: Optional[str] = option(
        default=None,
        help="the torchft lighthouse's address, e.g. http://host:29510; None: TORCHFT_LIGHTHOUSE",
        check=_address,
        scope=STRATEGIES,
        config=Optional[str],
        examples=("http://localhost:29510",),
    )
    replica_group: Optional[str] = option(
        default=None,
        help="this replica group's number, distinct per group and kept across its restarts; None: REPLICA_GROUP_ID",
        check=_replica_group,
        scope=STRATEGIES,
        config=Optional[str],
        examples=("0",),
    )
    min_replicas: int = option(
        default=1,
        help="replica groups a step needs to commit",
        check=count(1),
        scope=STRATEGIES,
        config=int,
    )
    timeout: float = option(
        default=60.0,
        help="seconds an all-reduce, a commit vote or a recovery may take before the step is discarded "
        "(TORCHFT_TIMEOUT_SEC wins)",
        check=_positive_seconds,
        scope=STRATEGIES,
        config=float,
        examples=(30.0,),
    )
    quorum_timeout: float = option(
        default=60.0,
        help="seconds a step waits for its quorum, e.g. for ft.min_replicas groups to be up "
        "(TORCHFT_QUORUM_TIMEOUT_SEC wins)",
        check=_positive_seconds,
        scope=STRATEGIES,
        config=float,
        examples=(30.0,),
    )


# ft.* tunes the torchft engine: without it each would be ignored.
RULES = tuple(
    requires(
        f"ft.{field.name}",
        "fault_tolerance",
        f"expected {{fault_tolerance}}='{TORCHFT}' with it, or no {{ft.{field.name}}}",
        set_only=True,
    )
    for field in dataclasses.fields(FaultToleranceOptions)
)


def check_fault_tolerance(options: Any, name: Callable[[str], str]) -> None:
    """``fault_tolerance`` with the options it cannot go with (``ft.*`` without it: ``RULES``).

    ``options`` is an ``Options``; ``name(path)`` spells an option as the user wrote it.
    """
    if options.fault_tolerance is not None:
        refuse_what_replicas_cannot_follow(options, f"{name('fault_tolerance')}={options.fault_tolerance!r}", name)


def refuse_what_replicas_cannot_follow(options: Any, where: str, name: Callable[[str], str] = flat_name) -> None:
    """Refuse, naming the option and its value, what cannot work across replica groups that come and go.

    ``where`` says how fault tolerance was asked for (``fault_tolerance='torchft'``,
    ``DataParallel(manager=...)``); ``name(path)`` spells an option (keyword spelling by default).
    """
    hook = options.comm_hook
    # The named hooks that declare themselves stateless: they keep nothing between steps and
    # communicate on the group they are given, so replica groups may come and go under them.
    stateless = [named.name for named in named_hooks() if named.stateless]
    expected = " or ".join(map(repr, stateless))
    compressions = " or ".join(repr(named.name) for named in named_hooks() if named.stateless and named.compress_wrapper)
    refused = [
        (
            "sharding.stage",
            options.sharding.stage is not None,
            "each parameter's optimizer state would live on one replica group, which may be the one that fails; "
            f"expected {name('sharding.stage')}=None",
        ),
        (
            "comm_buffer_size",
            options.comm_buffer_size == "auto",
            "the tuned layout is chosen by timing the first steps, which a replica group that joins later did not "
            "see; expected a number of megabytes",
        ),
        (
            "comm_hook",
            hook is not None and hook not in stateless,
            "a named hook that keeps state between steps (PowerSGD's per-replica memory) leaves a recovering replica "
            f"without it, and a callable hook may communicate on any group; expected {expected} or None",
        ),
        (
            "comm_dtype",
            options.comm_dtype is not None and options.comm_dtype not in stateless,
            f"that compression keeps state between steps; expected {compressions} or None",
        ),
        ("comm_wrapper", options.comm_wrapper is not None, f"expected {name('comm_dtype')}={compressions} instead"),
        (
            "local_sgd.adaptive",
            options.local_sgd.adaptive,
            "the adaptive period is agreed from the ranks' losses at each sync, which the replica groups that come "
            f"and go would not all have seen; expected a fixed {name('local_sgd.steps')}",
        ),
        (
            "local_sgd.sync_delay",
            bool(options.local_sgd.sync_delay),
            "a sync is a transaction of the groups' commit protocol (a quorum, its collectives, a vote), and one "
            "still in flight during the inner steps after it would cross the next transaction's quorum, which may "
            "rebuild torchft's process group under it; expected 0",
        ),
        (
            "uneven_inputs",
            options.uneven_inputs,
            "the replica groups present share out the data at every step, so none runs out before the others; "
            "expected False",
        ),
        (
            "trace.dir",
            options.trace.dir is not None,
            "trace files are named by rank, and a replica group's rank changes with every quorum; expected None",
        ),
        ("nrings", (options.nrings or 1) > 1, "torchft reconfigures one process group across the replica groups"),
    ]
    for path, given, why in refused:
        if given:
            value = options.value(path)
            shown = getattr(value, "__qualname__", None) if callable(value) else None
            raise ValueError(f"{name(path)}={shown or repr(value)} with {where} is not supported: {why}.")
