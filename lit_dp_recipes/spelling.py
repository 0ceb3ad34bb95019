"""The recipes' "did you mean": the names spelt like what was typed, for a one-line refusal."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable
from typing import Any


def did_you_mean(typed: Any, names: Iterable[str], spelt: Callable[[str], str] = str, most: int = 3) -> str:
    """``"did you mean a or b?"``: the names spelt like ``typed``, closest first, each written as
    ``spelt`` writes it (``strategy.a``); ``""`` when none is."""
    close = difflib.get_close_matches(str(typed), list(names), n=most, cutoff=0.6)
    return "did you mean " + " or ".join(map(spelt, close)) + "?" if close else ""
