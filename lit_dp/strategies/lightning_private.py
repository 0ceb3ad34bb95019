"""Every name of Lightning's that is not its public API and that lit_dp uses: here, and only here.

Lightning offers no public way to do a few things the strategies must do: launch ranks with its
own launchers, take over its signal handling at a step boundary, restore a loop counter, add a
metric to what a rank logged, find the module and the optimizer inside Fabric's wrappers. Those touches of its
private names live in this module, so that a Lightning release that moves one breaks here, at
import or at the accessor's first use, with an error naming the installed Lightning and the
name, instead of somewhere in a fit. The recipes (``lit_dp_recipes``) reach Lightning's private
names through here too: their launcher under Hydra, and ``DDPStrategy``'s arguments for the
``ddp`` peer's line. ``tests/strategies/test_lightning_private.py`` checks each against the
installed Lightning, and checks that no other module of lit_dp or of the recipes imports or
reads a private Lightning name.

Three kinds of use:

- Classes and functions Lightning keeps private, looked up by ``_lightnings`` (which records them
  in ``LOOKED_UP``) and given a public name here.
- Private attributes of Lightning's objects, read or replaced by the functions below. A
  replacement first reads the attribute: setting one Lightning no longer has would be silently
  ignored.
- Private members of the Lightning classes lit_dp's classes derive from (``SUBCLASSED``), which a
  subclass must use: Lightning's strategies keep their launcher and checkpoint plugin there, and
  its signal connector its handlers. ``DDP_STRATEGY_NAMES`` are the private names of Lightning's
  ``DDPStrategy`` that lit_dp's strategies define too, for code written against ``"ddp"``.
"""

from __future__ import annotations

import dataclasses
import importlib
import threading
from collections.abc import Callable
from typing import Any

import lightning
import torch
from lightning.fabric.strategies import ParallelStrategy as FabricParallelStrategy
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.strategies import DDPStrategy, ParallelStrategy

LOOKED_UP: list[tuple[str, str]] = []  # (module, name) of every private class or function below


def moved(name: str) -> str:
    """The message for a private name this Lightning does not have."""
    return (
        f"Lightning {lightning.__version__} has no {name}, a private name lit_dp uses "
        "(lit_dp/strategies/lightning_private.py): install a Lightning version the README lists as tested, "
        "or update that module."
    )


def _lightnings(module: str, name: str) -> Any:
    """Lightning's private ``module.name``; an ``ImportError`` naming this Lightning if it moved."""
    LOOKED_UP.append((module, name))
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise ImportError(moved(f"{module}.{name}")) from error


def _read(owner: object, name: str) -> Any:
    try:
        return getattr(owner, name)
    except AttributeError as error:
        raise AttributeError(moved(f"{type(owner).__qualname__}.{name}")) from error


def _replace(owner: object, name: str, value: Any) -> None:
    _read(owner, name)
    setattr(owner, name, value)


# --- Classes and functions ---------------------------------------------------------------------
# The launchers the strategies start ranks with, as Lightning's DDP strategies do.
TrainerScriptLauncher = _lightnings("lightning.pytorch.strategies.launchers", "_SubprocessScriptLauncher")
TrainerMultiProcessingLauncher = _lightnings("lightning.pytorch.strategies.launchers", "_MultiProcessingLauncher")
FabricScriptLauncher = _lightnings("lightning.fabric.strategies.launchers", "_SubprocessScriptLauncher")
FabricMultiProcessingLauncher = _lightnings("lightning.fabric.strategies.launchers", "_MultiProcessingLauncher")
# The type of the strategy registries `register_strategies` receives.
StrategyRegistryType = _lightnings("lightning.fabric.strategies.registry", "_StrategyRegistry")
# What Fabric's `no_backward_sync` asks of a strategy.
BackwardSyncControl = _lightnings("lightning.fabric.strategies.strategy", "_BackwardSyncControl")
# The reduction Lightning's own strategies give `self.log(..., sync_dist=True)` and `fabric.all_reduce`.
sync_ddp_if_available = _lightnings("lightning.fabric.utilities.distributed", "_sync_ddp_if_available")
# Optimizer state onto the rank's device once the optimizers are set up, as DDPStrategy does.
optimizers_to_device = _lightnings("lightning.fabric.utilities.optimizer", "_optimizers_to_device")
# `AsyncCheckpointIO()` and the like, given without the plugin they wrap.
WrappingCheckpointIO = _lightnings("lightning.pytorch.plugins.io.wrapper", "_WrappingCheckpointIO")
# The Trainer's signal handling, which lit_dp's preemption handling subclasses.
SignalConnector = _lightnings("lightning.pytorch.trainer.connectors.signal_connector", "_SignalConnector")
# The loop and the helpers a resumed epoch needs: the sampler's epoch, the batches an epoch takes.
FitLoop = _lightnings("lightning.pytorch.loops.fit_loop", "_FitLoop")
set_sampler_epoch = _lightnings("lightning.fabric.utilities.data", "_set_sampler_epoch")
parse_num_batches = _lightnings("lightning.pytorch.trainer.connectors.data_connector", "_parse_num_batches")
# Used by the functions below only: Fabric's module wrapper, what `self.log` keeps, the observer
# thread of the script launcher.
_FabricModule = _lightnings("lightning.fabric.wrappers", "_FabricModule")
_FabricOptimizer = _lightnings("lightning.fabric.wrappers", "_FabricOptimizer")
_Metadata = _lightnings("lightning.pytorch.trainer.connectors.logger_connector.result", "_Metadata")
_ResultMetric = _lightnings("lightning.pytorch.trainer.connectors.logger_connector.result", "_ResultMetric")
_Sync = _lightnings("lightning.pytorch.trainer.connectors.logger_connector.result", "_Sync")
_ChildProcessObserver = _lightnings("lightning.fabric.strategies.launchers.subprocess_script", "_ChildProcessObserver")

# --- Members of the Lightning classes lit_dp's classes derive from -------------------------------
SUBCLASSED: dict[type, tuple[str, ...]] = {
    # Lightning calls `_configure_launcher` and reads `_launcher`; `checkpoint_io` and
    # `precision_plugin` are properties over `_checkpoint_io` and `_precision_plugin` (overridden
    # as Lightning's FSDPStrategy overrides them); `_layer_sync` is the Trainer's `sync_batchnorm`;
    # Fabric reads `_backward_sync_control` for `no_backward_sync`.
    ParallelStrategy: (
        "_configure_launcher", "_launcher", "_checkpoint_io", "_precision_plugin", "_layer_sync",
    ),
    # `fabric.save`'s conversion of modules and optimizers to their state (with `filter`), which the
    # strategy calls before writing in its own format.
    FabricParallelStrategy: (
        "_configure_launcher", "_launcher", "_checkpoint_io", "_backward_sync_control",
        "_convert_stateful_objects_in_state",
    ),
    # Its handlers, saved and restored around the run stage, and how it installs one.
    SignalConnector: ("_original_handlers", "_get_current_signal_handlers", "_register_signal"),
    # The recipes' launcher under Hydra (lit_dp_recipes.launch) starts the ranks with its own
    # command line: the launcher's check and its child-starting method, overridden; lit_dp's
    # script launchers (Trainer and Fabric) bind the ranks they start to themselves around it
    # (lit_dp.strategies.preemption.BoundScriptLauncher, lit_dp.strategies.fabric).
    TrainerScriptLauncher: ("_call_children_scripts", "_check_can_spawn_children"),
    FabricScriptLauncher: ("_call_children_scripts",),
    # The recipes' progress bar (lit_dp_recipes.callbacks) refreshes on optimizer steps.
    TQDMProgressBar: ("_should_update",),
    # The recipes' torch DDP peer (lit_dp_recipes.config.DDPPeer) registers the communication hook
    # Lightning was given on every device (Lightning does on CUDA only).
    DDPStrategy: ("_register_ddp_hooks", "_ddp_comm_hook", "_ddp_comm_wrapper", "_ddp_comm_state"),
}
# DDPStrategy's private names that code written against "ddp" reads (Lightning's own tests among
# it), which lit_dp's strategies define with the same meaning.
DDP_STRATEGY_NAMES = ("_ddp_kwargs", "_get_process_group_backend", "_setup_model", "_start_method", "_timeout")


# --- Private attributes of Lightning's objects ---------------------------------------------------
def attached_trainer(module: Any) -> Any:
    """The Trainer ``module`` (a LightningModule) is attached to, or None (``module.trainer`` raises then)."""
    return _read(module, "_trainer")


def forward_module(module: Any) -> Any:
    """The module inside Fabric's wrapper (what the strategy's ``setup_module`` returned); ``module`` itself otherwise."""
    return _read(module, "_forward_module") if isinstance(module, _FabricModule) else module


def start_script_ranks(launcher: Any, launcher_class: type) -> None:
    """``launcher_class``'s own start of ranks 1..N-1 (a script launcher's ``_call_children_scripts``),
    for lit_dp's script launchers, which bind those ranks to this process around it."""
    _read(launcher_class, "_call_children_scripts")(launcher)

def fabric_optimizer(optimizer: Any) -> Any:
    """The optimizer inside Fabric's wrapper (what the strategy's ``setup_optimizer`` returned); ``optimizer`` itself
    otherwise. Fabric's wrapper takes its optimizer's class as a base, so it passes that class's isinstance tests."""
    return optimizer.optimizer if isinstance(optimizer, _FabricOptimizer) else optimizer


def replace_launcher(strategy: Any, launcher: Any) -> None:
    """A strategy's launcher (``_launcher``, set by ``_configure_launcher``), replaced before the run uses it."""
    _replace(strategy, "_launcher", launcher)


def ddp_kwargs(strategy: Any) -> dict[str, Any]:
    """The ``DistributedDataParallel`` arguments a Lightning ``DDPStrategy`` was given (``bucket_cap_mb``, ...)."""
    return _read(strategy, "_ddp_kwargs")


def ddp_comm_hook(strategy: Any) -> Any:
    """The communication hook a Lightning ``DDPStrategy`` was given (``ddp_comm_hook``), or None."""
    return _read(strategy, "_ddp_comm_hook")


def signal_connector(trainer: Any) -> Any:
    """The Trainer's signal connector (a ``SignalConnector``): the one place Lightning reads it."""
    return _read(trainer, "_signal_connector")


def replace_signal_connector(trainer: Any, connector: Any) -> None:
    _replace(trainer, "_signal_connector", connector)


def replace_saved_signal_handlers(trainer: Any, replace: Callable[[int, Any], Any]) -> None:
    """What the Trainer's signal connector puts back at its teardown (``_original_handlers``, saved as
    the run stage began; empty once it has put them back): each ``handler`` of ``signum`` becomes
    ``replace(signum, handler)``."""
    connector = signal_connector(trainer)
    saved = _read(connector, "_original_handlers")
    _replace(connector, "_original_handlers", {signum: replace(signum, handler) for signum, handler in saved.items()})


def skip_sigterm_broadcast(epoch_loop: Any) -> None:
    """Before every training batch Lightning's loop broadcasts rank 0's SIGTERM flag: a blocking
    collective, and on CUDA a host synchronisation, on every step. Its signal connector sets that
    flag; lit_dp's preemption replaces the connector during a fit and never sets it, so the
    broadcast could only carry zeros: this loop skips it until ``restore_sigterm_broadcast``."""
    _replace(epoch_loop, "_broadcast_sigterm_tensor", _nothing)


def restore_sigterm_broadcast(epoch_loop: Any) -> None:
    vars(epoch_loop).pop("_broadcast_sigterm_tensor", None)


def _nothing() -> None:
    return None


def slurm_requeue(trainer: Any, signum: int) -> str:
    """Lightning's own SLURM handling of ``signum``: ``hpc_ckpt_<n>.ckpt`` in ``default_root_dir``, then
    ``scontrol requeue``. Returns the checkpoint's path."""
    checkpoint = _read(trainer, "_checkpoint_connector").hpc_save_path(trainer.default_root_dir)
    _read(signal_connector(trainer), "_slurm_sigusr_handler_fn")(signum, None)
    return checkpoint


def cluster_environment(trainer: Any) -> Any:
    """The cluster environment the Trainer chose (the strategy's, or the one it detected)."""
    return _read(trainer, "_accelerator_connector").cluster_environment


def batches_that_stepped(epoch_loop: Any) -> int:
    """The training epoch loop's count of batches that took an optimizer step (the loggers' step)."""
    return _read(epoch_loop, "_batches_that_stepped")


def restore_batches_that_stepped(epoch_loop: Any, count: int) -> None:
    _replace(epoch_loop, "_batches_that_stepped", count)


def logged_results(trainer: Any) -> Any:
    """What the running loop logged with ``self.log`` (Lightning's result collection), or None."""
    return _read(trainer, "_results")


def synced_epoch_metrics(results: Any) -> list[tuple[str, dict[str, Any]]]:
    """Each tensor logged with ``sync_dist=True`` and ``on_epoch=True``: its key and the fields of its
    metadata (without the reduction function, which does not travel between processes)."""
    return [
        (key, {f.name: getattr(metric.meta, f.name) for f in dataclasses.fields(_Metadata) if f.name != "_sync"})
        for key, metric in results.valid_items()
        if metric.is_tensor and metric.meta.sync.should and metric.meta.on_epoch
    ]


def add_synced_metric(results: Any, key: str, fields: dict[str, Any], reduce: Callable, device: torch.device) -> None:
    """Add to ``results`` a metric described by ``fields`` (from ``synced_epoch_metrics`` on a rank that
    logged it) with no value of this rank's: its default values add nothing to the reduction, which
    ``reduce`` (the strategy's) takes part in."""
    meta = _Metadata(**fields)
    meta.sync = _Sync(_should=True, fn=reduce)
    metric = _ResultMetric(meta, is_tensor=True).to(device)
    _replace(metric, "_update_count", 1)  # torchmetrics' "updated" mark: its fresh values are meant
    results[key] = metric


def child_process_observers() -> list[threading.Thread]:
    """The running threads of Lightning's script launcher that watch the ranks it started: each
    calls its check after every sleep, ends the job when it sees a failed rank, and stops on True."""
    return [thread for thread in threading.enumerate() if isinstance(thread, _ChildProcessObserver)]


def observed_processes(observer: threading.Thread) -> list[Any]:
    return _read(observer, "_child_processes")


def observer_check(observer: threading.Thread) -> Callable[[], bool]:
    return _read(observer, "_run")


def replace_observer_check(observer: threading.Thread, check: Callable[[], bool]) -> None:
    _replace(observer, "_run", check)
