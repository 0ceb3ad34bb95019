"""The full format: one ``torch.save`` file, written by rank 0, that no rank holds whole.

What the file holds is rank 0's checkpoint with each ``RankEntries`` node (``lit_dp.checkpoint.tree``)
the union of every rank's entries: a plain ``torch.load``-able dict, the file every Lightning tool
reads. Where no other rank has an entry, rank 0 writes it with ``torch.save``
(``lit_dp.checkpoint.atomic.write_atomically``). Otherwise the other ranks' tensors are streamed:

1. every rank sends rank 0 the shapes and dtypes of its entries (``gather_object``, small);
2. rank 0 writes the file with ``torch.save`` under ``torch.serialization.skip_data``: the pickled
   structure and the zip records, each record's space reserved (a hole: nothing is written), with
   an uninitialised tensor (no page touched) standing for each tensor of another rank;
3. rank 0 writes its own tensors' bytes at their records' offsets, drops the placeholders, then
   receives the other ranks' tensors, one tensor at a time, rank after rank, each written at its
   record's offset (``os.pwrite``) as it arrives.

So rank 0 holds its own state and one tensor of another rank's at a time, whatever the number of
ranks; the file is written under a temporary name and renamed into place when complete
(``lit_dp.checkpoint.atomic``). Then rank 0 tells every rank whether the file was written, so that a
failed write (a full disk) raises on every rank, naming the file, instead of leaving the others
waiting.

The records keep torch's CRC-32 field at 0, as ``skip_data`` writes them: ``torch.load`` does not
read it (tested), a zip tool that checks it would complain.

``assemble`` is the same exchange for a writer that needs the whole checkpoint in memory (a
``CheckpointIO`` of the user's, a remote path): rank 0 then holds every rank's entries at once.
"""

from __future__ import annotations

import os
import pickle
import struct
import types
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lit_dp.checkpoint.atomic import (
    partial_path,
    publish,
    remove_partial,
    write_atomically,
    write_error,
)
from lit_dp.checkpoint.tree import Path as TreePath
from lit_dp.checkpoint.tree import (
    RankEntries,
    TensorSpec,
    placeholders,
    plain,
    rank_entries,
    specs,
    tensors,
)

_LOCAL_HEADER = struct.Struct("<4s5H3I2H")  # a zip member's local file header, 30 bytes


def save_full(checkpoint: dict[str, Any], path: Path, group: dist.ProcessGroup | None) -> None:
    """Every rank of ``group`` calls it with its own ``checkpoint``; rank 0 writes the job's in ``path``.

    Raises on every rank if the write failed (on rank 0 with the ``CheckpointWriteError`` of the write).
    """
    exchange = _Exchange(checkpoint, group)
    error: BaseException | None = None
    if exchange.rank == 0:
        try:
            if exchange.streams:
                _stream_to_file(exchange, path)
            else:
                write_atomically(plain(exchange.merged()), path)
        except BaseException as failure:  # noqa: BLE001 - reported to every rank below, then raised here
            error = failure
            exchange.drain()  # the others must not wait forever for their tensors to be taken
    else:
        exchange.send()
    exchange.agree(error, f"writing the checkpoint {path}")


def assemble(checkpoint: dict[str, Any], group: dist.ProcessGroup | None) -> dict[str, Any] | None:
    """The job's checkpoint in memory on rank 0 (None elsewhere): every rank calls it with its own."""
    exchange = _Exchange(checkpoint, group)
    if exchange.rank != 0:
        exchange.send()
        return None
    merged = exchange.merged()
    for rank in exchange.senders():
        while (tensor := exchange.next_from(rank)) is not None:
            exchange.receive(rank, _bytes(tensor))
    return plain(merged)


class _Exchange:
    """One full-format save: what every rank holds apart, told to rank 0, and its tensors sent there."""

    def __init__(self, checkpoint: dict[str, Any], group: dist.ProcessGroup | None) -> None:
        self.checkpoint = checkpoint
        self.group = group
        distributed = group is not None and dist.get_world_size(group) > 1
        self.rank = dist.get_rank(group) if distributed else 0
        self.world_size = dist.get_world_size(group) if distributed else 1
        own = [(node, specs(entries)) for node, entries in rank_entries(checkpoint)]
        self.others: list[tuple[int, list[tuple[TreePath, Any]]]] = []
        if distributed:
            gathered: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
            dist.gather_object(own if self.rank else None, gathered, dst=self._global(0), group=group)
            if gathered is not None:
                self.others = [(rank, entries) for rank, entries in enumerate(gathered) if rank]
        self._merged: dict[str, Any] | None = None
        self._pending: dict[int, list[Any]] = {}  # each rank's tensors not yet received, in its order

    @property
    def streams(self) -> bool:
        """Whether another rank has a tensor to send."""
        return any(isinstance(leaf, TensorSpec) for _, nodes in self.others for _, tree in nodes for leaf in _leaves(tree))

    def merged(self) -> dict[str, Any]:
        """Rank 0's checkpoint with each ``RankEntries`` node the union of every rank's entries, sorted by key, the
        other ranks' tensors uninitialised placeholders (filled by what they send)."""
        if self._merged is None:
            nodes = {node: dict(entries) for node, entries in rank_entries(self.checkpoint)}
            for rank, entries in self.others:
                for node, tree in entries:
                    standing_in = placeholders(tree)
                    self._pending.setdefault(rank, []).extend(t for _, t in tensors(standing_in) if t.numel())
                    nodes.setdefault(node, {}).update(standing_in)
            self._merged = _replace_nodes(self.checkpoint, {node: dict(sorted(union.items())) for node, union in nodes.items()})
        return self._merged

    def senders(self) -> list[int]:
        """The ranks with tensors still to send, in order (after ``merged``)."""
        return sorted(rank for rank, pending in self._pending.items() if pending)

    def next_from(self, rank: int) -> Any:
        """What stands for ``rank``'s next tensor (taken off its list: its placeholder, or its ``_Slot`` once
        ``place``d), None when it has sent all."""
        pending = self._pending.get(rank)
        return pending.pop(0) if pending else None

    def place(self, offsets: dict[int, int]) -> None:
        """Each placeholder replaced by its ``_Slot`` (``offsets``: by its storage), the placeholders dropped."""
        self._pending = {
            rank: [_Slot(tensor.nbytes, offsets[tensor.untyped_storage().data_ptr()]) for tensor in pending]
            for rank, pending in self._pending.items()
        }
        self._merged = None

    def send(self) -> None:
        """This rank's entries' tensors to rank 0, in ``tensors``' order, as bytes (empty ones are not sent)."""
        for _, entries in rank_entries(self.checkpoint):
            for _, tensor in tensors(entries):
                if tensor.numel():
                    dist.send(_bytes(tensor.detach().cpu()), dst=self._global(0), group=self.group)

    def receive(self, rank: int, into: torch.Tensor) -> None:
        dist.recv(into, src=self._global(rank), group=self.group)

    def drain(self) -> None:
        """Take and drop what the other ranks still send (rank 0, after a failed write)."""
        if not self._pending and self.others:
            self.merged()  # what they send was not even described yet
        for rank in self.senders():
            while (tensor := self.next_from(rank)) is not None:
                self.receive(rank, torch.empty(tensor.nbytes, dtype=torch.uint8))

    def agree(self, error: BaseException | None, what: str) -> None:
        """Rank 0's outcome to every rank: the others raise rank 0's error as a RuntimeError naming it."""
        if self.world_size > 1:
            outcome = [f"{type(error).__name__}: {error}" if error is not None else None]
            dist.broadcast_object_list(outcome, src=self._global(0), group=self.group)
            if error is None and outcome[0] is not None:
                raise RuntimeError(f"lit_dp: rank 0 failed {what}: {outcome[0]}")
        if error is not None:
            raise error

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank


def _stream_to_file(exchange: _Exchange, path: Path) -> None:
    """Rank 0: the file's structure, its own tensors' bytes, then every other rank's as they arrive."""
    partial = partial_path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        merged = plain(exchange.merged())
        standing_in = {t.untyped_storage().data_ptr() for pending in exchange._pending.values() for t in pending}
        records = _write_skeleton(merged, partial)
        del merged
        offsets = _record_offsets(partial)
        where: dict[int, int] = {}  # a placeholder's storage -> its bytes' offset in the file
        descriptor = os.open(partial, os.O_WRONLY)
        try:
            for key, storage in records.items():
                untyped = storage._untyped_storage if isinstance(storage, torch.storage.TypedStorage) else storage
                if untyped.nbytes() == 0 or untyped.device.type == "meta":
                    continue
                if untyped.data_ptr() in standing_in:
                    where[untyped.data_ptr()] = offsets[key]
                else:
                    _pwrite(descriptor, _storage_bytes(untyped), offsets[key])
            del records
            exchange.place(where)  # the placeholders go: what they reserved is not kept while the bytes arrive
            for rank in exchange.senders():
                buffer = torch.empty(max(slot.nbytes for slot in exchange._pending[rank]), dtype=torch.uint8)
                while (slot := exchange.next_from(rank)) is not None:
                    chunk = buffer[: slot.nbytes]
                    exchange.receive(rank, chunk)
                    _pwrite(descriptor, chunk, slot.offset)
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        publish(partial, path)
    except OSError as error:
        report = write_error(path, error)
        remove_partial(partial)
        raise report from error
    except BaseException:
        remove_partial(partial)
        raise


@dataclass(frozen=True)
class _Slot:
    """Where a tensor another rank sends goes in the file: its size and its bytes' offset."""

    nbytes: int
    offset: int


def _write_skeleton(checkpoint: dict[str, Any], partial: Path) -> dict[str, Any]:
    """``torch.save`` of ``checkpoint`` with every record's bytes skipped; returns each record's storage by key.

    torch names a storage's record ``data/<key>`` in the order its pickler meets the storage; a pickler of
    our own under torch's (``pickle_module``) sees each ``(storage, key)`` pair as torch makes it.
    """
    records: dict[str, Any] = {}
    with open(partial, "wb") as file, torch.serialization.skip_data():
        torch.save(checkpoint, file, pickle_module=_recording_pickle(records))
        file.flush()
    return records


def _recording_pickle(records: dict[str, Any]) -> types.SimpleNamespace:
    """A ``pickle`` module for ``torch.save`` whose pickler records each storage under the key torch gives it.

    torch's pickler subclasses ``pickle_module.Pickler`` and decides each object's persistent id; the
    pure-Python ``pickle._Pickler`` calls ``save`` for every object, where the id is read once more
    (torch's ``persistent_id`` returns the same key for a storage it has seen).
    """

    class RecordingPickler(pickle._Pickler):  # type: ignore[name-defined]  # the pure-Python pickler, documented in pickle.py
        def save(self, obj: Any, save_persistent_id: bool = True) -> None:
            if save_persistent_id:
                persistent = self.persistent_id(obj)
                if isinstance(persistent, tuple) and persistent and persistent[0] == "storage":
                    records[persistent[2]] = obj
            super().save(obj, save_persistent_id)

    return types.SimpleNamespace(__name__="pickle", Pickler=RecordingPickler)


def _record_offsets(file: Path) -> dict[str, int]:
    """Where each storage's bytes start in a ``torch.save`` zip file, by the storage's key."""
    offsets = {}
    with zipfile.ZipFile(file) as archive, open(file, "rb") as raw:
        for member in archive.infolist():
            folder, _, key = member.filename.rpartition("/")
            if not folder.endswith("/data") and folder != "data":
                continue
            raw.seek(member.header_offset)
            header = _LOCAL_HEADER.unpack(raw.read(_LOCAL_HEADER.size))
            name_length, extra_length = header[-2], header[-1]
            offsets[key] = member.header_offset + _LOCAL_HEADER.size + name_length + extra_length
    return offsets


def _storage_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A storage's bytes as a CPU uint8 tensor (a copy only for a storage on another device)."""
    if storage.device.type != "cpu":
        storage = storage.cpu()
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's elements as contiguous uint8 (a view where it is contiguous already)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _pwrite(descriptor: int, data: torch.Tensor, offset: int) -> None:
    view = memoryview(data.numpy()).cast("B")
    while view:
        written = os.pwrite(descriptor, view, offset)
        view, offset = view[written:], offset + written


def _leaves(tree: Any) -> list[Any]:
    if isinstance(tree, dict):
        return [leaf for value in tree.values() for leaf in _leaves(value)]
    if isinstance(tree, (list, tuple)):
        return [leaf for value in tree for leaf in _leaves(value)]
    return [tree]


def _replace_nodes(tree: Any, nodes: dict[TreePath, dict], path: TreePath = ()) -> Any:
    """``tree`` with the node at each path of ``nodes`` replaced (the containers on the way copied, nothing else)."""
    if path in nodes:
        return nodes[path]
    if not any(node[: len(path)] == path for node in nodes):
        return tree
    if isinstance(tree, dict):
        replaced = {key: _replace_nodes(value, nodes, path + (key,)) for key, value in tree.items()}
        below = [node for node in nodes if len(node) > len(path) and node[: len(path)] == path]
        missing = {node[len(path)] for node in below if node[len(path)] not in tree}
        for key in missing:  # a node only other ranks hold entries of (none of rank 0's)
            replaced[key] = _replace_nodes({}, nodes, path + (key,))
        return replaced if type(tree) in (dict, RankEntries) else type(tree)(replaced)
    if isinstance(tree, list):
        return [_replace_nodes(value, nodes, path + (index,)) for index, value in enumerate(tree)]
    return tree

