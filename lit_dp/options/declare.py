"""How an option is declared: one field with its default, help, check, front doors and names.

An option is a field of a frozen dataclass, declared with ``option(...)``. Its metadata says:

- ``help``: one line, shown in errors, docstrings and docs/options.md;
- ``check(name, value)``: returns the value to keep (``5`` becomes ``5.0`` for a size) or
  raises ``ValueError`` naming the option as the user wrote it, the value and what is expected;
- ``scope``: which front doors take it (``trainer``, ``fabric``, ``module`` for ``DataParallel``);
  ``instead``: for a front door outside it, what does the same there (``fabric.strategy.join(model)``
  for ``uneven_inputs``), which that door's refusal of the option names;
- ``config``: its type in the recipes' Hydra schema, or None for Python objects (a hook
  callable, its state) that a command line cannot express;
- ``lightning``: Lightning ``DDPStrategy``'s name for the same option, accepted as an alias so
  that a ``DDPStrategy(...)`` call moves over by renaming the class;
- ``show``: how the start-up line (``describe``) writes it, when not as ``name=value``;
  ``shown_by``: the option whose text in that line already says what this one does;
- ``ddp``: what torch DDP (Lightning's ``DDPStrategy``) has for it, for a side-by-side run with
  DDP: ``in_ddp(keyword, convert)`` (``comm_buffer_size`` is ``bucket_cap_mb``), a function of
  its own (``DDPArguments``), the path of the option whose arguments carry it (``comm_dtype`` goes
  with ``comm_hook``; a named hook's options always do), or None: DDP has nothing like it, and ``lit_dp.ddp_arguments.ddp_strategy_arguments`` refuses it by name rather
  than let DDP ignore it;
- ``examples``: values that turn its feature on, for the tests that combine every option with
  every other (``tests/options/test_combinations.py``); without it they come from ``check`` (``flag``:
  the other boolean; ``choice``, ``count``, ``megabytes``: their ``examples``).

Options of one feature form a group: a frozen dataclass of such fields, composed into
``Options`` with ``group(...)`` and spelt ``<group>.<field>`` (``trace.dir``); Python keyword
arguments may also spell it ``<group>_<field>`` (``trace_dir``), derived, never declared again.
The checks several options share live here too; which options need or exclude each other is
declared with them as well, as rules (``lit_dp.options.rules``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

TRAINER, FABRIC, MODULE = "trainer", "fabric", "module"
STRATEGIES = frozenset({TRAINER, FABRIC})
EVERYWHERE = frozenset({TRAINER, FABRIC, MODULE})
FRONT_DOORS = {
    TRAINER: "lit_dp.PaddleDPStrategy",
    FABRIC: "lit_dp.fabric.PaddleDPStrategy",
    MODULE: "lit_dp.DataParallel",
}

Check = Callable[[str, Any], Any]
# In torch DDP: ``arguments(path, options, name)`` returns the keyword arguments of Lightning's
# ``DDPStrategy`` that stand for the option ``path`` of ``options`` (``{}`` where DDP's default
# does), or raises a ValueError naming it (``name(path)``: as the user wrote it) for a value DDP
# has no counterpart for.
DDPArguments = Callable[[str, Any, Callable[[str], str]], dict]


def option(
    default: Any,
    help: str,
    check: Check,
    *,
    scope: frozenset[str] = STRATEGIES,
    instead: dict[str, str] | None = None,
    config: Any = None,
    lightning: str | None = None,
    show: Callable[[Any, Any], str] | None = None,
    shown_by: str | None = None,
    ddp: DDPArguments | str | None = None,
    examples: tuple[Any, ...] | Callable[[], tuple[Any, ...]] | None = None,
) -> Any:
    """A dataclass field declaring one option (see the module docstring for the metadata).

    ``show(value, options)`` writes the option's part of the start-up line.
    """
    metadata = {
        "help": help,
        "check": check,
        "scope": scope,
        "instead": instead or {},
        "config": config,
        "lightning": lightning,
        "show": show,
        "shown_by": shown_by,
        "ddp": ddp,
        "examples": examples,
    }
    return dataclasses.field(default=default, metadata=metadata)


def in_ddp(keyword: str, convert: Callable[[str, Any], Any] | None = None) -> DDPArguments:
    """The option is DDP's ``keyword`` (Lightning ``DDPStrategy``'s argument), its value converted by
    ``convert(name, value)``, which raises a ValueError naming the option for a value DDP cannot
    take; a value converted to None is left to DDP's default."""

    def arguments(path: str, options: Any, name: Callable[[str], str]) -> dict:
        value = options.value(path)
        value = value if convert is None else convert(name(path), value)
        return {} if value is None else {keyword: value}

    arguments.keyword = keyword  # type: ignore[attr-defined]
    return arguments


def group(options: type, rules: tuple = ()) -> Any:
    """A field of ``Options`` holding the frozen dataclass ``options`` of one feature, with the
    rules its options take part in (``lit_dp.options.rules``)."""
    return dataclasses.field(default_factory=options, metadata={"group": options, "rules": rules})


def is_group(field: dataclasses.Field) -> bool:
    return "group" in field.metadata


def flat_name(path: str) -> str:
    """The keyword-argument spelling of an option: ``trace.dir`` is ``trace_dir``."""
    return path.replace(".", "_")


@dataclasses.dataclass(frozen=True)
class Declared:
    """One option as the generated surfaces see it: its path, its declaration and, for a named
    hook's option, that hook's name."""

    path: str
    field: dataclasses.Field
    hook: str | None = None

    @property
    def keyword(self) -> str:
        """Its spelling as a keyword argument: ``trace_dir`` for ``trace.dir``."""
        return flat_name(self.path)


def show_value(value: Any) -> str:
    """A value as the start-up line writes it: one word, no spaces (``(1, 4)`` is ``1,4``)."""
    if isinstance(value, (tuple, list)):
        return ",".join(map(str, value))
    if isinstance(value, timedelta):
        return f"{value.total_seconds():g}s"
    return str(value)


def flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} is invalid: expected True or False.")
    return value


flag.examples = (True, False)  # type: ignore[attr-defined]  # the one that is not the default


def megabytes(name: str, value: Any) -> float:
    """A positive size in MB (fractions allowed), as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name}={value!r} is invalid: expected a positive number of megabytes.")
    return float(value)


megabytes.examples = (5.0,)  # type: ignore[attr-defined]


def count(low: int, high: int | None = None, optional: bool = False) -> Check:
    """An integer in ``[low, high]`` (``high`` None: no bound); ``optional``: None too."""
    expected = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
    expected += " (or None)" if optional else ""

    def check(name: str, value: Any) -> int | None:
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
            raise ValueError(f"{name}={value!r} is invalid: expected {expected}.")
        return value

    check.examples = (low + 1 if high is None or low + 1 <= high else low,)  # type: ignore[attr-defined]
    return check


def parse_timeout(name: str, timeout: timedelta | float) -> timedelta:
    """A positive duration from a timedelta or a number of seconds, or a ValueError naming ``name``."""
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise ValueError(f"{name}={timeout!r} is invalid: expected a datetime.timedelta or a number of seconds.")
    if not seconds > 0:
        raise ValueError(f"{name}={timeout!r} is invalid: expected a positive duration.")
    return timedelta(seconds=seconds)


def duration(name: str, value: Any) -> float | timedelta | None:
    """None, or a positive duration kept as given (a timedelta or seconds)."""
    if value is not None:
        parse_timeout(name, value)
    return value


def seconds(name: str, value: Any) -> float | None:
    """None, or a positive duration as seconds."""
    return None if value is None else parse_timeout(name, value).total_seconds()


def choice(*allowed: str, optional: bool = False) -> Check:
    """One of ``allowed`` (case-insensitive, kept lower-case); ``optional``: None too."""

    def check(name: str, value: Any) -> str | None:
        if value is None and optional:
            return None
        if not isinstance(value, str) or value.lower() not in allowed:
            raise ValueError(f"{name}={value!r} is invalid: expected one of {', '.join(allowed)}.")
        return value.lower()

    check.examples = allowed  # type: ignore[attr-defined]
    return check


def directory(name: str, value: Any) -> str | None:
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise ValueError(f"{name}={value!r} is invalid: expected a directory path or None.")
    # Checked before any process starts: a folder that cannot be written would fail on every rank.
    for path in () if value is None else (os.path.abspath(value), os.path.dirname(os.path.abspath(value))):
        if os.path.exists(path) and not (os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK)):
            raise ValueError(f"{name}={value!r} is invalid: {path} is not a folder this process can write in.")
    return None if value is None else os.fspath(value)


def anything(name: str, value: Any) -> Any:
    return value
