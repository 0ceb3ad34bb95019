"""The sharded format: a folder that every rank writes its part of, with ``torch.distributed.checkpoint``.

The folder is Lightning's own sharded layout (its ``FSDPStrategy(state_dict_type="sharded")``): the
tensor entries of the checkpoint go through ``torch.distributed.checkpoint`` (``.metadata``, and one
``__<rank>_0.distcp`` file per rank), the rest (Lightning's loops and callbacks' state, the epoch and
step, hyper-parameters) in ``meta.pt``, written by rank 0 with ``torch.save``. Each rank gives
``torch.distributed.checkpoint`` its own tree:

- what is the same on every rank (data parallelism's model and optimizer, LocalSGD's snapshot) is
  written once: the ranks split it, each tensor written by one rank (``torch.distributed.checkpoint``'s
  deduplication, which balances the bytes), the plain values by rank 0 (the others leave them out);
- what each rank holds apart (``RankEntries``: ZeRO's optimizer state by owner, LocalSGD's models
  between syncs) is written by that rank only.

So no rank writes more than its own state, and every rank writes at once. Reading, a rank asks for
the entries it needs (``ShardedCheckpoint.read``), and only those bytes are read.

A folder is written under a temporary name and renamed into place once every rank's part and
``meta.pt`` are on disk (``lit_dp.checkpoint.atomic``): a crash during the write leaves the previous
checkpoint of that name as it was.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lit_dp.checkpoint.atomic import (
    fsync_folder,
    partial_path,
    publish,
    remove_partial,
    write_error,
)
from lit_dp.checkpoint.tree import RANKS, RankEntries, plain
from lit_dp.checkpoint.tree import Path as TreePath

META = "meta.pt"  # Lightning's name for the file of what is not a tensor entry (lightning.fabric.utilities.load)
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's index, written last by its coordinator


def is_sharded(path: str | Path) -> bool:
    """Whether ``path`` is a sharded checkpoint's folder (Lightning's test: a folder holding ``meta.pt``)."""
    path = Path(path)
    return path.is_dir() and (path / META).is_file()


def save_sharded(entries: dict[str, Any], meta: dict[str, Any] | None, folder: Path, group: dist.ProcessGroup | None) -> None:
    """Every rank of ``group`` calls it with its tree of tensor entries ``entries``; rank 0 also with ``meta``.

    Raises on every rank if the write failed.
    """
    distributed = group is not None and dist.get_world_size(group) > 1
    rank = dist.get_rank(group) if distributed else 0
    chosen: list[Any] = [None, None]  # the folder every rank writes into; rank 0's error making it
    if rank == 0:
        partial = partial_path(folder)
        try:
            remove_partial(partial)  # what a crashed write of this process left
            partial.mkdir(parents=True)
            chosen[0] = str(partial)
        except OSError as failure:
            chosen[1] = f"{type(failure).__name__}: {failure}"
            if not distributed:
                raise
    if distributed:
        dist.broadcast_object_list(chosen, src=dist.get_global_rank(group, 0), group=group)
    if chosen[1] is not None:
        raise RuntimeError(f"lit_dp: rank 0 could not make the folder of the checkpoint {folder}: {chosen[1]}")
    partial = Path(chosen[0])
    error: BaseException | None = None
    try:
        writer = dcp.FileSystemWriter(partial, single_file_per_rank=True, sync_files=True)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process: nothing to coordinate
            dcp.save(_own_part(entries, rank), storage_writer=writer, process_group=group, no_dist=not distributed)
    except OSError as failure:  # a full disk: named, with the space left
        error = write_error(folder, failure)
    except BaseException as failure:  # noqa: BLE001 - every rank learns of it below
        error = failure
    if distributed:  # every rank's part is on disk, or some rank failed
        failed = torch.tensor([error is not None], dtype=torch.int32)
        dist.all_reduce(failed, group=group)
        if error is None and failed.item():
            error = RuntimeError(f"lit_dp: another rank failed writing its part of the checkpoint {folder}")
    if rank == 0:
        try:
            if error is None:
                assert meta is not None
                torch.save(meta, partial / META)
                fsync_folder(partial)
                publish(partial, folder)
        except OSError as failure:
            error = write_error(folder, failure)
        except BaseException as failure:  # noqa: BLE001
            error = failure
        if error is not None:
            remove_partial(partial)
    _agree(error, rank, group if distributed else None, f"writing the checkpoint {folder}")


def _own_part(entries: dict[str, Any], rank: int) -> dict[str, Any]:
    """What this rank gives ``torch.distributed.checkpoint``: every tensor and ``RankEntries`` node; the other
    plain values on rank 0 only (so that rank 0's are the ones written; equal tensors are deduplicated)."""

    def keep(node: Any) -> Any:
        if isinstance(node, RankEntries):
            return plain(node)
        if isinstance(node, Mapping):
            kept = {key: keep(value) for key, value in node.items()}
            return {key: value for key, value in kept.items() if value is not _LEFT_OUT}
        if rank == 0 or _holds_tensors(node):
            return node  # a list with tensors goes whole: its plain values, equal on every rank, deduplicated
        return _LEFT_OUT

    return {key: value for key, value in ((key, keep(value)) for key, value in entries.items()) if value is not _LEFT_OUT}


_LEFT_OUT = object()


def _holds_tensors(node: Any) -> bool:
    if isinstance(node, torch.Tensor):
        return True
    if isinstance(node, Mapping):
        return any(_holds_tensors(value) for value in node.values())
    if isinstance(node, (list, tuple)):
        return any(_holds_tensors(value) for value in node)
    return False


def _agree(error: BaseException | None, rank: int, group: dist.ProcessGroup | None, what: str) -> None:
    """Rank 0's outcome to every rank; each raises its own error, or rank 0's as a RuntimeError."""
    if group is not None:
        outcome = [f"{type(error).__name__}: {error}" if error is not None and rank == 0 else None]
        dist.broadcast_object_list(outcome, src=dist.get_global_rank(group, 0), group=group)
        if error is None and outcome[0] is not None:
            raise RuntimeError(f"lit_dp: rank 0 failed {what}: {outcome[0]}")
    if error is not None:
        raise error


class ShardedCheckpoint:
    """A sharded checkpoint's folder, read entry by entry: only the entries asked for are read."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self._metadata = dcp.FileSystemReader(self.folder).read_metadata()
        mapping = self._metadata.planner_data or {}
        self._paths = {key: tuple(mapping.get(key, (key,))) for key in self._metadata.state_dict_metadata}

    def missing_files(self) -> str:
        """What is missing of the files the index names ("" when none): a rank's file lost or cut short."""
        needed: dict[str, int] = {}
        for info in (self._metadata.storage_data or {}).values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
        for name, length in sorted(needed.items()):
            file = self.folder / name
            if not file.is_file():
                return f"{name} is missing"
            if file.stat().st_size < length:
                return f"{name} holds {file.stat().st_size} bytes of {length}, truncated"
        return ""

    def meta(self, weights_only: bool | None = None) -> dict[str, Any]:
        """``meta.pt``: what is not a tensor entry (Lightning's loops and callbacks' state, the epoch and step)."""
        return torch.load(self.folder / META, map_location="cpu", weights_only=weights_only)

    def names(self) -> set[str]:
        """The top-level names of the tensor entries (``model``, ``optimizer_0``, ``lit_dp``, ...)."""
        return {path[0] for path in self._paths.values()}

    def has(self, prefix: TreePath) -> bool:
        """Whether any saved leaf lies under ``prefix`` (string keys, as saved)."""
        return any(path[: len(prefix)] == prefix for path in self._paths.values())

    def keys_under(self, prefix: TreePath) -> set[str]:
        """The keys directly under ``prefix`` (a dict's keys as saved strings, a list's indices as ints)."""
        return {path[len(prefix)] for path in self._paths.values() if len(path) > len(prefix) and path[: len(prefix)] == prefix}

    def read(self, select: Callable[[TreePath], bool]) -> dict[str, Any]:
        """The entries whose path ``select`` accepts (the keys as saved, strings), nested as they were saved, read
        from disk now and nothing else. Integer keys come back where a checkpoint has them (``torch_forms``)."""
        target: dict[str, Any] = {}
        for key, item in self._metadata.state_dict_metadata.items():
            path = self._paths[key]
            if select(path):
                value = torch.empty(item.size, dtype=item.properties.dtype) if isinstance(item, TensorStorageMetadata) else None
                _insert(target, path, value)
        if target:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(target, storage_reader=dcp.FileSystemReader(self.folder), no_dist=True)
        return torch_forms(target)

    def read_under(self, prefix: TreePath) -> Any:
        """The subtree under ``prefix`` (None when nothing was saved there)."""
        found: Any = self.read(lambda path: path[: len(prefix)] == prefix)
        for key in prefix:
            if isinstance(found, dict) and key not in found and str(key).isdigit():
                key = int(key)  # a key torch_forms gave back as the integer it was
            if not isinstance(found, (dict, list)) or (isinstance(found, dict) and key not in found):
                return None
            found = found[key]
        return found

    def optimizer_state(self, name: str, indices: Callable[[int], bool] | None = None) -> dict[str, Any] | None:
        """The optimizer state saved under ``name`` in ``torch.optim.Optimizer.state_dict()``'s form (integer keys,
        ``state`` present even if empty), with the state of the parameters ``indices`` accepts only (all when None)."""
        if not self.has((name,)):
            return None

        def wanted(path: TreePath) -> bool:
            if path[:1] != (name,):
                return False
            if len(path) > 2 and path[1] == "state" and indices is not None:
                return indices(int(path[2]))
            return True

        return self.read(wanted).get(name, {"state": {}, "param_groups": []})


def torch_forms(tree: Any, key: Any = None) -> Any:
    """A tree as ``torch.distributed.checkpoint`` gives it back (every dict key a string), with the integer keys a
    checkpoint has: each optimizer ``state_dict()``'s ``state`` (present even where no parameter had a state: an
    empty dict is not saved), and a feature's per-rank entries (``RANKS``)."""
    if isinstance(tree, list):
        return [torch_forms(value) for value in tree]
    if not isinstance(tree, dict):
        return tree
    converted = {name: torch_forms(value, name) for name, value in tree.items()}
    if key == RANKS and all(str(name).isdigit() for name in converted):
        converted = {int(name): value for name, value in converted.items()}
    if "param_groups" in converted:  # an optimizer's state_dict()
        converted["state"] = {int(index): value for index, value in (converted.get("state") or {}).items()}
    return converted


def _insert(tree: dict[str, Any], path: TreePath, value: Any) -> None:
    """Put ``value`` at ``path`` of ``tree``, making dicts for string keys and lists for integer ones."""
    node: Any = tree
    for key, following in zip(path, path[1:]):
        fresh: Any = [] if isinstance(following, int) else {}
        if isinstance(node, list):
            node.extend([None] * (key + 1 - len(node)))
            if node[key] is None:
                node[key] = fresh
            node = node[key]
        else:
            node = node.setdefault(key, fresh)
    last = path[-1]
    if isinstance(node, list):
        node.extend([None] * (last + 1 - len(node)))
    node[last] = value
