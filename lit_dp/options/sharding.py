"""``sharding.*``: each rank keeps the optimizer state (stage 1) and gradients (stage 2) of its own parameters."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from lit_dp.options.declare import EVERYWHERE, flag, option
from lit_dp.options.rules import excludes, requires


def check_stage(name: str, value: Any) -> int | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value in (0, 1, 2)):
        return value or None  # 0 is "off", as None
    raise ValueError(f"{name}={value!r} is invalid: expected 1 (optimizer states), 2 (also gradients), 0 or None (off).")


@dataclasses.dataclass(frozen=True)
class ShardingOptions:
    """The sharding stage (off while ``stage`` is None) and whether parameter gathers overlap the forward."""

    stage: Optional[int] = option(
        default=None,
        help="1: each rank keeps the optimizer state of its own parameters; 2: also only their gradients; None: off",
        check=check_stage,
        scope=EVERYWHERE,
        config=Optional[int],
        examples=(1, 2),
    )
    overlap: bool = option(
        default=False,
        help="gather updated parameters during the next forward (each module waits for its own)",
        check=flag,
        scope=EVERYWHERE,
        config=bool,
    )


_STAGE_2_WITH_A_HOOK = (
    "a communication hook reduces whole buckets for every rank, stage 2 reduces each gradient to its owner only; "
    "expected {sharding.stage}=1 with a hook, or no hook"
)
RULES = (
    requires("sharding.overlap", "sharding.stage", "expected {sharding.stage}=1 or 2"),
    excludes(
        "sharding.stage",
        "local_sgd.steps",
        reason="LocalSGD steps every rank's optimizer on its own gradients and averages whole models, while sharding "
        "steps each parameter on one rank only; expected one of them",
    ),
    excludes(
        "sharding.stage",
        "comm_hook",
        when=lambda o: o.sharding.stage == 2 and o.comm_hook is not None,
        reason=_STAGE_2_WITH_A_HOOK,
    ),
    excludes(
        "sharding.stage",
        "comm_dtype",
        when=lambda o: o.sharding.stage == 2 and o.comm_dtype is not None,
        reason=_STAGE_2_WITH_A_HOOK,
    ),
)
