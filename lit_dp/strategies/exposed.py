"""What the features expose (``Feature.exposes``): real attributes of each strategy class.

A feature names in ``exposes`` its properties and methods that read as the strategy's own
(``strategy.local_sgd``, ``strategy.comm_buffer_size``, Fabric's ``strategy.join(model)``). As a
strategy class is defined (``lit_dp.strategies.base.front_door``), ``expose`` adds to it each
name of the features its front door serves (``lit_dp.strategies.registry``): a property where the
feature has a property, a method where it has a method, with the feature's docstring and types,
reading the feature the strategy built, else the value ``exposes`` gives while the options leave
the feature off. So ``help()``, ``dir()``, ``hasattr`` on the class and completion see them, and a
name of the other front door's features does not exist (no ``join`` under the Trainer). No
``__getattr__`` forwards the names: it would catch any ``AttributeError`` raised inside a Lightning
property (a cluster environment's typo) and report the property missing, where ``DDPStrategy``
lets the error through as it was.

A strategy class is refused, naming both sides, where an exposed name would shadow or be
shadowed: two features of its front door exposing the same name, or a feature exposing a name
that the class or one of its bases (Lightning's strategy, the shared mixin) already has.
"""

from __future__ import annotations

import dis
import functools
import inspect
import re
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lit_dp.strategies.feature import Feature

# The class attribute that lists what ``expose`` added to a class: each name with its feature.
_EXPOSED = "_exposed"


def expose(cls: type, features: Sequence[type[Feature]]) -> None:
    """Add to ``cls`` what each of ``features`` (those its front door serves) exposes, or raise ``TypeError``
    where a name is taken."""
    owners: dict[str, type[Feature]] = {}
    taken = _taken(cls)
    for kind in features:
        for name, off in kind.exposes.items():
            if name in owners:
                raise TypeError(
                    f"{_named(owners[name])} and {_named(kind)} both expose {name!r}, and both serve "
                    f"{_named(cls)}: a strategy attribute reads one feature; rename it in one of their exposes."
                )
            if (holder := taken.get(name)) is not None:
                raise TypeError(
                    f"{_named(kind)} exposes {name!r}, which {_named(cls)} already has from {_named(holder)}: the "
                    f"feature's attribute would shadow it; rename it in {kind.__qualname__}.exposes."
                )
            setattr(cls, name, _attribute(cls, kind, name, off))
            owners[name] = kind
    setattr(cls, _EXPOSED, owners)


def exposed(cls: type) -> Mapping[str, type[Feature]]:
    """The names ``expose`` added to ``cls`` itself (not to a base), each with the feature class that owns it."""
    return vars(cls).get(_EXPOSED, {})


def _taken(cls: type) -> dict[str, type]:
    """The names ``cls`` and its bases already have, other than as exposed attributes, each with the first class
    of the MRO that defines it or sets it on the instance in its ``__init__``, else that declares it (an annotation,
    as the shared mixin declares Lightning's attributes)."""
    declared: dict[str, type] = {}
    defined: dict[str, type] = {}
    for klass in reversed(cls.__mro__):  # the first class of the MRO written last
        own = vars(klass)
        init = own.get("__init__")
        stores = dis.get_instructions(init) if inspect.isfunction(init) else ()
        set_by_init = {instruction.argval for instruction in stores if instruction.opname == "STORE_ATTR"}
        declared.update((name, klass) for name in own.get("__annotations__", {}))
        defined.update((name, klass) for name in {*own, *set_by_init} - set(exposed(klass)))
    return {**declared, **defined}


def _attribute(cls: type, kind: type[Feature], name: str, off: Any) -> Any:
    """The strategy's attribute ``name``: ``kind``'s property or method of that name, on the feature built."""
    found = inspect.getattr_static(kind, name, None)
    fget = found.fget if isinstance(found, property) else found
    if name.startswith("_") or not inspect.isfunction(fget):
        raise TypeError(
            f"{_named(kind)} exposes {name!r}, which is no public property or method of it: expose a property or a "
            f"method, which the strategy's attribute takes its docstring and types from."
        )
    if not (fget.__doc__ or "").strip() or "return" not in fget.__annotations__:
        raise TypeError(
            f"{_named(kind)} exposes {name!r} without a docstring or a return annotation: the strategy's attribute "
            f"shows both (help(), type checks); add them to {kind.__qualname__}.{name}."
        )
    if isinstance(found, property):
        return property(_reader(cls, kind, name, found.fget, off), doc=found.__doc__)
    if off is not None and not callable(off):
        raise TypeError(
            f"{_named(kind)} exposes the method {name!r} with {off!r} while off: expected a function called in its "
            f"place, or None for a feature that build never leaves off."
        )
    return _caller(cls, kind, name, found, off)


def _reader(cls: type, kind: type[Feature], name: str, fget: Callable[..., Any], off: Any) -> Callable[[Any], Any]:
    def read(self: Any) -> Any:
        feature = self._features.find(kind)
        return off if feature is None else getattr(feature, name)

    _describe(read, cls, name, fget)
    # The feature's type, with None where the value while off is None (``fault_tolerance`` without the option).
    returned = _or_none(fget.__annotations__["return"]) if off is None else fget.__annotations__["return"]
    read.__annotations__ = {"return": returned}
    read.__signature__ = inspect.signature(fget).replace(return_annotation=returned)  # type: ignore[attr-defined]
    return read


def _caller(cls: type, kind: type[Feature], name: str, method: Callable[..., Any], off: Any) -> Callable[..., Any]:
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        feature = self._features.find(kind)
        return (off if feature is None else getattr(feature, name))(*args, **kwargs)

    _describe(call, cls, name, method)
    return call


def _describe(function: Callable[..., Any], cls: type, name: str, feature_function: Callable[..., Any]) -> None:
    """The feature's docstring, signature and annotations (through ``__wrapped__``, whose module's names
    ``typing.get_type_hints`` resolves them in), under the strategy's qualified name."""
    functools.update_wrapper(function, feature_function)
    function.__qualname__ = f"{cls.__qualname__}.{name}"


def _or_none(annotation: Any) -> Any:
    if isinstance(annotation, str):
        return annotation if re.search(r"\bNone\b|Optional\[", annotation) else f"{annotation} | None"
    return typing.Optional[annotation]  # an annotation object: a module without postponed annotations


def _named(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
