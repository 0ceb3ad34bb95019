"""``local_sgd.*``: periodic model averaging after a data-parallel warm-up (``lit_dp.LocalSGD``)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from lit_dp.options.declare import TRAINER, count, flag, option
from lit_dp.options.rules import excludes, requires, shown

ONLY_TRAINER = frozenset({TRAINER})
# Hooks (by function or config name) that leave gradients local, which LocalSGD does itself.
COMM_HOOKS_SKIPPING_COMMUNICATION = ("post_localSGD_hook", "noop_hook")


@dataclasses.dataclass(frozen=True)
class LocalSGDOptions:
    """LocalSGD's period and warm-up (off while ``steps`` is None); the Trainer strategy runs it."""

    steps: Optional[int] = option(
        default=None,
        help="average the models every K local steps; None: off",
        check=count(1, optional=True),
        scope=ONLY_TRAINER,
        config=Optional[int],
        lightning="model_averaging_period",
    )
    warmup_steps: int = option(
        default=0,
        help="ordinary data-parallel steps before the local phase",
        check=count(0),
        scope=ONLY_TRAINER,
        config=int,
    )
    adaptive: bool = option(
        default=False,
        help="recompute K from loss and learning rate (Paddle's adaptive_localsgd)",
        check=flag,
        scope=ONLY_TRAINER,
        config=bool,
    )


RULES = (
    requires("local_sgd.adaptive", "local_sgd.steps", "expected the initial period, e.g. 1"),
    requires(
        "local_sgd.warmup_steps", "local_sgd.steps", "expected the period that follows the warm-up, e.g. 4", set_only=True
    ),
    excludes(
        "local_sgd.steps",
        "comm_hook",
        when=lambda o: o.local_sgd.steps is not None and shown(o.comm_hook).strip("'") in COMM_HOOKS_SKIPPING_COMMUNICATION,
        reason="that hook already skips gradient communication, so warm-up steps would not be data-parallel; "
        "expected LocalSGD or that hook, not both",
    ),
)
