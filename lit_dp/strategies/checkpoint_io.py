"""``AtomicCheckpointIO``: a checkpoint file is either complete or absent, never half-written; read lazily.

A rank that dies while writing must not leave a file that the restarted job then picks up and
fails to load (or, worse, loads). Lightning's ``TorchCheckpointIO`` serialises to memory and
writes through an fsspec transaction whose temporary file lives in the system temp folder;
when that is another filesystem than the checkpoint's (a local ``/tmp``, checkpoints on a
shared one: the usual cluster layout), the final move is a copy into the destination name, and
a death during the copy leaves a truncated checkpoint under its real name.

Here the bytes go to a temporary file in the destination folder (same filesystem), are flushed
to disk, and are renamed over the final name (``lit_dp.checkpoint.atomic``). A leftover temporary
file is named ``.<name>.partial-<pid>``, which no ``*.ckpt`` pattern matches. Remote paths
(``s3://``, ...) keep Lightning's writer: object stores publish an upload only when it completes.

A write that fails for want of space (a full disk, a quota) raises ``CheckpointWriteError``, an
``OSError`` with the system's errno that names the checkpoint, its folder and the space left
there: torch's own error for it is ``unexpected pos 400704 vs 598``, naming neither.

Reading a local file maps it (``torch.load(..., mmap=True)``): a rank reads from disk only the bytes
of the tensors it takes (its own LocalSGD replica, its ZeRO shard), not the whole file.

It is a CheckpointIO plugin rather than a ``ModelCheckpoint`` subclass because every writer goes
through it: ``ModelCheckpoint`` (top-k, ``last.ckpt``, step checkpoints), Lightning's SLURM
``hpc_ckpt_*.ckpt`` on requeue, ``OnExceptionCheckpoint`` and ``trainer.save_checkpoint``.

A user's own plugin (``Trainer(plugins=[MyCheckpointIO()])``) replaces it, as it replaces
Lightning's default under ``"ddp"``. Where that plugin saves with ``TorchCheckpointIO``'s own
``save_checkpoint`` (a plain ``TorchCheckpointIO``, or a subclass that changes only loading or
removal), lit_dp's writers write for it (``saves_like_torch``: atomic, and each rank's part streamed
or written by that rank, ``lit_dp.strategies.checkpointing``): the bytes are the ones it would write.
A plugin with a writer of its own writes as it chooses, given the whole checkpoint on rank 0.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem
from typing_extensions import override

from lit_dp.checkpoint.atomic import (
    PARTIAL_MARKER,
    CheckpointWriteError,
    write_atomically,
)

__all__ = ["PARTIAL_MARKER", "AtomicCheckpointIO", "CheckpointWriteError", "is_local", "saves_like_torch", "write_atomically"]


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local writes are atomic (temporary file, fsync, rename) and whose local
    reads map the file."""

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any | None = None
    ) -> None:
        if not is_local(path):
            super().save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        if storage_options is not None:
            raise TypeError(
                f"`Trainer.save_checkpoint(..., storage_options=...)` is not supported by {type(self).__name__}."
            )
        write_atomically(checkpoint, Path(path))

    @override
    def load_checkpoint(
        self, path: str | os.PathLike, map_location: Any | None = lambda storage, loc: storage, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if not is_local(path) or not Path(path).is_file():  # Lightning's error for a missing file, its reader for a remote one
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        return torch.load(path, map_location=map_location, weights_only=weights_only, mmap=True)


def is_local(path: str | os.PathLike) -> bool:
    return isinstance(get_filesystem(path), LocalFileSystem)


def saves_like_torch(io: CheckpointIO) -> bool:
    """Whether ``io`` writes with ``TorchCheckpointIO``'s own ``save_checkpoint`` (or ``AtomicCheckpointIO``'s): the
    bytes lit_dp's own writers produce, so that they may write for it."""
    return isinstance(io, TorchCheckpointIO) and type(io).save_checkpoint in (
        TorchCheckpointIO.save_checkpoint,
        AtomicCheckpointIO.save_checkpoint,
    )
