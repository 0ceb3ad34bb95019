"""Every option combined with every other, derived from the declarations, not from a list.

A *feature* is one option set to a value that turns it on: the declaration's ``examples``, else
its check's (``flag``: the other boolean; ``count``, ``choice``, ``megabytes``: theirs), less the
default. A feature that needs another (a ``requires`` rule, ``lit_dp.options.rules``) comes with
it: ``sharding.overlap=True`` is tried with ``sharding.stage=1``. A new option, or a new named
hook with options of its own, is then combined with every other without a line here.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from lit_dp.options import Declared, Options, declared_options
from lit_dp.options.core import rules


@dataclasses.dataclass(frozen=True)
class Feature:
    """``path=value``, with what it needs (``needs``: path -> value)."""

    path: str
    value: Any
    needs: tuple[tuple[str, Any], ...] = ()

    @property
    def given(self) -> dict[str, Any]:
        return {self.path: self.value, **dict(self.needs)}

    @property
    def paths(self) -> set[str]:
        return set(self.given)

    def __str__(self) -> str:
        return " ".join(f"{path}={value!r}" for path, value in self.given.items())


def examples(declared: Declared) -> tuple[Any, ...]:
    """The values of ``declared`` that turn its feature on (its default left out)."""
    meta = declared.field.metadata
    given = meta["examples"] if meta["examples"] is not None else getattr(meta["check"], "examples", ())
    values = given() if callable(given) else given
    return tuple(value for value in values if value != declared.field.default)


def without_examples(scope: str) -> list[str]:
    """Options of ``scope`` a command line can set that no example turns on: each needs ``examples=``."""
    return [d.path for d in declared_options(scope) if d.field.metadata["config"] is not None and not examples(d)]


def _needed(path: str, scope: str) -> dict[str, Any]:
    """What the option ``path`` needs on (``requires`` rules), each at its first example, transitively."""
    by_path = {d.path: d for d in declared_options(scope)}
    needs: dict[str, Any] = {}
    for rule in rules():
        if rule.needs and rule.options[0] == path and rule.options[1] in by_path:
            needed = rule.options[1]
            default = by_path[needed].field.default
            if default is None or default is False:  # off by default: turned on by its first example
                needs[needed] = examples(by_path[needed])[0]
                needs.update(_needed(needed, scope))
    return needs


def features(scope: str) -> list[Feature]:
    """One feature per example value of every option of ``scope`` (a named hook's with its hook on)."""
    found = []
    for declared in declared_options(scope):
        needs = _needed(declared.path, scope)
        if declared.hook is not None:
            needs = {"comm_hook": declared.hook, **needs}
        found += [Feature(declared.path, value, tuple(needs.items())) for value in examples(declared)]
    return found


def pairs(scope: str) -> list[tuple[Feature, Feature]]:
    """Every two features of different options that do not set one option two ways."""
    found = []
    for first, second in itertools.combinations(features(scope), 2):
        shared = first.paths & second.paths
        if first.path == second.path or any(first.given[p] != second.given[p] for p in shared):
            continue
        found.append((first, second))
    return found


def nested(given: dict[str, Any]) -> dict[str, Any]:
    """``{"sharding.stage": 1}`` as a config spells it: ``{"sharding": {"stage": 1}}``."""
    config: dict[str, Any] = {}
    for path, value in given.items():
        owner, _, member = path.rpartition(".")
        (config.setdefault(owner, {}) if owner else config)[member] = list(value) if isinstance(value, tuple) else value
    return config


def verdict(given: dict[str, Any], scope: str, prefix: str = "strategy.") -> str | None:
    """None where ``Options.build`` takes ``given`` (paths -> values) as a config spells it, else its error."""
    try:
        Options.build(nested(given), scope, prefix, nested=True)
    except ValueError as error:
        return str(error)
    return None
