"""Socket I/O shared by the TCP and HTTP connections: non-blocking writes, and the
receive buffer each thread keeps.

State: one receive buffer per thread and size (``scratch``); everything else is called
on the thread that owns the connection.
"""
from __future__ import annotations

import errno
import logging
import socket
import threading

log = logging.getLogger("pybroker")
_local = threading.local()


def scratch(size: int) -> memoryview:
    """This thread's receive buffer of ``size`` bytes, kept for the thread's life: a
    connection reads into it and copies out what it keeps (docs/io.md)."""
    try:
        views: dict[int, memoryview] = _local.views
    except AttributeError:
        views = _local.views = {}
    view = views.get(size)
    if view is None:
        view = views[size] = memoryview(bytearray(size))
    return view


def send_some(sock: socket.socket, out: list[bytes], who: str) -> tuple[bytes, int] | None:
    """Send as much of ``out`` as the socket takes now.

    Returns (the unsent rest, bytes sent), or None when the connection broke (logged
    here unless the peer simply went away); the caller then closes it.
    """
    data = out[0] if len(out) == 1 else b"".join(out)
    try:
        sent = sock.send(data)
    except (BlockingIOError, InterruptedError):
        return data, 0
    except OSError as e:
        if e.errno not in (errno.EPIPE, errno.ECONNRESET):
            log.info("%s: write error: %s", who, e.strerror)
        return None
    return data[sent:], sent
