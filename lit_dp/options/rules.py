"""Which options need or exclude each other: rules declared beside the options they concern.

A feature's module declares, next to its options, the rules they take part in (``RULES``, a
tuple of ``Rule``), and hands them to ``Options`` with its group (``group(ShardingOptions,
rules=RULES)``); a named hook declares its own (``NamedHook.rules``), and ``Options`` the core
options' (``lit_dp.options.core``). ``Options.build`` checks every rule once, where a job
starts (the strategy's constructor, the recipes' config check), before any rank exists. An
error names every option involved, as the user wrote it, with its value, and says what to change.

The tests that combine every option with every other (``tests/options/test_combinations.py``)
read the rules too: a feature that needs another (``requires``) is tried with it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

Name = Callable[[str], str]  # an option's path -> its spelling as the user wrote it
_PLACEHOLDER = re.compile(r"\{([a-z0-9_.]+)\}")


def is_on(options: Any, path: str) -> bool:
    """Whether the option ``path`` turns its feature on: not None (off), not False."""
    value = options.value(path)
    return value is not None and value is not False


def shown(value: Any) -> str:
    """A value as an error shows it: a callable by its name, anything else as ``repr``."""
    if callable(value):
        return repr(getattr(getattr(value, "func", value), "__name__", type(value).__name__))
    return repr(value)


@dataclasses.dataclass(frozen=True)
class Rule:
    """Options that cannot go together as given.

    Attributes:
        options: the options involved, as ``Options`` spells them (``sharding.stage``); the error
            names each with its value (a ``needs`` rule: the first with its value, the second).
        applies: ``applies(options)`` is True where the combination is invalid.
        reason: why, and what to change: ``{path}`` in it becomes that option as the user wrote it.
        needs: the first option needs the second on (``requires``), rather than excluding it.
    """

    options: tuple[str, ...]
    applies: Callable[[Any], bool]
    reason: str
    needs: bool = False

    def check(self, options: Any, name: Name) -> None:
        """Raise a ``ValueError`` naming the options involved if the rule applies to ``options``."""
        if not self.applies(options):
            return
        reason = _PLACEHOLDER.sub(lambda match: name(match.group(1)), self.reason)
        given = [f"{name(path)}={shown(options.value(path))}" for path in self.options]
        if self.needs:
            raise ValueError(f"{given[0]} needs {name(self.options[1])}: {reason}.")
        raise ValueError(f"{' with '.join(given[:2])}{''.join(' and ' + g for g in given[2:])} is invalid: {reason}.")


def requires(option: str, needed: str, expected: str, *, set_only: bool = False) -> Rule:
    """``option``, when on (``set_only``: when given other than its default), needs ``needed`` on
    too, without which it would be ignored; ``expected`` says what to set."""

    def applies(options: Any) -> bool:
        given = options.is_set(option) if set_only else is_on(options, option)
        return given and not is_on(options, needed)

    return Rule((option, needed), applies, expected, needs=True)


def excludes(*options: str, reason: str, when: Callable[[Any], bool] | None = None) -> Rule:
    """``options`` cannot all be on together (or, with ``when``, where ``when(options)`` holds)."""
    applies = when if when is not None else (lambda o: all(is_on(o, path) for path in options))
    return Rule(tuple(options), applies, reason)
