"""``lit_dp.fabric.PaddleDPStrategy``: ``Fabric(strategy="paddle_dp")`` for hand-written loops.

The Fabric twin of ``lit_dp.PaddleDPStrategy``, as Lightning has a ``DDPStrategy`` in
``lightning.fabric.strategies`` next to the Trainer's: same options, same registered names, the
same ``lit_dp.DataParallel``. ``fabric.setup(model, optimizer)`` wraps the model,
``fabric.backward`` synchronises, ``fabric.no_backward_sync(model)`` is ``DataParallel.no_sync``,
and checkpoints hold the bare module's state (no wrapper prefix) and the features' state under
``"lit_dp"``. With ``sharding_stage`` the optimizers set up with the model become
``lit_dp.ShardedOptimizer`` s, ``fabric.clip_gradients`` clips by the global norm, and each
owner writes its part of the optimizer state in ``fabric.save`` (``state_dict_type``: one file, or a
folder of every rank's part, ``lit_dp.strategies.checkpointing``). LocalSGD (``local_sgd_*``) steps after
each ``optimizer.step()`` Fabric wraps.
Ranks with different numbers of batches train inside ``with fabric.strategy.join(model):``
(torch's ``Join``, see ``lit_dp.join``).
"""

from __future__ import annotations

import atexit
import logging
import weakref
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import Any

import torch
from lightning.fabric.strategies import STRATEGY_REGISTRY, ParallelStrategy
from lightning.fabric.utilities.distributed import ReduceOp
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lit_dp.checkpoint.sharded import is_sharded
from lit_dp.data_parallel import DataParallel
from lit_dp.job.orphans import binding_started_ranks
from lit_dp.options import FABRIC
from lit_dp.options.docs import options_doc
from lit_dp.sharding import ShardedOptimizer
from lit_dp.strategies import process_group
from lit_dp.strategies.base import DataParallelStrategyMixin, front_door
from lit_dp.strategies.checkpointing import fabric_layout
from lit_dp.strategies.feature import CHECKPOINT_KEY, Features, Run
from lit_dp.strategies.lightning_private import (
    BackwardSyncControl,
    FabricMultiProcessingLauncher,
    FabricScriptLauncher,
    start_script_ranks,

    fabric_optimizer,
    sync_ddp_if_available,
)
from lit_dp.strategies.precision import unscale_for_clipping

log = logging.getLogger(__name__)


class _BoundFabricScriptLauncher(FabricScriptLauncher):
    """Fabric's script launcher, whose ranks end with it whatever ends it (``lit_dp.job.orphans``)."""

    @override
    def _call_children_scripts(self) -> None:
        with binding_started_ranks():
            start_script_ranks(self, FabricScriptLauncher)


@front_door
class PaddleDPStrategy(DataParallelStrategyMixin, ParallelStrategy):
    """Data parallelism with lit_dp's bucketed reducer in Fabric, one process per device.

    The first five arguments are Lightning's, set by Fabric. The options (``lit_dp.options``)
    are keyword arguments (Lightning ``DDPStrategy``'s names accepted for ours), or one
    ``options=Options.build(...)`` already validated:
{options}

    Read the statistics with ``module.comm_stats()``. LocalSGD (``local_sgd_*``) steps after each
    ``optimizer.step()``; ``fabric.save`` keeps the features' state under ``"lit_dp"`` and
    ``fabric.load`` restores it. One device gets a process group of one rank and a wrapped model,
    as under Fabric's ``"ddp"``.
    """

    _launchers = (_BoundFabricScriptLauncher, FabricMultiProcessingLauncher)
    _options_scope = FABRIC
    _precision_argument = "precision"

    def __init__(self, *args: Any, **values: Any) -> None:
        super().__init__(*args, **values)
        self._backward_sync_control = _PaddleDPBackwardSyncControl()  # what fabric.no_backward_sync(model) asks
        self._features_run = _FeaturesRun(self._features)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._checkpointing.check_writer(self.checkpoint_io)
        self._features.setup_environment(self)
        process_group.start_process_group(self)

    @override
    def setup_module(self, module: Module) -> DataParallel:
        wrapped = self._wrapping.wrap(module, Run(self, None), self._features, self._options)
        self._features_run.start(Run(self, wrapped, features=self._features))
        return wrapped

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        log.debug("%s: setting up %s", type(self).__name__, type(optimizer).__name__)
        return self._features.setup_optimizer(optimizer)

    @override
    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        unscale_for_clipping(self.precision, optimizer)
        if isinstance(optimizer, ShardedOptimizer):  # the norm over every rank's gradients
            return optimizer.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)
        parameters = self.precision.main_params(optimizer)
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite)

    @override
    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: float | int) -> None:
        unscale_for_clipping(self.precision, optimizer)
        torch.nn.utils.clip_grad_value_(self.precision.main_params(optimizer), clip_val)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        step = partial(super().optimizer_step, optimizer, **kwargs)
        return self._features.optimizer_step(lambda closure: step(), optimizer, None)  # Fabric's step takes no closure

    @override
    def module_to_device(self, module: Module) -> None:
        module.to(self.root_device)

    @override
    def all_reduce(
        self, tensor: Tensor, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor:
        if isinstance(tensor, Tensor):
            with self._features.collective("all_reduce"):
                return sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        # A sharded optimizer's part, as each owner writes it: no rank gathers the others' (lit_dp.checkpoint).
        inner = fabric_optimizer(optimizer)
        if isinstance(inner, ShardedOptimizer):
            return inner.shard_state_dict()
        return super().get_optimizer_state(optimizer)

    @override
    def save_checkpoint(
        self, path: Any, state: dict[str, Any], storage_options: Any | None = None, filter: Any | None = None
    ) -> None:
        """``fabric.save``: ``state`` as Fabric converts it, with the features' state under ``"lit_dp"`` (as in a
        Trainer checkpoint), in the format of ``state_dict_type``, now or in the background (``async_save``):
        ``lit_dp.strategies.checkpointing``. Every rank calls it and writes or sends its own part."""
        if CHECKPOINT_KEY in state:
            raise ValueError(
                f"fabric.save(path, state) with a key {CHECKPOINT_KEY!r} in state is invalid: the strategy writes its "
                f"features' state under that key; expected your own entries under other keys."
            )
        converted = self._convert_stateful_objects_in_state(state, filter=filter or {})
        if own := self._features.state_dict():
            converted[CHECKPOINT_KEY] = own
        names = tuple(name for name, obj in state.items() if isinstance(obj, (Module, Optimizer)))
        self._checkpointing.save(self._features, self.checkpoint_io, converted, path, storage_options, fabric_layout(names))

    @override
    def load_checkpoint(
        self,
        path: Any,
        state: Module | Optimizer | dict[str, Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """``fabric.load``: the objects in ``state`` restored as Fabric does, then the features' state from
        the checkpoint's ``"lit_dp"`` entry (after the model and optimizer, so that what a feature keeps per
        rank wins over rank 0's copy), before the next step; the entry is not among what is returned. A
        sharded folder is read entry by entry: each rank reads the entries of ``state`` (of an optimizer
        under sharding, the state of this rank's parameters) and its own part of the features' entry.

        ``state`` None or empty asks for the raw checkpoint, which Fabric returns whole and restores
        nothing from: the features are left as they are too.
        """
        if is_sharded(path):
            if not state:
                return self._checkpointing.read_fabric_whole(path, weights_only)
            if not isinstance(state, dict):
                raise ValueError(
                    f"fabric.load({path!r}, {type(state).__name__}) of a sharded checkpoint is invalid: its entries are "
                    "named; expected fabric.load(path, {name: object, ...}) with the names fabric.save was given."
                )
            return self._checkpointing.load_fabric(self._features, path, state, strict, weights_only, self.load_module_state_dict)
        self._checkpointing.wait()
        remainder = super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        if isinstance(state, dict) and state:
            self._features.load_state_dict(remainder.pop(CHECKPOINT_KEY, {}))
        return remainder

    @override
    def get_module_state_dict(self, module: Module) -> dict[str, Any]:
        self.wait_for_parameters()  # with sharding_overlap the last gather may be in flight
        if isinstance(module, DataParallel):
            module = module.module
        return super().get_module_state_dict(module)

    @override
    def load_module_state_dict(self, module: Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        if isinstance(module, DataParallel):
            module = module.module
        super().load_module_state_dict(module=module, state_dict=state_dict, strict=strict)

    @override
    def teardown(self) -> None:
        """``fabric.strategy.teardown()``, on every rank at the end of the loop: the run's end for the
        features (``on_train_end``: LocalSGD's last average), then their teardown. Fabric never calls it
        itself; at exit only the teardown runs (no collective: the other ranks may be gone)."""
        log.debug("%s: tearing down strategy", type(self).__name__)
        self._checkpointing.teardown(failed=False)  # a save in flight: written before the run ends
        self._features_run.end()
        super().teardown()
        process_group.leave_process_group(self)


class _FeaturesRun:
    """The features' run under Fabric: from the first model set up to ``fabric.strategy.teardown()``, or to
    the process's exit, since Fabric never tears its strategy down itself."""

    def __init__(self, features: Features) -> None:
        self._features = features
        self._running = False  # set up since the last end

    def start(self, run: Run) -> None:
        """A model set up: the features' ``setup`` (at each model), and their end registered for exit once a run."""
        if not self._running:
            # The features' teardown (the trace's last write, the watchdog thread's end) runs at exit too,
            # unless the user's teardown came first.
            atexit.register(_end_at_exit, weakref.ref(self))
        self._running = True
        self._features.setup(run)

    def end(self) -> None:
        """``fabric.strategy.teardown()``, on every rank: the run's end for the features (``on_train_end``:
        LocalSGD's last average), then their teardown."""
        if self._running:
            self._features.on_train_end()
        self.release()

    def release(self) -> None:
        """The features' teardown only (at exit: no collective, the other ranks may be gone)."""
        if self._running:
            self._running = False
            self._features.teardown()


def _end_at_exit(run: weakref.ref[_FeaturesRun]) -> None:
    if (alive := run()) is not None:
        alive.release()


class _PaddleDPBackwardSyncControl(BackwardSyncControl):
    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        """``DataParallel.no_sync``: forward and backward inside accumulate gradients locally."""
        if not enabled:
            return nullcontext()
        if not isinstance(module, DataParallel):
            raise TypeError(
                "Blocking backward sync is only possible if the module passed to"
                f" `{self.__class__.__name__}.no_backward_sync` is wrapped in `lit_dp.DataParallel`."
                f" Got: {module.__class__.__name__}."
            )
        return module.no_sync()


PaddleDPStrategy.__doc__ = PaddleDPStrategy.__doc__.format(options=options_doc(FABRIC))
# `import lit_dp` loads this module once Lightning is imported (see lit_dp/__init__.py).
PaddleDPStrategy.register_strategies(STRATEGY_REGISTRY)
