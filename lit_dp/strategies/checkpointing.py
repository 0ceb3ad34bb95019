"""How both strategies write and read checkpoints: ``state_dict_type`` and ``async_save`` (docs/checkpoints.md).

Every rank takes part in every save, and no rank gathers another's state:

- ``state_dict_type="full"`` (the default): one file, what every Lightning tool reads. Rank 0 writes
  its checkpoint; what only another rank holds (``RankEntries``: its ZeRO shard, its LocalSGD model
  between syncs) that rank streams to rank 0, one tensor at a time (``lit_dp.checkpoint.full``). A
  ``CheckpointIO`` of the user's that writes its own way, or a remote path, gets the whole checkpoint
  in memory on rank 0 instead (the cost of a writer lit_dp cannot write for).
- ``state_dict_type="sharded"``: a folder in Lightning's sharded layout, every rank writing its part
  with ``torch.distributed.checkpoint`` (``lit_dp.checkpoint.sharded``): the Trainer's model as
  ``model``, its optimizers as ``optimizer_0``, ... (Lightning's names, so that its
  ``consolidate_checkpoint`` reads it), the features' state as ``lit_dp``, the rest (loops,
  callbacks, hyper-parameters) in ``meta.pt``; Fabric's entries under the names of ``fabric.save``.
- ``async_save=True``, or Lightning's ``AsyncCheckpointIO`` plugin: the save copies this rank's part
  off the device (``lit_dp.checkpoint.background.stage``) and returns; a thread writes it, on a
  process group of its own, while training goes on. The next save, a load and the run's end wait for
  it and raise its error.

Reading, every rank reads what it needs: the full file is mapped (``AtomicCheckpointIO``), the
folder read entry by entry (its own LocalSGD entry; under sharding the optimizer state of the
parameters this run gives it, after the optimizers are built: ``optimizer_states``). A rank whose
own model and optimizer states the checkpoint holds (LocalSGD between syncs) restores those, and
never reads rank 0's.

Either format resumes at another number of ranks: data parallelism and ZeRO exactly (each rank
reads the state of the parameters it owns now), LocalSGD as ``lit_dp.strategies.local_sgd`` says.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.io import AsyncCheckpointIO

from lit_dp.checkpoint.background import BackgroundSave, stage
from lit_dp.checkpoint.full import assemble, save_full
from lit_dp.checkpoint.sharded import ShardedCheckpoint, is_sharded, save_sharded
from lit_dp.checkpoint.tree import RANKS, only_rank_entries
from lit_dp.options import Options
from lit_dp.sharding import ShardedOptimizer
from lit_dp.strategies.checkpoint_io import is_local, saves_like_torch
from lit_dp.strategies.feature import CHECKPOINT_KEY, Features
from lit_dp.strategies.lightning_private import WrappingCheckpointIO, fabric_optimizer

log = logging.getLogger(__name__)

# The Trainer's checkpoint in a sharded folder, as Lightning's FSDPStrategy names it (lightning.pytorch
# .utilities.consolidate_checkpoint reads these names back).
TRAINER_MODEL = "model"
TRAINER_OPTIMIZER = "optimizer_{}"


@dataclass(frozen=True)
class Layout:
    """Where a front door's checkpoint keeps its tensor entries.

    ``entries(checkpoint)`` splits a checkpoint into what goes through ``torch.distributed.checkpoint``
    (by name) and the rest (``meta.pt``); ``models``: the keys of this rank's model and optimizer states,
    left out on a rank whose own are in the features' entry (LocalSGD between syncs; rank 0's are the
    checkpoint's).
    """

    entries: Callable[[dict[str, Any]], tuple[dict[str, Any], dict[str, Any]]]
    models: tuple[str, ...]


def trainer_layout() -> Layout:
    def entries(checkpoint: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        rest = dict(checkpoint)
        tensors = {}
        if "state_dict" in rest:
            tensors[TRAINER_MODEL] = rest.pop("state_dict")
        for index, state in enumerate(rest.pop("optimizer_states", [])):
            tensors[TRAINER_OPTIMIZER.format(index)] = state
        if CHECKPOINT_KEY in rest:
            tensors[CHECKPOINT_KEY] = rest.pop(CHECKPOINT_KEY)
        return tensors, rest

    return Layout(entries, ("state_dict", "optimizer_states"))


def fabric_layout(names: tuple[str, ...]) -> Layout:
    """``fabric.save``'s state, whose modules and optimizers are ``names``."""

    def entries(checkpoint: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        tensors = {name: checkpoint[name] for name in (*names, CHECKPOINT_KEY) if name in checkpoint}
        return tensors, {name: value for name, value in checkpoint.items() if name not in tensors}

    return Layout(entries, names)


class Checkpointing:
    """A strategy's checkpoints: their format, written in the background or not, and the save in flight."""

    def __init__(self, options: Options, timeout: timedelta) -> None:
        self.state_dict_type = options.state_dict_type
        self._async_save = options.async_save
        self._timeout = timeout  # the process group's: the checkpoints' group takes it too
        self._in_flight = BackgroundSave(exit_timeout=timeout.total_seconds())
        self._group: dist.ProcessGroup | None = None  # the checkpoints' own (Gloo), made at the first save of a job
        self._group_of: object | None = None  # the default group it was made in

    def __getstate__(self) -> dict[str, Any]:
        # A spawning launcher pickles the strategy into each rank: the checkpoints' group is each process's own.
        return {**self.__dict__, "_group": None, "_group_of": None}

    def asynchronous(self, io: Any) -> bool:
        """``async_save``, or Lightning's convention for it: an ``AsyncCheckpointIO`` plugin."""
        return self._async_save or isinstance(io, AsyncCheckpointIO)

    def save(
        self, features: Features, io: Any, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any, layout: Layout
    ) -> None:
        """Every rank: this rank's ``checkpoint`` into the job's checkpoint at ``path``, now or in the background."""
        self.wait()
        rank = dist.get_rank() if dist.is_initialized() else 0
        if features.replicas_differ and rank != 0:
            checkpoint = {key: value for key, value in checkpoint.items() if key not in layout.models}
        writer = _writer(io)
        ours = saves_like_torch(writer) and storage_options is None and is_local(path)
        group = self._checkpoint_group()
        target = Path(path)
        if self.state_dict_type == "sharded":
            if not ours:
                self.check_writer(io)
                raise ValueError(
                    f"state_dict_type='sharded' writes a local folder with torch.distributed.checkpoint: the path {path} "
                    f"(storage_options={storage_options!r}) is not one; expected a local path, or state_dict_type='full'."
                )
            tensors, rest = layout.entries(checkpoint)
            job: Callable[[Any], None] = lambda parts: save_sharded(parts[0], parts[1] if rank == 0 else None, target, group)
            parts: Any = (tensors, rest)
        elif ours:
            # Rank 0 writes its checkpoint; another rank sends its own entries only, all it needs (to stage).
            job, parts = (lambda whole: save_full(whole, target, group)), checkpoint if rank == 0 else _own_part(checkpoint)
        else:
            job, parts = (lambda whole: _save_assembled(writer, whole, path, storage_options, group)), checkpoint
        if self.asynchronous(io):
            staged = stage(parts)
            log.debug("checkpoint %s: staged off the device, written in the background", path)
            self._in_flight.start(lambda: job(staged), f"saving the checkpoint {path}")
            return
        with features.saving():
            job(parts)

    def check_writer(self, io: Any) -> None:
        """Refuse, as the run is set up, a checkpoint plugin the format cannot write through: a sharded folder is
        lit_dp's to write, so the plugin must save as ``TorchCheckpointIO`` does (Lightning's default, or a wrapper
        of it such as ``AsyncCheckpointIO``)."""
        writer = _writer(io)
        if self.state_dict_type == "sharded" and not saves_like_torch(writer):
            raise ValueError(
                f"state_dict_type='sharded' with the checkpoint plugin {type(writer).__name__}, which writes its own way, "
                "is invalid: the folder is written by every rank through torch.distributed.checkpoint, not by a plugin; "
                "expected Lightning's default plugin (a TorchCheckpointIO, also inside AsyncCheckpointIO), or "
                "state_dict_type='full' with your plugin."
            )

    def remove(self, io: Any, path: str | os.PathLike) -> None:
        """Rank 0: ``io.remove_checkpoint(path)`` (``ModelCheckpoint`` dropping a checkpoint from its top-k) once the
        save in flight, the one that replaces it, is written: a crash before that leaves it."""
        self._in_flight.after(lambda: io.remove_checkpoint(path))

    def wait(self) -> None:
        """Until the save in flight, if any, is written; raises its error."""
        self._in_flight.wait()

    def teardown(self, failed: bool) -> None:
        """The end of a run: the save in flight written (its error raised), unless the run ``failed`` (its other
        ranks may be gone: the write is given the process group's timeout, and its outcome only logged)."""
        if not failed:
            self.wait()
            return
        try:
            self._in_flight.wait(timeout=self._timeout.total_seconds())
        except BaseException as error:  # noqa: BLE001 - the run's own failure is the one raised
            log.warning("lit_dp: the checkpoint save in flight failed as the run failed: %s", error)

    def _checkpoint_group(self) -> dist.ProcessGroup | None:
        """The process group checkpoints travel on: Gloo (bytes in CPU memory), its own so that a background save's
        collectives never meet training's; None for one process."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        world = dist.group.WORLD
        if self._group is None or self._group_of is not world:  # a new job's default group (a restart in process)
            self._group = dist.new_group(backend="gloo", timeout=self._timeout)
            self._group_of = world
        return self._group

    # --- reading ----------------------------------------------------------------------------------

    def load_trainer(self, features: Features, path: str | os.PathLike, read_file: Callable[[], dict[str, Any]], weights_only: bool | None) -> dict[str, Any]:
        """The Trainer's checkpoint at ``path`` as Lightning restores it, the features given their entries: this
        rank's own model and optimizer states where the checkpoint holds them; under a sharded folder, the
        optimizer states read once the optimizers exist (``optimizer_states``)."""
        self.wait()
        if not is_sharded(path):
            checkpoint = read_file()
            entry = checkpoint.get(CHECKPOINT_KEY, {})
            features.load_state_dict(entry)
            if (own := features.own_replica(entry)) is not None:
                checkpoint["state_dict"], checkpoint["optimizer_states"] = own["model"], own["optimizers"]
            return checkpoint
        folder = ShardedCheckpoint(path)
        checkpoint = folder.meta(weights_only)
        entry = _own_entry(folder)
        features.load_state_dict(entry)
        checkpoint[CHECKPOINT_KEY] = entry
        own = features.own_replica(entry)
        checkpoint["state_dict"] = own["model"] if own is not None else (folder.read_under((TRAINER_MODEL,)) or {})
        count = len([name for name in folder.names() if name.startswith(TRAINER_OPTIMIZER.format(""))])
        if count:
            checkpoint["optimizer_states"] = own["optimizers"] if own is not None else OptimizerStates(folder, count)
        return checkpoint

    def load_fabric(
        self, features: Features, path: str | os.PathLike, state: dict[str, Any], strict: bool, weights_only: bool | None,
        load_module: Callable[[Any, dict[str, Any], bool], None],
    ) -> dict[str, Any]:
        """``fabric.load(path, state)`` of a sharded folder: each module and optimizer of ``state`` restored from its
        entry (an optimizer under sharding: the state of this rank's parameters only), the features from theirs,
        the rest returned (``fabric.load``'s contract)."""
        self.wait()
        folder = ShardedCheckpoint(path)
        rest = folder.meta(weights_only)
        saved = folder.names() | set(rest)
        missing = [name for name in state if name not in saved]
        if strict and missing:
            raise KeyError(
                f"The requested state contains a key '{missing[0]}' that does not exist in the loaded checkpoint. To "
                "disable strict loading, set `strict=False`."
            )
        entry = _own_entry(folder)
        # This rank's own model and optimizers (LocalSGD between syncs) come with the features' entry: rank 0's,
        # which they replace, are not read.
        own = features.own_replica(entry) is not None
        for name, obj in list(state.items()):
            if name in folder.names() and isinstance(obj, torch.nn.Module):
                if not own:
                    load_module(obj, folder.read_under((name,)) or {}, strict)
            elif name in folder.names() and isinstance(obj, torch.optim.Optimizer):
                optimizer = fabric_optimizer(obj)
                needs = optimizer.needs if isinstance(optimizer, ShardedOptimizer) else None
                if not own:
                    optimizer.load_state_dict(folder.optimizer_state(name, needs))
            elif name in rest:
                value = rest.pop(name)
                if hasattr(obj, "load_state_dict") and hasattr(obj, "state_dict"):
                    obj.load_state_dict(value)
                else:
                    state[name] = value
        features.load_state_dict(entry)
        return rest

    def read_fabric_whole(self, path: str | os.PathLike, weights_only: bool | None) -> dict[str, Any]:
        """``fabric.load(path)`` of a sharded folder, with no state to restore: every entry, in memory."""
        self.wait()
        folder = ShardedCheckpoint(path)
        return {**folder.meta(weights_only), **folder.read(lambda path: True)}


class OptimizerStates(list):
    """A sharded folder's optimizer states, read once the optimizers exist (``read``): under sharding each rank
    reads the state of the parameters it owns in this run. Until then a list of names."""

    def __init__(self, folder: ShardedCheckpoint, count: int) -> None:
        super().__init__(TRAINER_OPTIMIZER.format(index) for index in range(count))
        self._folder = folder

    def read(self, optimizers: list[Any]) -> list[dict[str, Any]]:
        states = []
        for name, optimizer in zip(self, optimizers):
            needs = optimizer.needs if isinstance(optimizer, ShardedOptimizer) else None
            states.append(self._folder.optimizer_state(name, needs))
        return states


def optimizer_states(saved: Any, optimizers: list[Any]) -> list[Any]:
    """What Lightning's ``optimizer_states`` entry holds, read where a sharded folder deferred it."""
    return saved.read(optimizers) if isinstance(saved, OptimizerStates) else list(saved)


def _own_entry(folder: ShardedCheckpoint) -> dict[str, Any]:
    """The features' entry of a sharded folder with, of each feature's per-rank entries (``RANKS``), this rank's only."""
    rank = str(dist.get_rank() if dist.is_initialized() else 0)

    def wanted(path: tuple) -> bool:
        if path[:1] != (CHECKPOINT_KEY,):
            return False
        for index, key in enumerate(path[:-1]):
            if key == RANKS and index > 1 and str(path[index + 1]) != rank:
                return False
        return True

    return folder.read(wanted).get(CHECKPOINT_KEY, {})


def _own_part(checkpoint: dict[str, Any]) -> dict[str, Any]:
    return only_rank_entries(checkpoint) or {}


def _writer(io: Any) -> Any:
    """The plugin that writes: the base of a wrapping one (``AsyncCheckpointIO``)."""
    return io.checkpoint_io if isinstance(io, WrappingCheckpointIO) else io


def _save_assembled(io: Any, checkpoint: dict[str, Any], path: Any, storage_options: Any, group: Any) -> None:
    """A writer of the user's: the whole checkpoint in memory on rank 0, handed to it."""
    whole = assemble(checkpoint, group)
    if whole is not None:
        io.save_checkpoint(whole, path, storage_options=storage_options)
