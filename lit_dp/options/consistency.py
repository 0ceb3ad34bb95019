"""``consistency.*``: whether the replicas still hold the same weights (``lit_dp.observability.consistency``)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from lit_dp.options.declare import EVERYWHERE, choice, count, flag, option
from lit_dp.options.rules import excludes, requires

# Every 200 synchronised steps: a check reads each parameter once (one integer sum per tensor, on
# its device) and all-gathers 8 bytes per tensor without waiting. Measured on one CPU core, a
# check of the reducer benchmark's models took 0.3 to 3.1 ms, at most 17% of one step's compute
# without synchronisation (the 800 tensors of many_small_norm): every 200 steps keeps it under
# 0.1% of the steps it covers on each of them (docs/observability.md, "Cost").
DEFAULT_CONSISTENCY_STEPS = 200
ACTIONS = ("error", "warn")


@dataclasses.dataclass(frozen=True)
class ConsistencyOptions:
    """How often the replicas compare fingerprints of their state, and what a difference does."""

    every_n_steps: Optional[int] = option(
        default=DEFAULT_CONSISTENCY_STEPS,
        help="every N synchronised steps each rank fingerprints its parameters (bitwise) and synced buffers and "
        "the ranks compare them; None: off",
        check=count(1, optional=True),
        scope=EVERYWHERE,
        config=Optional[int],
    )
    action: str = option(
        default="error",
        help="on a difference, error: every rank stops with an error naming the ranks, the first differing "
        "parameter and the step; warn: log it and go on",
        check=choice(*ACTIONS),
        scope=EVERYWHERE,
        config=str,
    )
    optimizer_state: bool = option(
        default=False,
        help="also compare each parameter's optimizer state (needs every_n_steps; not with sharding, where each "
        "rank holds its own parameters' state only)",
        check=flag,
        scope=EVERYWHERE,
        config=bool,
    )


RULES = (
    requires(
        "consistency.action",
        "consistency.every_n_steps",
        "expected a number of steps, e.g. {consistency.every_n_steps}=100, or no {consistency.action}",
        set_only=True,
    ),
    requires(
        "consistency.optimizer_state",
        "consistency.every_n_steps",
        "expected a number of steps, e.g. {consistency.every_n_steps}=100",
    ),
    excludes(
        "consistency.optimizer_state",
        "sharding.stage",
        reason="under sharding each rank holds the optimizer state of its own parameters only, so the states differ "
        "by design; expected {consistency.optimizer_state}=False (the parameters are still compared)",
    ),
)
