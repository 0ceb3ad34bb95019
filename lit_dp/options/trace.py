"""``trace.*``: a Chrome trace of the communication (``lit_dp.observability.trace``)."""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional

from lit_dp.options.declare import EVERYWHERE, directory, option
from lit_dp.options.rules import requires


def check_steps(name: str, steps: Any) -> tuple[int, int]:
    """The traced steps ``(start, stop)``, ``0 <= start < stop``; raises ``ValueError`` naming ``name``."""
    values = [] if isinstance(steps, (str, bytes)) else list(steps) if hasattr(steps, "__iter__") else []
    valid = (
        len(values) == 2
        and all(isinstance(value, int) and not isinstance(value, bool) for value in values)
        and 0 <= values[0] < values[1]
    )
    if not valid:
        raise ValueError(f"{name}={steps!r} is invalid: expected two integers (start, stop) with 0 <= start < stop.")
    start, stop = values
    return start, stop


@dataclasses.dataclass(frozen=True)
class TraceOptions:
    """Where and which synchronised steps to trace (off while ``dir`` is None)."""

    dir: Optional[str] = option(
        default=None,
        help="write a Chrome trace of the communication there, rank{R}.json per rank",
        check=directory,
        scope=EVERYWHERE,
        config=Optional[str],
        examples=("lit_dp_trace",),
    )
    steps: tuple[int, int] = option(
        default=(1, 4),
        help="the synchronised steps traced: start <= step < stop",
        check=check_steps,
        scope=EVERYWHERE,
        config=List[int],
        examples=((0, 2),),
    )


RULES = (requires("trace.steps", "trace.dir", "expected a folder to write the trace in, e.g. {trace.dir}=traces", set_only=True),)
