"""lit_dp's warnings, each one ``[lit_dp] ...`` line, as the rest of what lit_dp prints.

Python prints a warning as ``<file>:<line>: <Category>: <message>`` and then the source line at
that place. For a warning raised in lit_dp or the recipes both are lit_dp's own code, not the
user's (``config.py:375: UserWarning: trainer.devices=3 starts ...``, then ``rank_zero_warn(``).
lit_dp warns with its own categories, ``LitDPWarning`` and the deprecation kinds below, each
a subclass of the standard one (a filter on ``UserWarning`` or ``DeprecationWarning`` still
applies), and ``install()``, run by ``import lit_dp``, puts a formatter in front of
``warnings.formatwarning`` that writes those as ``[lit_dp] <message>``. Where a warning points
at the user's code (a deprecated argument, ``stacklevel`` at the caller), the line ends with
that place, ``(train.py:12)``; every other warning is formatted as before. Lightning formats its
own warnings the same way (``lightning.fabric.utilities.warnings``): whichever of the two is
imported last hands the other's warnings on to it.

This module is the lowest layer's (it imports nothing of lit_dp), so every layer warns through it.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

PREFIX = "[lit_dp] "
# lit_dp's own code: a warning that points here shows no place, a warning that points elsewhere shows it.
_OWN_FOLDERS = tuple(str(Path(__file__).resolve().parents[2] / name) + os.sep for name in ("lit_dp", "lit_dp_recipes"))


class _LitDP:
    """Marks lit_dp's warning categories for the formatter."""


class LitDPWarning(_LitDP, UserWarning):
    """A warning of lit_dp's: something works, but not as the user may expect."""


class LitDPDeprecationWarning(_LitDP, DeprecationWarning):
    """A name of lit_dp's that is going, with its replacement named (hidden outside ``__main__`` by default, as Python's)."""


class LitDPFutureWarning(_LitDP, FutureWarning):
    """An argument that has no effect, as in torch DDP, where DDP also warns (shown by default)."""


def format_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int, line: str | None = None) -> str:
    """``[lit_dp] <message>`` for lit_dp's categories, with ``(file:line)`` when that is the user's code."""
    place = "" if str(Path(filename).resolve()).startswith(_OWN_FOLDERS) else f" ({filename}:{lineno})"
    return f"{PREFIX}{message}{place}\n"


def install() -> None:
    """Format lit_dp's warnings as one line each, chained in front of the current formatter; once."""
    current = warnings.formatwarning
    if getattr(current, "_lit_dp", False):
        return

    def formatwarning(message: Any, category: type[Warning], filename: str, lineno: int, line: str | None = None) -> str:
        if isinstance(category, type) and issubclass(category, _LitDP):
            return format_warning(message, category, filename, lineno, line)
        return current(message, category, filename, lineno, line)

    formatwarning._lit_dp = True  # type: ignore[attr-defined]
    warnings.formatwarning = formatwarning
