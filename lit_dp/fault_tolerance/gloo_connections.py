"""The TCP connections of a Gloo process group: watched for a peer's hang-up, shut down on abort.

Gloo has no abort. ``ProcessGroupGloo.abort()`` and ``shutdown()`` return at once and close
nothing (torch 2.13); its connections close only when the group's context is destroyed, and
any work object still alive keeps the context. A replica group that gives up on a step can
then leave a peer waiting in an all-reduce on a connection that nobody will use or close: the
peer sits there until the process group's timeout (60 s by default). That was issue 34's
wedge: one survivor of a killed replica group failed at once, the other sat 52 s in the same
all-reduce, the quorum went on without it, and it never rejoined.

``GlooConnections`` gives Gloo the abort NCCL has, from outside: it records which TCP sockets
of this process a process group opened while it was built (this process's sockets before and
after, from ``/proc/self/fd``), and

- ``shutdown()`` shuts them down (``shutdown(2)`` on a duplicate of each descriptor, which
  acts on the socket Gloo holds): Gloo fails every operation pending on them at once, and each
  peer sees the connection closed and fails its own;
- ``hung_up()`` says whether a peer closed one of them (``POLLRDHUP``, or Gloo already closed
  it): a waiting all-reduce need not wait for a connection no one will write to.

Linux only (``/proc``); elsewhere ``record`` finds no socket and both are no-ops, which leaves
torchft's own abort and the process group's timeout.
"""

from __future__ import annotations

import logging
import os
import select
import socket
from collections.abc import Callable, Collection
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
_FD_DIR = "/proc/self/fd"
# A peer's end closed (RDHUP), the connection broken (HUP, ERR) or the descriptor gone (NVAL).
_HUNG_UP = getattr(select, "POLLRDHUP", 0) | select.POLLHUP | select.POLLERR | select.POLLNVAL


def _sockets() -> dict[int, int]:
    """This process's socket descriptors and their inodes (none where ``/proc`` is missing)."""
    try:
        names = os.listdir(_FD_DIR)
    except OSError:
        return {}
    found = {}
    for name in names:
        try:
            link = os.readlink(f"{_FD_DIR}/{name}")
        except OSError:  # closed since it was listed (the listing's own descriptor among them)
            continue
        if link.startswith("socket:["):
            found[int(name)] = int(link[len("socket:[") : -1])
    return found


def _inode(fd: int) -> int | None:
    try:
        return os.fstat(fd).st_ino
    except OSError:
        return None


def _duplicate(fd: int, inode: int) -> socket.socket | None:
    """A socket object on a duplicate of ``fd`` (closing it leaves ``fd`` open), if ``fd`` is still that socket."""
    try:
        duplicate = os.dup(fd)
    except OSError:
        return None  # closed
    if _inode(duplicate) != inode:  # the descriptor now names something else
        os.close(duplicate)
        return None
    return socket.socket(fileno=duplicate)


def _is_connection(fd: int, inode: int, skip_ports: Collection[int]) -> bool:
    """A connected TCP socket whose ends are on none of ``skip_ports`` (not a listener, not a store's)."""
    sock = _duplicate(fd, inode)
    if sock is None:
        return False
    with sock:
        try:
            if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
                return False
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                return False
            ports = {sock.getsockname()[1], sock.getpeername()[1]}
        except OSError:  # not connected
            return False
    return not ports & set(skip_ports)


class GlooConnections:
    """The connections a process group opened (``record``); see the module docstring."""

    def __init__(self, sockets: dict[int, int]) -> None:
        self.sockets = sockets  # descriptor -> inode, as recorded

    @classmethod
    def record(cls, build: Callable[[], T], skip_ports: Collection[int] = ()) -> tuple[T, GlooConnections]:
        """``build()``'s result and the TCP connections this process opened while it ran.

        ``skip_ports``: connections with an end on these ports are left out: a store's (the
        rendezvous store's clients, and its server's side when this process hosts it), which
        outlive the process group.
        """
        before = _sockets()
        built = build()
        opened = {fd: inode for fd, inode in _sockets().items() if before.get(fd) != inode}
        connections = {fd: inode for fd, inode in opened.items() if _is_connection(fd, inode, skip_ports)}
        log.debug("lit_dp: the process group opened %d TCP connections (descriptors %s)", len(connections), sorted(connections))
        return built, cls(connections)

    def hung_up(self) -> bool:
        """Whether a peer closed one of the connections, or it is already closed here."""
        if not self.sockets:
            return False
        poller = select.poll()
        for fd, inode in self.sockets.items():
            if _inode(fd) != inode:
                return True  # Gloo closed it: that pair failed
            poller.register(fd, _HUNG_UP)
        return any(events & _HUNG_UP for _, events in poller.poll(0))

    def shutdown(self) -> None:
        """Shut every recorded connection down (both directions), so that both ends fail at once."""
        for fd, inode in self.sockets.items():
            sock = _duplicate(fd, inode)
            if sock is None:
                continue  # Gloo closed it already
            with sock:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # reset by the peer already
        log.debug("lit_dp: shut down %d connections of an aborted process group", len(self.sockets))
        self.sockets = {}
