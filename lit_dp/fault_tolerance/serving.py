"""The state a replica group serves to the groups that heal from it, kept readable until they have read it.

In a quorum where a group is behind, torchft's Manager on each group it heals from stages that group's
state on its checkpoint server (``HTTPTransport.send_checkpoint``), and the healing group reads it over
HTTP. The server stops serving at the source's next ``should_commit`` (``disallow_checkpoint``) or at
its shutdown, whether or not the reader is done: a read that starts later waits on the server's lock
until the Manager's timeout and the heal fails. torchft's own loops never meet this, as the step's
all-reduce after the quorum waits for the healing group, which joins it only once it holds its
state. A transaction with nothing crossing groups between its quorum and its vote does meet it: the
first step of a DiLoCo run (its quorum gives every group the same start, its steps stay inside each
group), and the quorum after the last step, which only the groups behind act on before every group
shuts down. On a loaded machine the source got there first, and the healing group discarded its
step 0 (issue 50's tests saw it as "Timed out waiting for wlock").

``ServedState`` counts the reads of what was staged and lets the protocol wait for them
(``wait_for_readers``) before it votes or shuts down: one wait on the source's side, which needs no
agreement with the others (every group would have to issue a collective the same way).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

log = logging.getLogger(__name__)


class ServedState:
    """The reads of the state ``transport`` (torchft's ``HTTPTransport``, ``num_chunks=0``) staged in the
    last quorum; ``timeout_s``: the longest a reader may take from the staging, the Manager's timeout
    (a reader's own ``recv_checkpoint`` gives up then)."""

    def __init__(self, transport: Any, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._changed = threading.Condition()
        self._step: int | None = None  # the step staged last
        self._unread = 0  # readers of it not yet served
        self._staged_at = 0.0
        stage = transport.send_checkpoint

        def send_checkpoint(dst_ranks: list[int], step: int, state_dict: Any, timeout: Any) -> None:
            with self._changed:
                self._step, self._unread, self._staged_at = step, len(dst_ranks), time.monotonic()
            stage(dst_ranks=dst_ranks, step=step, state_dict=state_dict, timeout=timeout)

        transport.send_checkpoint = send_checkpoint
        handler = transport._server.RequestHandlerClass  # the transport's own class, made per server
        serve = handler.do_GET

        def do_GET(request: Any) -> None:
            try:
                serve(request)
            finally:
                self._served(request.path)

        handler.do_GET = do_GET

    def _served(self, path: str) -> None:
        # A read of the whole state is GET /checkpoint/<step>/full; one that failed counts as done too:
        # its reader's heal failed, and waiting longer would not mend it.
        parts = path.split("/")
        if len(parts) != 4 or parts[3] != "full" or not parts[2].isdigit():
            return
        with self._changed:
            if int(parts[2]) == self._step and self._unread > 0:
                self._unread -= 1
                self._changed.notify_all()

    def wait_for_readers(self) -> None:
        """Wait until every group healing from this one in the last quorum has read its state, at most the
        Manager's timeout from the staging."""
        with self._changed:
            left = self._timeout_s - (time.monotonic() - self._staged_at)
            if not self._changed.wait_for(lambda: self._unread == 0, timeout=max(left, 0.0)):
                log.debug("%d reader(s) of the state staged at step %s did not read it in time", self._unread, self._step)
                self._unread = 0  # their heal failed: the next transaction goes on without them
