"""Asynchronous saves: the state copied off the device now, written by a thread while training goes on.

``stage`` copies every tensor a save will write to CPU memory (a device tensor's bytes to the host,
a CPU tensor cloned), so that the optimizer steps that follow do not change what is being written;
``BackgroundSave`` runs the write in a thread, one save at a time: the next save, a load and the end
of the run wait for the one in flight, and its error, if any, is raised there (at the process's exit
too, when no end of the run came). The write itself is
the same as a synchronous one, into a temporary name renamed when complete
(``lit_dp.checkpoint.atomic``): a crash while it runs leaves the previous checkpoint as it was. What
must wait for the write to be complete (``after``: ``ModelCheckpoint`` removing the checkpoint the new
one replaces in its top-k) runs once it is, and not at all if it fails.

The memory a save in flight holds is the copy: this rank's part of the checkpoint. The writing thread
runs at the lowest scheduling priority (nice 19, where the system allows a thread its own): when it and
training want the same cores, training goes first.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from lit_dp.checkpoint.tree import map_tensors

log = logging.getLogger(__name__)


def stage(tree: Any) -> Any:
    """``tree`` with every tensor copied to CPU memory, detached (the containers copied, other objects shared)."""

    def copy(tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        return tensor.clone() if tensor.device.type == "cpu" else tensor.to("cpu")

    staged = map_tensors(tree, copy)
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the copies off the device are complete before training changes the originals
    return staged


class BackgroundSave:
    """The save in flight, if any: a thread writing a staged checkpoint."""

    def __init__(self, exit_timeout: float = 1800.0) -> None:
        self._exit_timeout = exit_timeout  # how long the process's exit waits for a save in flight
        self._waits_at_exit = False
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.what = ""  # the save in flight, for messages
        self._lock = threading.Lock()
        self._after: list[Callable[[], None]] | None = None  # what runs once the save in flight is written

    def __getstate__(self) -> dict[str, Any]:
        # A spawning launcher pickles the strategy into each rank, before any save: a rank starts with none in flight.
        return {"exit_timeout": self._exit_timeout}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["exit_timeout"])  # type: ignore[misc]

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, write: Callable[[], None], what: str) -> None:
        """Run ``write()`` in a thread (after the save in flight, which ``wait`` finishes first)."""
        self.wait()
        self.what = what
        self._after = []

        def run() -> None:
            _yield_to_training()
            try:
                write()
            except BaseException as error:  # noqa: BLE001 - raised in the main thread by wait()
                self._error = error
            with self._lock:
                after, self._after = self._after, None
            if self._error is not None:
                return  # what waited for the write is not done: the checkpoints it would remove are kept
            for action in after or ():
                try:
                    action()
                except BaseException as error:  # noqa: BLE001 - as the write's own
                    self._error = error

        # A daemon, so that a rank whose peers died is not kept alive by it; a normal exit waits for it (at_exit).
        self._thread = threading.Thread(target=run, name=f"lit_dp {what}", daemon=True)
        self._thread.start()
        if not self._waits_at_exit:
            atexit.register(_finish_at_exit, weakref.ref(self))
            self._waits_at_exit = True

    def after(self, action: Callable[[], None]) -> None:
        """``action()`` once the save in flight is written (in its thread), now if none is; never if it fails."""
        with self._lock:
            if self._after is not None:
                self._after.append(action)
                return
        action()

    def wait(self, timeout: float | None = None) -> None:
        """Until the save in flight is written; raises its error. ``timeout``: give up waiting after it (at the
        end of a failed run, whose other ranks may be gone)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)
        error, self._error = self._error, None
        if error is not None:
            raise error


def _finish_at_exit(save: weakref.ref[BackgroundSave]) -> None:
    """At the process's exit (a Fabric loop that never called ``fabric.strategy.teardown()``): the save in flight
    is finished, within the process group's timeout, before the interpreter stops its thread."""
    if (alive := save()) is None or alive._thread is None:
        return
    try:
        alive.wait(timeout=alive._exit_timeout)
    except BaseException as error:  # noqa: BLE001 - at exit there is no one left to raise it to
        log.warning("lit_dp: %s failed: %s", alive.what, error)


def _yield_to_training() -> None:
    """This thread (Linux: a thread has its own nice value, which the threads it starts inherit) at nice 19."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # another system, or a sandbox that forbids it: the default priority
        pass
