"""``sharding.*``: each rank keeps the optimizer state (stage 1) and gradients (stage 2) of its own parameters."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from lit_dp.options.declare import EVERYWHERE, flag, option


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
    )
    overlap: bool = option(
        default=False,
        help="gather updated parameters during the next forward (each module waits for its own)",
        check=flag,
        scope=EVERYWHERE,
        config=bool,
    )
