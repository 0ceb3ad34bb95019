"""``straggler.*``: which rank is slow, by how much, and why (``lit_dp.observability.straggler``)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from lit_dp.options.declare import EVERYWHERE, count, option

# Every 10 synchronised steps: the exchange is one all-gather of 9 numbers per rank, started
# without waiting and read when the step's buckets are done, so its cost hardly depends on the
# cadence. A shorter window answers sooner (a lag is reported after 3 windows in a row) but is
# noisier: with 5 steps, healthy windows on a loaded machine crossed the thresholds now and then
# (docs/observability.md, "Which rank is slow").
DEFAULT_STRAGGLER_STEPS = 10


@dataclasses.dataclass(frozen=True)
class StragglerOptions:
    """How often the ranks compare their step timings (off while ``every_n_steps`` is None)."""

    every_n_steps: Optional[int] = option(
        default=DEFAULT_STRAGGLER_STEPS,
        help="every N synchronised steps the ranks exchange their timings (data wait, compute, exposed wait, "
        "optimizer step) and name the rank that lags, by how much and why; None: off",
        check=count(1, optional=True),
        scope=EVERYWHERE,
        config=Optional[int],
    )
