"""FollowerConn: one follower's connection to the leader's replication server
(pybroker.cluster.serve), owned by one event loop at a time: non-blocking reads into one
kept buffer, frames (pybroker.cluster.wire) handed to the server one request at a
time, answers written with ``sendmsg`` uncopied (a fetch that found records is held
until its loop's next idle moment: pybroker.cluster.serve). Budget: a request frame
over the server's limit (``request_limit``: MAX_REQUEST, and a forwarded publish's
body) drops the connection from its header.
"""
from __future__ import annotations

import logging
import selectors
import socket
from collections import deque
from itertools import islice
from typing import TYPE_CHECKING, Protocol

from pybroker.cluster.wire import Buffer, FrameReader, WireError

if TYPE_CHECKING:
    from pybroker.cluster.fetchreq import Fetch
    from pybroker.server.loop import EventLoop

log = logging.getLogger("pybroker")
MAX_REQUEST = 1024 * 1024     # a request frame's head and the rest (a fetch: ~100 bytes)
RECV_BYTES = 64 * 1024        # one read (a fetch request is ~100 bytes)
SEND_PIECES = 64              # buffers one sendmsg takes


def request_limit(max_body_size: int) -> int:
    """The largest request frame a server with this ``max_body_size`` takes: a fetch,
    or a publish forwarded by another node (its body at most max_body_size)."""
    return MAX_REQUEST + max_body_size


class ConnServer(Protocol):
    """What a connection asks of its server."""

    def handle_raw(self, c: FollowerConn, head: bytes, blob: memoryview) -> None: ...

    def forget(self, c: FollowerConn) -> None: ...

    def unpark(self, c: FollowerConn, final: bool = True) -> None: ...


class FollowerConn:
    """One follower's connection, owned by one event loop."""

    __slots__ = ("server", "loop", "sock", "reader", "out", "parked", "timer", "node",
                 "rbuf", "writing", "closed", "held", "moves", "plan", "deadline",
                 "answered_ns", "quick", "forwarded")

    def __init__(self, server: ConnServer, loop: EventLoop,
                 sock: socket.socket, max_request: int = MAX_REQUEST) -> None:
        self.server = server
        self.loop = loop
        self.sock = sock
        self.writing = False
        self.closed = False
        self.reader = FrameReader(max_request)
        self.forwarded = 0         # bytes of forwarded publishes not yet answered
        self.out: deque[Buffer] = deque()   # (a frame may be many pieces: popped left)
        self.parked: Fetch | None = None
        self.held = False          # parked with records to send: answered when idle
        self.moves = 0             # to the loop owning its topics (at most MAX_MOVES)
        self.timer: object = None  # (the server's: one per connection, ``_park``)
        self.deadline = 0          # of the parked fetch (monotonic ns)
        self.answered_ns = 0       # when the last records were sent (monotonic ns)
        self.quick = False         # the fetch after them came within REPLY_SPIN_NS
        self.node = -1
        # the last JSON fetch read (a compact fetch is it again with new offsets)
        self.plan: Fetch | None = None
        self.rbuf = memoryview(bytearray(RECV_BYTES))   # one buffer, reused per recv

    def on_readable(self) -> None:
        try:
            n = self.sock.recv_into(self.rbuf)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            n = 0
        if not n:
            self.close("peer closed")
            return
        self.reader.feed(self.rbuf[:n])
        loop = self.loop
        try:
            while self.parked is None and self.loop is loop:   # (moved: its new loop reads on)
                frame = self.reader.next_raw()
                if frame is None:
                    break
                self.server.handle_raw(self, frame[0], frame[1])
        except (WireError, ValueError, KeyError, TypeError) as e:
            log.error("CLUSTER: replication peer %s: %s", self.node, e)
            self.close(str(e))

    def on_writable(self) -> None:
        self.flush()

    def send(self, bufs: list[Buffer]) -> None:
        if self.out or self.closed or len(bufs) > SEND_PIECES:
            self.out.extend(b for b in bufs if len(b))
            self.flush()
            return
        # nothing queued (the steady state): straight to the socket, the rest queued
        try:
            n = self.sock.sendmsg(bufs)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError:
            self.close("write error")
            return
        for b in bufs:
            size = len(b)
            if n >= size:
                n -= size
            else:
                self.out.append(memoryview(b)[n:] if n else b)
                n = 0
        if self.out:
            self.flush()

    def flush(self) -> None:
        while self.out:
            try:
                n = self.sock.sendmsg(list(islice(self.out, SEND_PIECES)))
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self.close("write error")
                return
            while n and self.out:
                if n >= len(self.out[0]):
                    n -= len(self.out.popleft())
                else:
                    self.out[0] = self.out[0][n:]
                    n = 0
        if bool(self.out) != self.writing and not self.closed:
            self.writing = bool(self.out)
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if self.out else 0)
            try:
                self.loop.selector.modify(self.sock, events, self)
            except (KeyError, ValueError):
                pass

    def close(self, why: str) -> None:
        if self.closed:
            return
        self.closed = True
        self.held = False
        self.server.forget(self)
        try:
            self.loop.selector.unregister(self.sock)
        except (KeyError, ValueError):
            pass
        self.sock.close()


__all__ = ["MAX_REQUEST", "ConnServer", "FollowerConn", "request_limit"]
