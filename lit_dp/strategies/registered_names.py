"""A class for each name ``lit_dp.PaddleDPStrategy`` is registered under: ``--trainer.strategy=paddle_dp``
with options after it, in LightningCLI.

Lightning's registry maps a name to a class and that name's arguments (``paddle_dp_spawn``:
``start_method="spawn"``). jsonargparse, which LightningCLI parses with, knows classes only: a
strategy written without a dot is the subclass of ``Strategy`` of that name. So
``--trainer.strategy=paddle_dp`` alone is the registry's, and with options after it
(``--trainer.strategy.comm_buffer_size=5``, or ``init_args:`` in YAML) it is the class ``paddle_dp``
here: a ``PaddleDPStrategy`` whose signature's defaults are the registered name's arguments.
Lightning's own names (``ddp``) have no such classes, and take no options after them.
"""

from __future__ import annotations

import inspect
from typing import Any

from lightning.pytorch.strategies import StrategyRegistry

from lit_dp.strategies.trainer import PaddleDPStrategy


def named_class(name: str, arguments: dict[str, Any]) -> type[PaddleDPStrategy]:
    """``PaddleDPStrategy`` named ``name``, with ``arguments`` as its defaults."""
    signature = inspect.signature(PaddleDPStrategy.__init__)

    def __init__(self: PaddleDPStrategy, *args: Any, **values: Any) -> None:
        PaddleDPStrategy.__init__(self, *args, **{**arguments, **values})

    __init__.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[p.replace(default=arguments.get(p.name, p.default)) for p in signature.parameters.values()]
    )
    __init__.__annotations__ = PaddleDPStrategy.__init__.__annotations__
    __init__.__doc__ = PaddleDPStrategy.__init__.__doc__
    written = ", ".join(f"{key}={value!r}" for key, value in arguments.items())
    doc = f"``Trainer(strategy={name!r})`` as a class: ``lit_dp.PaddleDPStrategy({written})``."
    return type(name, (PaddleDPStrategy,), {"__init__": __init__, "__module__": __name__, "__qualname__": name, "__doc__": doc})


def named_classes() -> dict[str, type[PaddleDPStrategy]]:
    """One class per name the Trainer's registry holds for ``PaddleDPStrategy``."""
    return {
        name: named_class(name, dict(entry["init_params"]))
        for name, entry in StrategyRegistry.items()
        if entry["strategy"] is PaddleDPStrategy
    }


# Module attributes, so that the class path jsonargparse prints (--print_config) imports again.
globals().update(named_classes())
