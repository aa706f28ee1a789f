"""The TCP connections of one Gloo ring, and how to cut them when the ring is declared dead.

torch's Gloo cannot cancel a collective (`ProcessGroupGloo.abort()` and
`shutdown()` leave a pending work running: measured with torch 2.13). An
abandoned work therefore stays on Gloo's thread; if the network heals first,
it completes, in place, into the tensor it was given, which by then belongs
to a later generation or to the user, and nothing a dead generation computes
may reach live state. What does end it is its connection: once a ring's
sockets are shut down, every work pending on them fails within a
millisecond, and the peers on the other end get a reset instead of the data
still queued for them.

Gloo opens its connections while the process group is created: a listener,
the connections its listener accepts (local port = the listener's) and the
ones it makes to its peers' listeners. `RingSockets.opened_by(create)` notes
the sockets that appear while `create()` runs, and `cut()` shuts down the
connections among them. The listener is left alone (shutting it down makes
Gloo's accept thread abort the process); it closes with the process group.

Other threads may open sockets in that window (tens of milliseconds). A
connection accepted by another listener of this process (Ray's gRPC server)
is told apart by its local port and never cut; an outgoing connection made
by another thread in the window cannot be told apart, and is cut too (gRPC
reconnects). The fds are only ever shut down, never closed: Gloo keeps
owning them, and a number it owns cannot be reused under it.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import struct
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from collections.abc import Callable

logger = logging.getLogger(__name__)

R = TypeVar("R")

_FD_DIR = "/proc/self/fd"
_LINGER_RESET = struct.pack("ii", 1, 0)  # on close: send a reset and drop what is queued, no FIN after data


def socket_inodes() -> dict[int, int]:
    """This process's sockets: inode -> fd (Linux; empty where /proc is missing).

    `fstat` per descriptor, not `readlink` under /proc: a tenth of the cost
    in a Ray worker holding hundreds of descriptors.
    """
    found: dict[int, int] = {}
    try:
        names = os.listdir(_FD_DIR)
    except OSError:
        return found
    for name in names:
        try:
            st = os.fstat(int(name))
        except OSError:
            continue  # closed meanwhile (the listing's own descriptor among them)
        if stat.S_ISSOCK(st.st_mode):
            found[st.st_ino] = int(name)
    return found


def _dup(fd: int, inode: int) -> socket.socket | None:
    """A socket object over a duplicate of `fd` (closing it leaves `fd` open), or None if `fd` no longer is `inode`."""
    try:
        copy = os.dup(fd)
    except OSError:
        return None  # closed meanwhile
    if os.fstat(copy).st_ino != inode:  # closed and its number reused by another socket meanwhile
        os.close(copy)
        return None
    try:
        return socket.socket(fileno=copy)
    except OSError:
        os.close(copy)
        return None


# sockets this process held when a ring began to form: inode -> its listening port, or None for a connection
_seen: dict[int, int | None] = {}


def _listening_ports(sockets: dict[int, int]) -> set[int]:
    """The ports the listeners among `sockets` (inode -> fd) listen on; each socket is examined once per process."""
    for inode in [i for i in _seen if i not in sockets]:
        del _seen[inode]  # closed since
    for inode, fd in sockets.items():
        if inode not in _seen:
            _seen[inode] = _listening_port(fd, inode)
    return {port for port in _seen.values() if port is not None}


def _listening_port(fd: int, inode: int) -> int | None:
    sock = _dup(fd, inode)
    if sock is None:
        return None
    with sock:
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.getsockopt(
                socket.SOL_SOCKET, socket.SO_ACCEPTCONN
            ):
                return sock.getsockname()[1]
        except OSError:
            pass
    return None


class RingSockets:
    """The connections one process group opened (see the module docstring)."""

    def __init__(self, inodes: set[int]) -> None:
        self._inodes = inodes
        self.cut_count = 0  # connections shut down by `cut`

    @classmethod
    def opened_by(cls, create: Callable[[], R]) -> tuple[R, RingSockets]:
        """Run `create()` (a process group's creation) and note the connections it opened."""
        before = socket_inodes()
        result = create()
        now = socket_inodes()
        opened = {inode: fd for inode, fd in now.items() if inode not in before}
        return result, cls(cls._gloo_connections(opened, before))

    @staticmethod
    def _gloo_connections(opened: dict[int, int], before: dict[int, int]) -> set[int]:
        """The new sockets minus listeners and minus connections accepted by a listener that is not Gloo's."""
        gloo_ports: set[int] = set()
        connections: dict[int, int] = {}  # inode -> local port
        for inode, fd in opened.items():
            sock = _dup(fd, inode)
            if sock is None:
                continue
            with sock:
                try:
                    if sock.family not in (socket.AF_INET, socket.AF_INET6):
                        continue
                    port = sock.getsockname()[1]
                    if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                        gloo_ports.add(port)  # Gloo's listener, created in the window
                    else:
                        connections[inode] = port
                except OSError:
                    continue
        others = _listening_ports(before) if connections else set()
        return {inode for inode, port in connections.items() if port in gloo_ports or port not in others}

    def cut(self) -> int:
        """Shut down every connection of the ring still open; return how many. Safe to call again, from any thread.

        Each is set to reset on close, then shut down both ways: Gloo's
        pending works on it fail at once, and when Gloo closes it the peer
        gets a reset, not the data still queued for it.
        """
        fds = socket_inodes()
        cut = 0
        for inode in list(self._inodes):
            sock = _dup(fds[inode], inode) if inode in fds else None
            if sock is None:
                self._inodes.discard(inode)  # closed by Gloo already
                continue
            with sock:
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
                    sock.shutdown(socket.SHUT_RDWR)
                    cut += 1
                except OSError:
                    pass  # already shut down or reset
            self._inodes.discard(inode)
        self.cut_count += cut
        if cut:
            logger.debug("cut %d connection(s) of an abandoned Gloo ring", cut)
        return cut
