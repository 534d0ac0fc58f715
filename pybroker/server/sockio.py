"""Non-blocking socket writes shared by the TCP and HTTP connections.

No state of its own: called on the thread that owns the connection being written.
"""
from __future__ import annotations

import errno
import logging
import socket

log = logging.getLogger("pybroker")


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
