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

A write that fails for want of space (a full disk, a quota) raises ``CheckpointWriteError``,
an ``OSError`` with the system's errno that names the checkpoint, its folder and the space
left there: torch's own error for it is ``unexpected pos 400704 vs 598``, naming neither.

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

import errno
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem
from fsspec.implementations.local import LocalFileSystem
from typing_extensions import override

PARTIAL_MARKER = ".partial-"  # in the name of a checkpoint still being written
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class CheckpointWriteError(OSError):
    """Writing a checkpoint failed in the operating system (a full disk, a quota, a lost mount): the
    message names the file, the cause and the space left; ``errno`` is the system's."""


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local writes are atomic: temporary file, fsync, rename."""

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any | None = None
    ) -> None:
        if not isinstance(get_filesystem(path), LocalFileSystem):
            super().save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        if storage_options is not None:
            raise TypeError(
                f"`Trainer.save_checkpoint(..., storage_options=...)` is not supported by {type(self).__name__}."
            )
        write_atomically(checkpoint, Path(path))


def save_checkpoint(
    io: CheckpointIO, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any | None
) -> None:
    """``io.save_checkpoint(...)``, atomic for a local file where ``io`` writes with
    ``TorchCheckpointIO``'s own ``save_checkpoint`` (the same bytes, written as ``AtomicCheckpointIO`` does)."""
    saves_like_torch = isinstance(io, TorchCheckpointIO) and type(io).save_checkpoint is TorchCheckpointIO.save_checkpoint
    if saves_like_torch and storage_options is None and isinstance(get_filesystem(path), LocalFileSystem):
        write_atomically(checkpoint, Path(path))
    else:
        io.save_checkpoint(checkpoint, path, storage_options=storage_options)


def write_atomically(checkpoint: dict[str, Any], path: Path) -> None:
    """``torch.save(checkpoint, path)`` such that ``path`` only ever holds a complete file."""
    partial = path.with_name(f".{path.name}{PARTIAL_MARKER}{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Unbuffered: a failed write raises in `write`, where `_KeepWriteError` sees its errno.
        with open(partial, "wb", buffering=0) as file:
            writer = _KeepWriteError(file)
            try:
                torch.save(checkpoint, writer)
            except RuntimeError as error:
                if writer.error is None:
                    raise
                raise writer.error from error
            os.fsync(file.fileno())
        os.replace(partial, path)
    except OSError as error:
        report = _write_error(path, error)  # before the partial file is removed: the space it took is the story
        partial.unlink(missing_ok=True)
        raise report from error
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


class _KeepWriteError:
    """The file ``torch.save`` writes to, keeping the ``OSError`` of a failed write: torch replaces
    it with an error of its own that names neither the cause nor the file."""

    def __init__(self, file: Any) -> None:
        self._file = file
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            return self._file.write(data)
        except OSError as error:
            self.error = error
            raise

    def flush(self) -> None:
        self._file.flush()


def _write_error(path: Path, error: OSError) -> CheckpointWriteError:
    cause = os.strerror(error.errno) if error.errno else str(error)
    try:
        usage = shutil.disk_usage(path.parent)
        space = f"{_size(usage.free)} free of {_size(usage.total)} in {path.parent}"
    except OSError:
        space = f"the free space in {path.parent} is unknown"
    remedy = (
        "free space there or point the checkpoints elsewhere (ModelCheckpoint(dirpath=...); in the recipes, "
        "paths.output_dir or hydra.run.dir)"
        if error.errno in NO_SPACE
        else "check that the folder is writable and its filesystem mounted"
    )
    return CheckpointWriteError(
        error.errno or errno.EIO,
        f"lit_dp: could not write the checkpoint {path}: {cause} ({space}); the previous file of that name, if any, "
        f"is intact. Remedy: {remedy}.",
    )


def _size(count: float) -> str:
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    unit = 0
    while count >= 1024 and unit < len(units) - 1:
        count /= 1024
        unit += 1
    return f"{count:.0f} B" if unit == 0 else f"{count:.1f} {units[unit]}"
