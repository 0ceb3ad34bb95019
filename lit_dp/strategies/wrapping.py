"""How the strategies wrap a model in ``lit_dp.DataParallel``, with torch DDP's own arguments.

Lightning's ``DDPStrategy`` passes the arguments it does not know to ``DistributedDataParallel``
(its ``**kwargs``); lit_dp's strategies take the same and hand those ``lit_dp.DataParallel``
implements to it (``wrapper_arguments``), refusing the ones the strategy decides itself
(``SET_BY_THE_STRATEGY``) and the ones ``DataParallel`` does not take. ``Wrapping`` keeps them for
a strategy and wraps each model with them and with what the features change for the run
(``Feature.wrapper_arguments``: another ``options``, a torchft ``manager``).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel

from lit_dp.data_parallel import DataParallel
from lit_dp.options import Options, declared_options
from lit_dp.options.spelling import Spellings
from lit_dp.strategies.feature import Features, Run

log = logging.getLogger(__name__)

# torch DDP's constructor arguments (without ``self``). Lightning's DDPStrategy passes those it
# is given to DistributedDataParallel (its ``**kwargs``); these strategies take the same.
DDP_ARGUMENTS = tuple(inspect.signature(DistributedDataParallel.__init__).parameters)[1:]
# What the strategy decides itself, as Lightning's does, with what to do instead.
SET_BY_THE_STRATEGY = {
    "module": "the strategy wraps the LightningModule (Trainer) or the module given to fabric.setup (Fabric)",
    "device_ids": "one process per device: each rank's device comes from the Trainer's or Fabric's devices=",
    "output_device": "one process per device: outputs stay on each rank's device, from devices=",
    "process_group": "the strategy creates the process group (init_parallel_env) or adopts an existing one; for "
    "a group of your own, wrap the model in lit_dp.DataParallel(model, group=...) in a loop of your own",
    "device_mesh": "the strategy creates the process group (init_parallel_env) or adopts an existing one; for "
    "a group of your own, wrap the model in lit_dp.DataParallel(model, group=...) in a loop of your own",
}


def wrapper_arguments(values: dict[str, Any], scope: str) -> dict[str, Any]:
    """torch DDP's own arguments among ``values`` (those no lit_dp option of ``scope`` takes), for
    ``lit_dp.DataParallel``, which implements each that it names.

    Raises:
        ValueError: for an argument the strategy sets itself, or one ``DataParallel`` does not take.
    """
    ours = Spellings(declared_options(scope), scope, nested=False)
    taken = inspect.signature(DataParallel.__init__).parameters
    arguments = {}
    for name, value in values.items():
        if name in SET_BY_THE_STRATEGY:
            raise ValueError(f"{name}={value!r}: the strategy sets it itself ({SET_BY_THE_STRATEGY[name]}).")
        if name not in DDP_ARGUMENTS or name in ours.accepted or name in ours.groups:
            continue
        if name not in taken:
            raise ValueError(
                f"{name}={value!r} is an argument of torch's DistributedDataParallel that lit_dp.DataParallel does "
                "not take: docs/strategy.md (\"Moving from ddp\") says what lit_dp does instead."
            )
        arguments[name] = value
    return arguments


class Wrapping:
    """A strategy's way of wrapping a model: torch DDP's arguments it was given that ``DataParallel``
    takes itself (``arguments``), for the options in effect and the features' changes.

    Args:
        owner: the strategy's class name, which the debug log names.
        values: the strategy's keyword arguments (options and torch DDP's).
        scope: the front door whose options the strategy takes (``TRAINER`` or ``FABRIC``).
    """

    def __init__(self, owner: str, values: dict[str, Any], scope: str) -> None:
        self._owner = owner
        self.arguments = wrapper_arguments(values, scope)

    def wrap(self, module: Module, run: Run, features: Features, options: Options) -> DataParallel:
        """``module`` in ``DataParallel`` with ``options`` and the arguments the features give for ``run``
        (with a torchft ``manager`` among them, over its replica groups)."""
        arguments = {**self.arguments, **features.wrapper_arguments(run, {"options": options})}
        options = arguments.pop("options")
        shown = "".join(f", {key}={value!r}" for key, value in arguments.items())
        name = type(module).__name__
        log.debug("%s: wrapping %s in lit_dp.DataParallel with %s%s", self._owner, name, options, shown)
        wrapped = DataParallel(module, options=options, **arguments)
        if wrapped.watchdog is not None:
            log.debug("%s: hang watchdog started (hang_timeout=%ss)", self._owner, options.hang_timeout)
        else:
            log.debug(
                "%s: no hang watchdog (hang_timeout=%s, world size %d)",
                self._owner,
                options.hang_timeout,
                run.strategy.world_size,
            )
        return wrapped
