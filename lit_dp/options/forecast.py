"""``forecast.*``: the end-of-run forecast of what scale would cost (``lit_dp.forecast``), and its units.

``forecast.ranks=[8, 64]`` prints, when training ends, one line per setting (data parallelism at
the run's and the best bucket size, ZeRO, LocalSGD, DiLoCo, ...) with the predicted step time at
each number of ranks, over the run's own link or each of ``forecast.bandwidths``. How a
bandwidth and a latency are written (``10Gbit``, ``1.25GB/s``, ``20us``) is declared here, for
the option's check and for ``python -m lit_dp.forecast``'s flags alike.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, List, Optional

from lit_dp.options.declare import FABRIC, MODULE, TRAINER, option
from lit_dp.options.rules import requires

# Bandwidth units: bits or bytes per second, decimal prefixes (network links are sold in them).
_PREFIXES = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_BANDWIDTH = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgt]?)(bit|b)(?:/s|ps)?\s*$", re.IGNORECASE)
_LATENCY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(ns|us|µs|ms|s)\s*$", re.IGNORECASE)
_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0}
BANDWIDTH_EXAMPLES = "10Gbit, 100Mbit/s, 1.25GB/s"
LATENCY_EXAMPLES = "20us, 0.5ms"


def parse_bandwidth(name: str, value: Any) -> float:
    """Bytes per second from ``10Gbit`` (bits: ``bit``, ``Mbit/s``, ``Gbps``) or ``1.25GB/s`` (bytes:
    an upper-case ``B``); a ``ValueError`` naming ``name`` otherwise."""
    match = _BANDWIDTH.match(value) if isinstance(value, str) else None
    if match is None or not float(match.group(1)) > 0:
        raise ValueError(
            f"{name}={value!r} is invalid: expected a positive bandwidth with its unit, e.g. {BANDWIDTH_EXAMPLES}."
        )
    number, prefix, unit = float(match.group(1)), match.group(2).lower(), match.group(3)
    per_second = number * _PREFIXES[prefix]
    return per_second if unit == "B" else per_second / 8


def parse_latency(name: str, value: Any) -> float:
    """Seconds from ``20us``, ``0.5ms``, ``0s``; a ``ValueError`` naming ``name`` otherwise."""
    match = _LATENCY.match(value) if isinstance(value, str) else None
    if match is None:
        raise ValueError(f"{name}={value!r} is invalid: expected a latency with its unit, e.g. {LATENCY_EXAMPLES}.")
    return float(match.group(1)) * _SECONDS[match.group(2).lower()]


def show_bandwidth(bytes_per_second: float) -> str:
    """``10 Gbit/s``: a bandwidth as the forecast writes it."""
    bits = bytes_per_second * 8
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if bits >= scale:
            return f"{bits / scale:.3g} {prefix}bit/s"
    return f"{bits:.3g} bit/s"


def check_ranks(name: str, value: Any) -> tuple[int, ...] | None:
    """None, or one or more numbers of ranks, each at least 2."""
    if value is None:
        return None
    values = [value] if isinstance(value, int) else list(value) if isinstance(value, (list, tuple)) else None
    if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 2 for v in values):
        raise ValueError(
            f"{name}={value!r} is invalid: expected numbers of ranks to forecast, each at least 2, e.g. [8, 64]."
        )
    return tuple(values)


def check_bandwidths(name: str, value: Any) -> tuple[str, ...] | None:
    """None (the run's own link), or bandwidths with their units."""
    if value is None:
        return None
    values = [value] if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else None
    if not values:
        raise ValueError(
            f"{name}={value!r} is invalid: expected bandwidths with their units, e.g. [10Gbit, 1Gbit], or None."
        )
    for item in values:
        parse_bandwidth(name, item)
    return tuple(values)


# DataParallel has no end of training to print at: a loop of one's own asks the forecast itself.
IN_A_LOOP = (
    "after training, call lit_dp.forecast.predict(model.comm_profile.record(), ranks=[8, 64]) (docs/forecast.md)"
)


@dataclasses.dataclass(frozen=True)
class ForecastOptions:
    """The end-of-run forecast (off while ``ranks`` is None)."""

    ranks: Optional[tuple[int, ...]] = option(
        default=None,
        help="when training ends, print what each setting (bucket size, ZeRO, LocalSGD, DiLoCo, sync dtype) "
        "would cost at these numbers of ranks, predicted from this run's measurements; None: off",
        check=check_ranks,
        scope=frozenset({TRAINER, FABRIC}),
        instead={MODULE: IN_A_LOOP},
        config=Optional[List[int]],
        examples=((8, 64),),
    )
    bandwidths: Optional[tuple[str, ...]] = option(
        default=None,
        help=f"the links to forecast over, e.g. [10Gbit, 1Gbit] ({BANDWIDTH_EXAMPLES}); None: the run's own, "
        "as measured",
        check=check_bandwidths,
        scope=frozenset({TRAINER, FABRIC}),
        instead={MODULE: IN_A_LOOP},
        config=Optional[List[str]],
        examples=(("10Gbit",),),
    )


RULES = (
    requires(
        "forecast.bandwidths",
        "forecast.ranks",
        "expected the numbers of ranks to forecast, e.g. {forecast.ranks}=[8,64]",
        set_only=True,
    ),
)
