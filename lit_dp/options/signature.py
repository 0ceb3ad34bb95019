"""The front doors' signatures, generated from the option declarations.

``PaddleDPStrategy`` (Trainer and Fabric) and ``DataParallel`` take the options as keyword
arguments (``**values``) and hand them to ``Options.build``. ``takes_options(scope)`` decorates
such an ``__init__`` so that what inspects it sees each option of that front door as a typed
keyword-only parameter with its default, and its help in the docstring: ``inspect.signature``,
``help()``, editors' completion and jsonargparse (LightningCLI's ``init_args``, ``--print_config``
and ``--trainer.strategy.help``).

A group's option is its keyword spelling (``sharding_stage: Optional[int] = None``), one typed
parameter per option, as ``Options.build`` takes it. The call itself is unchanged: only the
options given reach ``Options.build``, so Lightning's names (``bucket_cap_mb``), a group passed
whole (``sharding={"stage": 1}``) and torch DDP's own arguments are still accepted through
``**values``, which the signature keeps.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable
from typing import Any, TypeVar

from lit_dp.options.comm_hooks import named_hooks
from lit_dp.options.core import Options, declared_options
from lit_dp.options.declare import Declared, is_group
from lit_dp.options.docs import arguments_doc

Init = TypeVar("Init", bound=Callable[..., None])


def option_types() -> dict[str, Any]:
    """The Python type of every option by path, as its dataclass declares it (``Optional[int]``)."""
    owners: dict[str, type] = {"": Options}
    owners.update({field.name: field.metadata["group"] for field in dataclasses.fields(Options) if is_group(field)})
    owners.update({hook.name: hook.options for hook in named_hooks() if hook.options is not None})
    types = {}
    for owner, options in owners.items():
        for name, hint in typing.get_type_hints(options).items():
            types[f"{owner}.{name}" if owner else name] = hint
    return types


def option_parameters(scope: str, taken: frozenset[str] = frozenset()) -> list[inspect.Parameter]:
    """Each option of the front door ``scope`` as a keyword-only parameter (its keyword spelling, its
    type and default), but those whose keyword is in ``taken`` (a parameter the front door has itself)."""
    types = option_types()
    keyword_only = inspect.Parameter.KEYWORD_ONLY
    return [
        inspect.Parameter(declared.keyword, keyword_only, default=declared.field.default, annotation=types[declared.path])
        for declared in _taking(scope, taken)
    ]


def takes_options(scope: str) -> Callable[[Init], Init]:
    """Decorate a front door's ``__init__(self, ..., **values)``: its signature (``__signature__``,
    ``__annotations__``) lists the options of ``scope`` between its own parameters and ``**values``,
    and its docstring gives their help in an ``Args:`` section (what jsonargparse reads)."""

    def decorate(init: Init) -> Init:
        own = inspect.signature(init, eval_str=True)
        parameters = list(own.parameters.values())
        rest = parameters.pop()
        if rest.kind is not inspect.Parameter.VAR_KEYWORD:
            raise TypeError(f"{init.__qualname__} must end with **values for the options to reach Options.build.")
        taken = frozenset(own.parameters)
        parameters += option_parameters(scope, taken)
        # After the options: Lightning's names, a group as a whole, torch DDP's own arguments.
        parameters.append(rest.replace(annotation=Any))
        signature = own.replace(parameters=parameters)
        init.__signature__ = signature  # type: ignore[attr-defined]
        init.__annotations__ = {
            **{p.name: p.annotation for p in parameters if p.annotation is not inspect.Parameter.empty},
            "return": own.return_annotation,
        }
        init.__doc__ = "\n\n".join(
            part for part in (init.__doc__, arguments_doc(_taking(scope, taken))) if part
        )
        return init

    return decorate


def _taking(scope: str, taken: frozenset[str]) -> list[Declared]:
    return [declared for declared in declared_options(scope) if declared.keyword not in taken]
