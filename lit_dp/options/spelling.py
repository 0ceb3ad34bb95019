"""How a front door's options may be spelt, and which option each spelling means.

A core option has one name (``comm_buffer_size``); an option of a group or of a named hook is
``<owner>.<field>`` in a config (``strategy.trace.dir``) and, as a keyword argument, either
``<owner>_<field>`` (``trace_dir``) or a part of the whole owner (``trace={"dir": ...}``).
Lightning ``DDPStrategy``'s names are keywords too. Errors for an unknown spelling suggest the
one meant.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterator, Mapping
from typing import Any

from lit_dp.options.declare import FRONT_DOORS, Declared, flat_name


class Spellings:
    """How a front door's options may be spelt, and what each spelling means."""

    def __init__(self, declared: list[Declared], scope: str, nested: bool, others: list[Declared] = ()) -> None:
        """``declared``: the options of the front door ``scope``; ``others``: those it does not take,
        whose refusal names what this door does instead, where their declaration says (``instead``)."""
        self.scope, self.nested = scope, nested
        self.instead = {}  # a spelling of an option of another door -> what to do at this one
        for other in others:
            if (instead := other.field.metadata["instead"].get(scope)) is not None:
                for spelling in (other.path, other.keyword, other.field.metadata["lightning"]):
                    if spelling:
                        self.instead[spelling] = instead
        self.declared = {option.path: option for option in declared}
        self.groups: dict[str, list[str]] = {}
        for path in self.declared:
            owner, _, member = path.rpartition(".")
            if owner:
                self.groups.setdefault(owner, []).append(member)
        # Every spelling of a single option: its path, its keyword, Lightning's name.
        self.every_spelling = {path: path for path in self.declared if "." not in path}
        for path, declared in self.declared.items():
            self.every_spelling[flat_name(path)] = path
            if declared.field.metadata["lightning"]:
                self.every_spelling[declared.field.metadata["lightning"]] = path
        self.accepted = {name: path for name, path in self.every_spelling.items() if not nested or name == path}

    def spell(self, path: str) -> str:
        """``path`` as this front door spells it when the user did not write it."""
        return path if self.nested else flat_name(path)

    def resolve(self, key: str, value: Any, prefix: str) -> Iterator[tuple[str, str, Any]]:
        """``(path, name as written, value)`` for each option ``key=value`` gives; raises for an unknown key."""
        if key in self.groups:
            for member, item in self._members_given(key, value, prefix).items():
                name = f"{prefix}{key}.{member}"
                if f"{key}.{member}" in self.instead:
                    raise ValueError(self._refused(f"{key}.{member}", item, prefix))
                if member not in self.groups[key]:
                    close = difflib.get_close_matches(member, self.groups[key], n=1)
                    hint = f" Did you mean {prefix + key + '.' + close[0]!r}?" if close else ""
                    raise ValueError(
                        f"{name}={item!r} is not an option of {FRONT_DOORS[self.scope]}.{hint} Expected one of: "
                        f"{', '.join(f'{key}.{m}' for m in self.groups[key])}."
                    )
                yield f"{key}.{member}", name, item
        elif key in self.accepted:
            yield self.accepted[key], f"{prefix}{key}", value
        elif key in self.instead:
            raise ValueError(self._refused(key, value, prefix))
        else:
            raise ValueError(self._unknown(key, value, prefix))

    def _members_given(self, key: str, value: Any, prefix: str) -> dict[str, Any]:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return {field.name: getattr(value, field.name) for field in dataclasses.fields(value)}
        if isinstance(value, Mapping):
            return dict(value)
        raise ValueError(
            f"{prefix}{key}={value!r} is invalid: expected a mapping of its options "
            f"({', '.join(self.groups[key])}) or their dataclass."
        )

    def _refused(self, key: str, value: Any, prefix: str) -> str:
        """An option of another front door, with what this one does instead."""
        return f"{prefix}{key}={value!r} is not an option of {FRONT_DOORS[self.scope]}: {self.instead[key]}."

    def _unknown(self, key: str, value: Any, prefix: str) -> str:
        if key in self.every_spelling:  # a keyword or Lightning's name, given to a config
            hint = f" Did you mean {prefix + self.every_spelling[key]!r}?"
        else:
            close = difflib.get_close_matches(key, [*self.accepted, *self.groups], n=1)
            hint = f" Did you mean {prefix + close[0]!r}?" if close else ""
        expected = [self.spell(path) for path in self.declared if self.declared[path].hook is None]
        return (
            f"{prefix}{key}={value!r} is not an option of {FRONT_DOORS[self.scope]}.{hint} "
            f"Expected one of: {', '.join(expected)}."
        )
