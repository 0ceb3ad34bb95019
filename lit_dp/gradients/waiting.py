"""How lit_dp waits for its own collectives: plainly, or with a deadline that names a hang.

Every wait of lit_dp's (a bucket's all-reduces, a communication hook's future, the broadcast of
the bucket order, a LocalSGD average, the per-step exchange of uneven inputs) goes through a
``Waiter``. The default waits as torch does. The hang watchdog
(``lit_dp.observability.watchdog``) installs one whose waits end after ``hang_timeout``
seconds and then diagnose the hang and raise, instead of sitting until the process-group
timeout. This module sits in ``gradients`` so that the buckets can use it without knowing the
watchdog (which lives above them).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class CollectiveHangError(RuntimeError):
    """A lit_dp collective waited longer than ``hang_timeout``; the message is the watchdog's
    diagnosis (which rank is where, and where their stacks were written)."""


class Waiter:
    """Waits for a ``dist.Work`` or a future; ``what`` names the collective for a diagnosis
    ("" for a bucket, which the watchdog finds among the launches it saw)."""

    def wait(self, work: dist.Work, what: str = "") -> None:
        work.wait()

    def wait_future(self, future: torch.futures.Future, what: str = "") -> Any:
        return future.wait()


UNWATCHED = Waiter()
