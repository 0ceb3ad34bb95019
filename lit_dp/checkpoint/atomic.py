"""A checkpoint is either complete under its name or absent: written under a temporary name, then renamed.

A rank that dies while writing must not leave a checkpoint that the restarted job then picks up
and fails to load (or, worse, loads). Every writer of lit_dp writes into ``.<name>.partial-<pid>``
beside the final name (the same filesystem, so that the rename is one atomic step; no ``*.ckpt``
pattern matches it), flushes it to disk, and renames it over the final name; the folder is synced
so that the rename survives a node crash. A file replaces a file with ``os.replace``. A folder (a
sharded checkpoint) replaces an older folder of its name by an atomic exchange of the two names
(Linux's ``renameat2(RENAME_EXCHANGE)``) where the system has one, else by two renames, the old one
moved aside first (a crash between the two leaves it complete as ``.<name>.replaced-<pid>``).

A write that fails for want of space (a full disk, a quota) raises ``CheckpointWriteError``, an
``OSError`` with the system's errno that names the checkpoint, its folder and the space left
there: torch's own error for it is ``unexpected pos 400704 vs 598``, naming neither.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
from pathlib import Path
from typing import Any

import torch

PARTIAL_MARKER = ".partial-"  # in the name of a checkpoint still being written
REPLACED_MARKER = ".replaced-"  # in the name of an older checkpoint folder being replaced
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_RENAME_EXCHANGE = 2  # linux/fs.h


class CheckpointWriteError(OSError):
    """Writing a checkpoint failed in the operating system (a full disk, a quota, a lost mount): the
    message names the file, the cause and the space left; ``errno`` is the system's."""


def partial_path(path: Path) -> Path:
    """Where ``path`` is written before it is complete."""
    return path.with_name(f".{path.name}{PARTIAL_MARKER}{os.getpid()}")


def write_atomically(checkpoint: dict[str, Any], path: Path) -> None:
    """``torch.save(checkpoint, path)`` such that ``path`` only ever holds a complete file."""
    partial = partial_path(path)
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
        publish(partial, path)
    except OSError as error:
        report = write_error(path, error)  # before the partial file is removed: the space it took is the story
        remove_partial(partial)
        raise report from error
    except BaseException:
        remove_partial(partial)
        raise


def publish(partial: Path, path: Path) -> None:
    """Move the complete ``partial`` (a file, or a folder synced by its writers) to ``path``, over whatever was there."""
    if path.is_symlink() and partial.is_dir():  # ModelCheckpoint(save_last="link")'s link: a folder takes its name
        path.unlink()
    if partial.is_dir() and path.exists():
        if path.is_dir() and _exchange(partial, path):
            shutil.rmtree(partial)  # the older checkpoint, now under the temporary name
        else:
            aside = path.with_name(f".{path.name}{REPLACED_MARKER}{os.getpid()}")
            os.replace(path, aside)
            os.replace(partial, path)
            shutil.rmtree(aside) if aside.is_dir() else aside.unlink()
    else:
        if path.is_dir() and not path.is_symlink():  # a file replaces a sharded checkpoint of the same name
            shutil.rmtree(path)
        os.replace(partial, path)
    fsync_folder(path.parent)


def remove_partial(partial: Path) -> None:
    """Remove what a failed write left (a file or a folder), if anything (nothing raised: the write's error is the story)."""
    if partial.is_dir():
        shutil.rmtree(partial, ignore_errors=True)
        return
    try:
        partial.unlink()
    except OSError:  # never made, or its folder cannot be reached
        pass


def fsync_folder(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _exchange(first: Path, second: Path) -> bool:
    """Swap two names in one step (``renameat2(RENAME_EXCHANGE)``); False where the system has no such call."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_cwd = -100  # AT_FDCWD
    result = renameat2(at_cwd, os.fsencode(first), at_cwd, os.fsencode(second), _RENAME_EXCHANGE)
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):  # an old kernel, a filesystem without it
        return False
    raise OSError(code, os.strerror(code), str(second))


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


def write_error(path: Path, error: OSError) -> CheckpointWriteError:
    """``error``, met writing the checkpoint ``path``, as the ``CheckpointWriteError`` that says what to do."""
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
