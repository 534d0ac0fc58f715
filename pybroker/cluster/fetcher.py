"""Fetchers: the follower side of replication, one thread per leader node
(``fetch-<id>``), Kafka's replica fetcher threads.

A fetcher keeps one connection to its leader's replication server and loops: for the
topics it follows there whose divergence is not yet cut, it asks where their last
epochs end (``epoch_end``) and has each topic's owner loop cut its log
(``Replica.truncate``); then one ``fetch`` for all of them, each naming the offset its
log holds (what it has written, in fsync mode synced: the acknowledgement), long-polled
by the leader; the records answered are appended by each topic's owner loop
(``Replica.apply``), and the next fetch goes out once every apply is done, so the
offsets a fetch names are always on this node.

Budgets: a blocking socket with a deadline for each whole exchange (the long poll plus
``IO_SLACK_S``, however the answer trickles); an answer whose header says more than the
wire's frame limit drops the connection before anything is allocated for it; a failed
connection is retried after ``RETRY_S``.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from typing import TYPE_CHECKING

from pybroker.cluster.ports import Json, JsonObj, as_obj, need_int, need_objs
from pybroker.cluster.replica import FOLLOWER
from pybroker.cluster.rules import EpochHistory, divergence
from pybroker.cluster.wire import WireError, encode, parse_head, parse_header
from pybroker.config import split_hostport
from pybroker.server.services import owner_loop

if TYPE_CHECKING:
    from pybroker.cluster.nodeport import NodePort
    from pybroker.cluster.replica import Replica

log = logging.getLogger("pybroker")
WAIT_MS = 500
IO_SLACK_S = 5.0
RETRY_S = 0.2
FETCH_BYTES = 4 * 1024 * 1024


class _Countdown:
    """Wait for n callbacks from the owner loops."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.lock = threading.Lock()
        self.event = threading.Event()
        if n <= 0:
            self.event.set()

    def done(self) -> None:
        with self.lock:
            self.n -= 1
            if self.n <= 0:
                self.event.set()


def _hist_mark(h: EpochHistory) -> list[Json]:
    """What a fetch says of the epoch history it holds (its length and last entry):
    the leader sends its own only when it differs."""
    return [len(h.entries), *h.entries[-1]] if h.entries else [0]


def _history(v: Json) -> list[list[int]]:
    """An epoch history a leader sent: [[epoch, start], ...] (ValueError otherwise)."""
    if not isinstance(v, list):
        raise ValueError("the epoch history is not a list")
    out = []
    for pair in v:
        if not isinstance(pair, list) or len(pair) != 2:
            raise ValueError("an epoch history entry is not [epoch, start]")
        out.append([need_int(pair[0]), need_int(pair[1])])
    return out


def _span(blob: memoryview, span: Json) -> bytes:
    """The records an answer's ``blob: [at, length]`` names (ValueError if outside)."""
    if span is None:
        return b""
    if not isinstance(span, list) or len(span) != 2:
        raise ValueError("a blob span is not [at, length]")
    at, n = need_int(span[0]), need_int(span[1])
    if at < 0 or n < 0 or at + n > len(blob):
        raise ValueError(f"a blob span [{at}, {n}] outside the frame")
    return bytes(blob[at:at + n])


class Fetcher:
    def __init__(self, node: NodePort, leader: int) -> None:
        self.node = node
        self.leader = leader
        self.address = ""
        self.topics: list[Replica] = []
        self.stopping = False
        self.wake = threading.Event()
        self.sock: socket.socket | None = None
        self.thread = threading.Thread(target=self._run, name=f"fetch-{leader}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping = True
        self.wake.set()
        sock = self.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    # -- the thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while not self.stopping:
            topics = [r for r in self.topics if r.role == FOLLOWER and r.leader == self.leader]
            if not topics or not self.address:
                self.wake.wait(0.2)
                self.wake.clear()
                continue
            try:
                if self.sock is None:
                    host, port = split_hostport(self.address)
                    self.sock = socket.create_connection((host, port), timeout=2.0)
                    self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._round(topics)
            except (OSError, WireError, ValueError, KeyError, TypeError) as e:
                if not self.stopping:
                    log.warning("CLUSTER: fetching from node %d (%s): %s", self.leader,
                                self.address, e)
                self._drop()
                self.wake.wait(RETRY_S)
                self.wake.clear()
        self._drop()

    def _drop(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
            self.sock = None

    def _exchange(self, head: JsonObj, wait_s: float) -> tuple[JsonObj, memoryview]:
        """Send one request, read its answer: the frame's header, then its body into
        one buffer of its size (no copies), all within wait_s + IO_SLACK_S."""
        sock = self.sock
        assert sock is not None
        deadline = time.monotonic() + wait_s + IO_SLACK_S
        if sock.gettimeout() != wait_s + IO_SLACK_S:
            sock.settimeout(wait_s + IO_SLACK_S)
        sock.sendall(b"".join(encode(head)))
        hdr = bytearray(8)
        self._recv_into(sock, memoryview(hdr), deadline)
        size, hlen = parse_header(hdr)
        body = bytearray(size - 4)
        self._recv_into(sock, memoryview(body), deadline)
        return parse_head(memoryview(body)[:hlen]), memoryview(body)[hlen:]

    @staticmethod
    def _recv_into(sock: socket.socket, view: memoryview, deadline: float) -> None:
        got = 0
        while got < len(view):
            if got:      # a trickle: the rest within what is left of the deadline
                left = deadline - time.monotonic()
                if left <= 0:
                    raise OSError("the leader did not answer in time")
                sock.settimeout(left)
            n = sock.recv_into(view[got:])
            if not n:
                raise OSError("the leader closed the connection")
            got += n

    def _round(self, topics: list[Replica]) -> None:
        node = self.node
        todo = [r for r in topics if r.truncated_for != r.epoch]
        if todo:
            ask: list[Json] = [{"name": r.name, "epoch": r.history.last_epoch()}
                               for r in todo]
            head, _ = self._exchange({"op": "epoch_end", "node": node.id, "topics": ask}, 0)
            by_name = {t.get("name"): t for t in need_objs(head.get("topics"))}
            cd = _Countdown(len(todo))
            for r in todo:
                ans = by_name.get(r.name, {})
                if "error" in ans or need_int(ans.get("leader_epoch", -1)) != r.epoch:
                    cd.done()
                    continue
                leader = EpochHistory([(e, s) for e, s in _history(ans.get("history"))])
                cut = divergence(r.history, r.topic.log.written, leader,
                                 need_int(ans.get("written")))
                owner_loop(r.topic.owner).call_soon_threadsafe(r.truncate, cut, cd.done)
            cd.event.wait(IO_SLACK_S)
            topics = [r for r in topics if r.truncated_for == r.epoch]
            if not topics:
                self.wake.wait(0.1)
                self.wake.clear()
                return
        ask = [{"name": r.name, "epoch": r.epoch, "offset": r.topic.log.written,
                "version": r.chan_from_leader, "hist": _hist_mark(r.history)}
               for r in topics]
        head, blob = self._exchange({"op": "fetch", "node": node.id, "wait_ms": WAIT_MS,
                                     "max_bytes": FETCH_BYTES, "topics": ask},
                                    WAIT_MS / 1000)
        mine = {r.name: r for r in topics}
        jobs = []
        for t in need_objs(head.get("topics")):
            found = mine.get(str(t.get("name")))
            if found is None:
                continue
            r = found
            err = t.get("error")
            if err in ("offset", "out_of_range"):
                r.truncated_for = 0
                continue
            if err is not None:
                continue
            chans = as_obj(t["channels"]) if "channels" in t else None
            data = _span(blob, t.get("blob"))
            hw = need_int(t.get("hw", 0))
            if not data and chans is None and hw <= r.hw:
                continue
            history = _history(t["history"]) if "history" in t else None
            jobs.append((r, need_int(t.get("first", r.topic.log.written)), data, hw,
                         history, chans, need_int(t.get("version", 0))))
        cd = _Countdown(len(jobs))
        for r, first, data, hw, history, chans, version in jobs:
            owner_loop(r.topic.owner).call_soon_threadsafe(r.apply, first, data, hw, history, chans,
                                               version, cd.done)
        cd.event.wait(IO_SLACK_S)


class Fetchers:
    """The fetcher threads, by leader node (assigned by the coordinator's thread)."""

    def __init__(self, node: NodePort) -> None:
        self.node = node
        self.by_leader: dict[int, Fetcher] = {}
        self.lock = threading.Lock()

    def assign(self, by_leader: dict[int, list[Replica]], addresses: dict[int, str]) -> None:
        with self.lock:
            for leader, reps in by_leader.items():
                f = self.by_leader.get(leader)
                if f is None:
                    f = self.by_leader[leader] = Fetcher(self.node, leader)
                    f.start()
                if f.address != addresses.get(leader, ""):
                    f.address = addresses.get(leader, "")
                    sock = f.sock
                    if sock is not None:
                        try:
                            sock.shutdown(socket.SHUT_RDWR)
                        except OSError:
                            pass
                f.topics = list(reps)
                f.wake.set()
            for leader, f in self.by_leader.items():
                if leader not in by_leader:
                    f.topics = []

    def stop(self, timeout_s: float) -> None:
        with self.lock:
            fs = list(self.by_leader.values())
        for f in fs:
            f.stop()
        for f in fs:
            f.thread.join(timeout_s)


__all__ = ["Fetcher", "Fetchers"]
