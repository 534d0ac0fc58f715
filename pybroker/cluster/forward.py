"""Forwarders: a publish that reaches a node which does not lead its topic is sent on
to the leader over an ordinary NSQ V2 connection (PUB, MPUB or DPUB, exactly as a
client would), and answered with the leader's answer, so a producer connected to any
node works unchanged and is answered only after the leader's acknowledgement.

One connection per (event loop, leader node), owned by that loop (registered with its
selector; non-blocking). Commands are pipelined; the leader answers in order, so the
waiting publishes are a FIFO. An error frame from the leader (``E_PUB_FAILED ...``:
fatal in NSQ) fails the publish it answers and the leader closes the connection, which
fails the ones behind it (their producers see ``E_PUB_FAILED`` with the reason and may
retry, as after any failed publish). A leader that cannot be reached or goes away
before answering fails its publishes with ``lost`` set, and so does one whose error
says it leads the topic no more (``ports.leadership_moved``: not the leader, its lease
expired, its leadership lost or handed over): ClusterNode.divert sends them again to
the next leader (within its deadline), as a producer retrying would.
Heartbeats are answered with NOP.

Budgets: a publish waits at most ``ANSWER_NS`` for its answer (then the connection is
dropped and everything waiting on it fails); a frame from the leader over the node's
``max_body_size`` drops it; a connect has the same deadline.
"""
from __future__ import annotations

import logging
import selectors
import socket
import struct
import time
from collections import deque
from typing import TYPE_CHECKING

from pybroker.cluster.ports import Done, leadership_moved
from pybroker.config import split_hostport
from pybroker.protocol.wire import HEARTBEAT

if TYPE_CHECKING:
    from pybroker.cluster.nodeport import NodePort
    from pybroker.server.loop import EventLoop
    from pybroker.server.ports import Payload

log = logging.getLogger("pybroker")
ANSWER_NS = 10_000_000_000


class ForwardError(Exception):
    """The leader refused the publish (``lost`` False: its answer), or could not be
    reached or went away before answering (``lost`` True: the publish may be sent
    again, to the next leader)."""

    def __init__(self, text: str, lost: bool = False) -> None:
        super().__init__(text)
        self.lost = lost


def command(name: str, payload: Payload, defer_ns: int) -> bytes:
    """The V2 command that publishes payload to topic name."""
    if isinstance(payload, tuple):             # an MPUB body, as received
        body = bytes(payload[0])
        return b"MPUB " + name.encode() + b"\n" + struct.pack(">I", len(body)) + body
    if len(payload) == 1:
        body = bytes(payload[0])
        if defer_ns:
            line = b"DPUB %s %d\n" % (name.encode(), defer_ns // 1_000_000)
        else:
            line = b"PUB " + name.encode() + b"\n"
        return line + struct.pack(">I", len(body)) + body
    parts = [struct.pack(">I", len(payload))]
    for b in payload:
        parts.append(struct.pack(">I", len(b)))
        parts.append(b)
    body = b"".join(parts)
    return b"MPUB " + name.encode() + b"\n" + struct.pack(">I", len(body)) + body


class _Link:
    """One connection to a leader, owned by one loop."""

    def __init__(self, owner: Forwarders, loop: EventLoop, leader: int, address: str) -> None:
        self.owner = owner
        self.loop = loop
        self.leader = leader
        self.address = address
        host, port = split_hostport(address)
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                                  socket.SOCK_STREAM)
        self.sock.setblocking(False)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.connect_ex((host, port))
        self.out = bytearray(b"  V2")
        self.inbuf = bytearray()
        self.waiting: deque[tuple[int, Done]] = deque()
        self.closed = False
        self.max_frame = int(loop.options.max_body_size) + 1024
        loop.selector.register(self.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, self)
        self.timer = loop.call_later(ANSWER_NS, self._check)

    def __repr__(self) -> str:
        return f"forward-to-{self.leader}"

    def send(self, data: bytes, done: Done) -> None:
        self.out += data
        self.waiting.append((time.monotonic_ns() + ANSWER_NS, done))
        self.on_writable()

    def on_writable(self) -> None:
        if self.closed:
            return
        if self.out:
            try:
                n = self.sock.send(self.out)
                del self.out[:n]
            except (BlockingIOError, InterruptedError):
                pass
            except OSError as e:
                self.close(f"write error: {e}")
                return
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if self.out else 0)
        try:
            self.loop.selector.modify(self.sock, events, self)
        except (KeyError, ValueError):
            pass

    def on_readable(self) -> None:
        try:
            data = self.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self.close(f"read error: {e}")
            return
        if not data:
            self.close("the leader closed the connection")
            return
        self.inbuf += data
        buf = self.inbuf
        while len(buf) >= 8:
            size, ftype = struct.unpack_from(">iI", buf, 0)
            if size < 4 or size > self.max_frame:
                self.close(f"bad frame size {size}")
                return
            if len(buf) < 4 + size:
                break
            body = bytes(buf[8:4 + size])
            del buf[:4 + size]
            if ftype == 0 and body == HEARTBEAT:
                self.out += b"NOP\n"
                self.on_writable()
                continue
            if not self.waiting:
                continue
            _, done = self.waiting.popleft()
            if ftype == 0 and body == b"OK":
                done(None)
            else:
                text = body.decode("utf-8", "replace")
                # a leader that leads no more (a stale view here, or a leader paused
                # past its lease, or handing over): the next leader takes it
                done(ForwardError(f"leader node {self.leader}: {text}",
                                  lost=leadership_moved(text)))

    def _check(self) -> None:
        self.timer = None
        if self.closed:
            return
        if self.waiting and self.waiting[0][0] <= time.monotonic_ns():
            self.close("the leader did not answer in time")
            return
        self.timer = self.loop.call_later(ANSWER_NS // 4, self._check)

    def close(self, why: str) -> None:
        if self.closed:
            return
        self.closed = True
        self.loop.cancel(self.timer)
        try:
            self.loop.selector.unregister(self.sock)
        except (KeyError, ValueError):
            pass
        self.sock.close()
        self.owner.dropped(self)
        if self.waiting:
            log.warning("CLUSTER: forwarding to node %d: %s (%d publishes failed)",
                        self.leader, why, len(self.waiting))
        waiting, self.waiting = self.waiting, deque()
        for _, done in waiting:
            done(ForwardError(f"forwarding to leader node {self.leader} failed: {why}",
                              lost=True))


class Forwarders:
    """The links of every loop (each loop touches only its own)."""

    def __init__(self, node: NodePort) -> None:
        self.node = node
        self.links: dict[tuple[int, int], _Link] = {}   # (id(loop), leader) -> link

    def forward(self, loop: EventLoop, leader: int, name: str, payload: Payload,
                defer_ns: int, done: Done) -> None:
        """On ``loop``: send the publish to ``leader``; done(None or error) there."""
        reg = self.node.nodes.get(leader)
        address = reg["tcp"] if reg is not None else ""
        key = (id(loop), leader)
        link = self.links.get(key)
        if link is not None and link.address != address:
            link.close("the leader moved")
            link = None
        if link is None:
            try:
                link = self.links[key] = _Link(self, loop, leader, address)
            except (OSError, ValueError) as e:
                done(ForwardError(f"cannot reach leader node {leader} ({address}): {e}",
                                  lost=True))
                return
        link.send(command(name, payload, defer_ns), done)

    def dropped(self, link: _Link) -> None:
        key = (id(link.loop), link.leader)
        if self.links.get(key) is link:
            del self.links[key]


__all__ = ["ForwardError", "Forwarders", "command"]
