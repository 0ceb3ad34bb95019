"""``AtomicCheckpointIO``: a checkpoint file is either complete or absent, never half-written.

A rank that dies while writing must not leave a file that the restarted job then picks up and
fails to load (or, worse, loads). Lightning's ``TorchCheckpointIO`` serialises to memory and
writes through an fsspec transaction whose temporary file lives in the system temp folder;
when that is another filesystem than the checkpoint's (a local ``/tmp``, checkpoints on a
shared one: the usual cluster layout), the final move is a copy into the destination name, and
a death during the copy leaves a truncated checkpoint under its real name.

Here the bytes go to a temporary file in the destination folder (same filesystem), are flushed
to disk, and are renamed over the final name (``os.replace``, atomic on POSIX); the folder is
synced so the rename survives a node crash. A leftover temporary file is named
``.<name>.partial-<pid>``, which no ``*.ckpt`` pattern matches. Remote paths (``s3://``, ...)
keep Lightning's writer: object stores publish an upload only when it completes.

It is a CheckpointIO plugin rather than a ``ModelCheckpoint`` subclass because every writer goes
through it: ``ModelCheckpoint`` (top-k, ``last.ckpt``, step checkpoints), Lightning's SLURM
``hpc_ckpt_*.ckpt`` on requeue, ``OnExceptionCheckpoint`` and ``trainer.save_checkpoint``.

A user's own plugin (``Trainer(plugins=[MyCheckpointIO()])``) replaces it, as it replaces
Lightning's default under ``"ddp"``. Where that plugin saves with ``TorchCheckpointIO``'s own
``save_checkpoint`` (a plain ``TorchCheckpointIO``, or a subclass that changes only loading or
removal), its local writes are made atomic too (``save_checkpoint``): the bytes are the ones it
would write. A plugin with a writer of its own writes as it chooses.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.types import _PATH
from fsspec.implementations.local import LocalFileSystem
from typing_extensions import override

PARTIAL_MARKER = ".partial-"  # in the name of a checkpoint still being written


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local writes are atomic: temporary file, fsync, rename."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if not isinstance(get_filesystem(path), LocalFileSystem):
            super().save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        if storage_options is not None:
            raise TypeError(
                f"`Trainer.save_checkpoint(..., storage_options=...)` is not supported by {type(self).__name__}."
            )
        write_atomically(checkpoint, Path(path))


def save_checkpoint(io: CheckpointIO, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None) -> None:
    """``io.save_checkpoint(...)``, atomic for a local file where ``io`` writes with
    ``TorchCheckpointIO``'s own ``save_checkpoint`` (the same bytes, written as ``AtomicCheckpointIO`` does)."""
    saves_like_torch = isinstance(io, TorchCheckpointIO) and type(io).save_checkpoint is TorchCheckpointIO.save_checkpoint
    if saves_like_torch and storage_options is None and isinstance(get_filesystem(path), LocalFileSystem):
        write_atomically(checkpoint, Path(path))
    else:
        io.save_checkpoint(checkpoint, path, storage_options=storage_options)


def write_atomically(checkpoint: dict[str, Any], path: Path) -> None:
    """``torch.save(checkpoint, path)`` such that ``path`` only ever holds a complete file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}{PARTIAL_MARKER}{os.getpid()}")
    try:
        with open(partial, "wb") as file:
            torch.save(checkpoint, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
