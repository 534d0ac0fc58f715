"""Forwarders: a publish that reaches a node which does not lead its topic is sent on
to the leader over the leader's replication address (pybroker.cluster.serve: a
``publish`` request of pybroker.cluster.wire, the message or the MPUB body as NSQ frames
it in the blob), and answered with the leader's answer, so a producer connected to any
node works unchanged and is answered only after the leader's acknowledgement. The
replication address, not the leader's NSQ port: that one may require TLS of its
clients (``--tls-required``) or AUTH (``--auth-http-address``), which are for NSQ
clients; this node checked its own client already.

One connection per (event loop, leader node), owned by that loop (registered with its
selector; non-blocking). Requests are pipelined, each with its id; the leader answers
each as it settles (``{"id"}`` or ``{"id", "error"}``, the error its NSQ command would
have got). An error fails the publish it answers (``E_PUB_FAILED ...``: the producer
sees it with the reason and may retry, as after any failed publish). A leader that
cannot be reached or goes away before answering fails its publishes with ``lost`` set,
and so does one whose error says it leads the topic no more
(``ports.leadership_moved``: not the leader, its lease expired, its leadership lost or
handed over): ClusterNode.divert sends them again to the next leader (within its
deadline), as a producer retrying would.

Budgets: a publish waits at most ``ANSWER_NS`` for its answer (then the connection is
dropped and everything waiting on it fails); an answer frame over MAX_ANSWER, or one
that is not an answer to a waiting request, drops it; a connect has the same deadline.
"""
from __future__ import annotations

import logging
import selectors
import socket
import struct
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

from pybroker.cluster.ports import Done, JsonObj, leadership_moved, need_int
from pybroker.cluster.wire import Buffer, FrameReader, WireError, encode, parse_head
from pybroker.config import split_hostport

if TYPE_CHECKING:
    from pybroker.cluster.nodeport import NodePort
    from pybroker.server.loop import EventLoop
    from pybroker.server.ports import Payload

log = logging.getLogger("pybroker")
ANSWER_NS = 10_000_000_000
MAX_ANSWER = 64 * 1024        # an answer frame: a head naming a request, maybe an error


class ForwardError(Exception):
    """The leader refused the publish (``lost`` False: its answer), or could not be
    reached or went away before answering (``lost`` True: the publish may be sent
    again, to the next leader)."""

    def __init__(self, text: str, lost: bool = False) -> None:
        super().__init__(text)
        self.lost = lost


def request(rid: int, node: int, name: str, payload: Payload,
            defer_ns: int) -> list[Buffer]:
    """The replication frame that publishes payload to topic name (request ``rid``)."""
    if isinstance(payload, tuple):             # an MPUB body, as received
        kind, body = "mpub", bytes(payload[0])
    elif len(payload) == 1:
        kind, body = ("dpub" if defer_ns else "pub"), bytes(payload[0])
    else:
        parts = [struct.pack(">I", len(payload))]
        for b in payload:
            parts.append(struct.pack(">I", len(b)))
            parts.append(b)
        kind, body = "mpub", b"".join(parts)
    head: JsonObj = {"op": "publish", "id": rid, "node": node, "topic": name, "kind": kind}
    if kind == "dpub":
        head["defer_ns"] = defer_ns
    return encode(head, body)


class _Link:
    """One connection to a leader's replication address, owned by one loop."""

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
        self.out = bytearray()
        self.reader = FrameReader(MAX_ANSWER)
        self.next_id = 1
        # request id -> (its deadline, done): ids and deadlines grow in insertion order
        self.waiting: OrderedDict[int, tuple[int, Done]] = OrderedDict()
        self.closed = False
        loop.selector.register(self.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, self)
        self.timer = loop.call_later(ANSWER_NS, self._check)

    def __repr__(self) -> str:
        return f"forward-to-{self.leader}"

    def send(self, node: int, name: str, payload: Payload, defer_ns: int,
             done: Done) -> None:
        rid = self.next_id
        self.next_id += 1
        for piece in request(rid, node, name, payload, defer_ns):
            self.out += piece
        self.waiting[rid] = (time.monotonic_ns() + ANSWER_NS, done)
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
        self.reader.feed(data)
        try:
            while True:
                frame = self.reader.next_raw()
                if frame is None:
                    break
                head = parse_head(frame[0])
                entry = self.waiting.pop(need_int(head.get("id")), None)
                if entry is None:
                    raise WireError(f"an answer to no waiting request: {head!r:.200}")
                err = head.get("error")
                if err is None:
                    entry[1](None)
                else:
                    text = str(err)
                    # a leader that leads no more (a stale view here, or a leader paused
                    # past its lease, or handing over): the next leader takes it
                    entry[1](ForwardError(f"leader node {self.leader}: {text}",
                                          lost=leadership_moved(text)))
        except (WireError, ValueError, TypeError) as e:
            self.close(f"the leader answered nonsense: {e}")

    def _check(self) -> None:
        self.timer = None
        if self.closed:
            return
        first = next(iter(self.waiting.values()), None)
        if first is not None and first[0] <= time.monotonic_ns():
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
        waiting, self.waiting = self.waiting, OrderedDict()
        for _, done in waiting.values():
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
        address = reg["repl"] if reg is not None else ""
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
        try:
            link.send(self.node.id, name, payload, defer_ns, done)
        except WireError as e:        # over the replication frame's limit (MAX_FRAME)
            done(ForwardError(f"cannot forward to leader node {leader}: {e}"))

    def dropped(self, link: _Link) -> None:
        key = (id(link.loop), link.leader)
        if self.links.get(key) is link:
            del self.links[key]


__all__ = ["ForwardError", "Forwarders", "request"]
