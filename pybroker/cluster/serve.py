"""ReplicationServer: the leader side of replication, listening on ``cluster_address``
(a connection NSQ clients never see; frames of pybroker.cluster.wire). Its own thread
(``cluster-serve``) only accepts: each connection is handed to an event loop (in turn)
and, at its first fetch, moved to the loop that owns the topics it fetches (the first
one named; at most MAX_MOVES times), so that on the loop that owns the topics (all of
them, with the default one loop) a follower's acknowledgement moves the high watermark
and a write answers a parked fetch without a thread in between.

Requests (one at a time per connection, answered in order):
- ``{"op": "epoch_end", "node", "topics": [{"name", "epoch"}]}``: where each asked
  epoch ends in this leader's log (``EpochHistory.end_for_epoch``), for the follower's
  truncation;
- ``{"op": "fetch", "node", "wait_ms", "max_bytes", "topics": [{"name", "epoch",
  "offset", "version", "hist"}]}``: ``offset`` is what the follower holds (its
  acknowledgement: ``Replica.fetched`` on the topic's owner loop) and where it reads
  next. The answer carries, per topic, records from there (raw log bytes in the blob),
  the high watermark, the epoch history when it differs from what ``hist`` says the
  follower holds, and the channel states when the follower's ``version`` is older.
  With no record to send, the request waits (long poll) until a write (``notify``:
  answered as soon as the owner loop has written a turn's records, so a round carries
  every publish of a turn) or ``wait_ms`` (at most MAX_WAIT_MS).

Budgets: ``max_bytes`` is capped at MAX_FETCH_BYTES per answer; a request frame over
MAX_REQUEST (or a head over the wire's limit) drops the connection from its header, so a
connection buffers at most that much, and one naming over MAX_TOPICS topics drops it
too (a request is served on an event loop); at most MAX_CONNS connections. The last read of
each topic is kept for the next follower that asks for the same records (at most
READ_CACHE_TOPICS topics and READ_CACHE_BYTES; records are sent from it uncopied).
"""
from __future__ import annotations

import bisect
import logging
import selectors
import socket
import threading
from typing import TYPE_CHECKING, cast

from pybroker.cluster.ports import Json, JsonObj, need_int, need_objs, need_str
from pybroker.cluster.replica import LEADER, Replica
from pybroker.cluster.wire import MAX_TOPICS, Buffer, FrameReader, WireError, encode
from pybroker.config import split_hostport
from pybroker.evloop import SelectorLoop
from pybroker.storage.topiclog import REC_HEADER, OffsetOutOfRange
from pybroker.server.services import owner_loop

if TYPE_CHECKING:
    from pybroker.cluster.nodeport import NodePort
    from pybroker.core.seams import Batch
    from pybroker.server.loop import EventLoop

log = logging.getLogger("pybroker")
MAX_FETCH_BYTES = 8 * 1024 * 1024
MAX_WAIT_MS = 5000
MAX_CONNS = 64
MAX_REQUEST = 1024 * 1024     # a request frame (what a follower sends) at most
MAX_MOVES = 8                 # a connection changes loops at most this often
RECV_BYTES = 64 * 1024        # one read (a fetch request is ~100 bytes)
READ_CACHE_TOPICS = 64        # last reads kept for the next follower: this many topics
READ_CACHE_BYTES = 32 * 1024 * 1024   # and at most this many bytes


def record_bytes(batch: Batch, n: int) -> memoryview:
    """The raw bytes of the first n records of a RecordBatch (one contiguous span)."""
    buf, pos = batch.buf, batch.pos
    last = pos[n - 1]
    end = last + REC_HEADER + int.from_bytes(buf[last + 4:last + 8], "big")
    return memoryview(buf)[pos[0]:end]


class _Conn:
    """One follower's connection, owned by one event loop."""

    __slots__ = ("server", "loop", "sock", "reader", "out", "parked", "timer", "node",
                 "rbuf", "writing", "closed", "held", "late", "moves")

    def __init__(self, server: ReplicationServer, loop: EventLoop,
                 sock: socket.socket) -> None:
        self.server = server
        self.loop = loop
        self.sock = sock
        self.writing = False
        self.closed = False
        self.reader = FrameReader(MAX_REQUEST)
        self.out: list[Buffer] = []
        self.parked: JsonObj | None = None
        self.held = False          # parked with records to send: answered this turn
        self.late = _Held(self)    # answers it at the next turn if no write did
        self.moves = 0             # to the loop owning its topics (at most MAX_MOVES)
        self.timer: object = None
        self.node = -1
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
                frame = self.reader.next()
                if frame is None:
                    break
                self.server.handle(self, frame[0])
        except (WireError, ValueError, KeyError, TypeError) as e:
            log.error("CLUSTER: replication peer %s: %s", self.node, e)
            self.close(str(e))

    def on_writable(self) -> None:
        self.flush()

    def send(self, bufs: list[Buffer]) -> None:
        self.out.extend(b for b in bufs if len(b))
        self.flush()

    def flush(self) -> None:
        while self.out:
            try:
                n = self.sock.sendmsg(self.out[:64])
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self.close("write error")
                return
            while n and self.out:
                if n >= len(self.out[0]):
                    n -= len(self.out.pop(0))
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


class _Held:
    """Read again at the start of the next turn (``SelectorLoop.read_again``): answers
    a fetch held to the end of a turn that wrote nothing to its topics; when that next
    turn has work for its end, once more at the turn after (the write of the turn's
    publishes answers it first, mostly)."""

    __slots__ = ("conn", "again")

    def __init__(self, conn: _Conn) -> None:
        self.conn = conn
        self.again = False

    def on_readable(self) -> None:
        c = self.conn
        if not c.held or c.closed:
            self.again = False
            return
        if not self.again and c.loop.busy():
            # this turn has work for its end (publishes to write, most often): that
            # write answers it with its records; else the next turn does
            self.again = True
            c.loop.read_again(self)
            return
        self.again = False
        c.server._unpark(c)

    def on_writable(self) -> None:
        """Never registered."""


class _Listener:
    __slots__ = ("server", "sock")

    def __init__(self, server: ReplicationServer, sock: socket.socket) -> None:
        self.server = server
        self.sock = sock

    def on_readable(self) -> None:
        try:
            sock, _ = self.sock.accept()
        except OSError:
            return
        server = self.server
        loops = server.node.runtime.loops
        if len(server.conns) >= MAX_CONNS or not loops:
            sock.close()
            return
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        loop = loops[server.accepted % len(loops)]
        server.accepted += 1
        c = _Conn(server, loop, sock)
        with server.lock:
            server.conns.add(c)
            server.loops[id(loop)] = loop
        loop.call_soon_threadsafe(server.adopt, c)

    def on_writable(self) -> None:
        """Never registered for writing."""


class ReplicationServer(SelectorLoop):
    def __init__(self, node: NodePort, address: str) -> None:
        super().__init__("cluster-serve")
        self.node = node
        host, port = split_hostport(address)
        self.lsock = socket.create_server((host, port), reuse_port=False)
        self.lsock.setblocking(False)
        h, p = self.lsock.getsockname()[:2]
        self.address = f"{h}:{p}"
        self.conns: set[_Conn] = set()            # (under lock) every loop's
        self.loops: dict[int, EventLoop] = {}     # (under lock) loops serving some
        self.lock = threading.Lock()
        self.accepted = 0
        # topic -> ((log, epoch, offset, log end), n, raw views, size): its last read
        self._reads: dict[str, tuple[tuple[int, int, int, int], int, list[memoryview],
                                     int]] = {}
        self._read_bytes = 0
        self.selector.register(self.lsock, selectors.EVENT_READ, _Listener(self, self.lsock))

    def stop(self, timeout_s: float = 10.0) -> None:
        SelectorLoop.stop(self)
        if self.thread is not None:
            self.thread.join(timeout_s)
        with self.lock:
            conns = list(self.conns)
        for c in conns:
            c.loop.call_soon_threadsafe(c.close, "stopping")
        self.lsock.close()
        self.close()

    def adopt(self, c: _Conn) -> None:
        """On c's loop: serve it there."""
        c.loop.selector.register(c.sock, selectors.EVENT_READ, c)

    def notify(self, name: str) -> None:
        """Records were written to ``name`` (on its owner loop, at the end of a turn):
        answer the fetches parked on it, at once on this loop, soon on the others."""
        with self.lock:
            loops = list(self.loops.values())
        for loop in loops:
            if loop.in_loop_thread():
                try:
                    self._wake(loop, name)      # at once: the records are written
                except Exception:     # a bug: never into the Publisher that wrote them
                    log.exception("CLUSTER: answering the fetches of %s failed", name)
            else:
                loop.call_soon_threadsafe(self._wake, loop, name)

    def _wake(self, loop: EventLoop, name: str) -> None:
        with self.lock:
            conns = [c for c in self.conns if c.loop is loop]
        for c in conns:
            req = c.parked
            if req is not None and any(t.get("name") == name
                                       for t in need_objs(req.get("topics"))):
                self._unpark(c, final=False)

    def _unpark(self, c: _Conn, final: bool = True) -> None:
        """Answer a parked fetch: at its deadline (``final``: even with nothing to
        send), or after a write, when there is something (else it stays parked, its
        deadline kept)."""
        req = c.parked
        if req is None:
            return
        if not final and not self._fetch(c, req, again=True):
            return                   # nothing new for it (records it was sent already)
        c.parked = None
        c.held = False
        c.loop.cancel(c.timer)
        c.timer = None
        if final:
            self._fetch(c, req, final=True)
        self._more(c)

    def _more(self, c: _Conn) -> None:
        # frames that arrived while the fetch was parked
        loop = c.loop
        try:
            while c.parked is None and c.loop is loop and not c.closed:
                frame = c.reader.next()
                if frame is None:
                    break
                self.handle(c, frame[0])
        except (WireError, ValueError, KeyError, TypeError) as e:
            c.close(str(e))

    def _read(self, r: Replica, offset: int, written: int,
              budget: int) -> tuple[int, list[memoryview], int] | None:
        """(n, raw bytes as views, their size) of the records from ``offset`` on, up
        to ``budget`` bytes (at least one record) or the log's end: every write
        (block) since, not only the first (None: not in the log any more). The
        followers mostly ask for the same records: the last read of each topic is kept
        while nothing was written after it (records never change under a leader's
        epoch)."""
        lg = r.topic.log
        key = (id(lg), r.epoch, offset, written)
        last = self._reads.get(r.name)
        if last is not None and last[0] == key and last[3] <= budget:
            return last[1], last[2], last[3]
        parts: list[memoryview] = []
        n = size = 0
        at = offset
        while at < written and (size < budget or not parts):
            try:
                batch = lg.read(at, 100_000, max(1, budget - size))
            except OffsetOutOfRange:
                if not parts:
                    return None
                break
            if not batch.n or batch.first != at:
                break
            k = batch.n
            raw = record_bytes(batch, k)
            if size + len(raw) > budget:
                pos = batch.pos
                # records are contiguous: the first k end where record k starts
                k = max(0 if parts else 1,
                        bisect.bisect_right(pos, pos[0] + budget - size) - 1)
                if not k:
                    break
                raw = record_bytes(batch, k)
            parts.append(raw)
            n += k
            size += len(raw)
            at += k
            if k < batch.n:
                break
        if n and offset + n == written:
            reads = self._reads
            old = reads.pop(r.name, None)
            self._read_bytes -= old[3] if old is not None else 0
            if len(reads) >= READ_CACHE_TOPICS or self._read_bytes > READ_CACHE_BYTES:
                reads.clear()
                self._read_bytes = 0
            reads[r.name] = (key, n, parts, size)
            self._read_bytes += size
        return n, parts, size

    def forget(self, c: _Conn) -> None:
        with self.lock:
            self.conns.discard(c)
        c.loop.cancel(c.timer)

    # -- requests ----------------------------------------------------------------------
    def handle(self, c: _Conn, req: JsonObj, final: bool = False) -> None:
        c.node = need_int(req.get("node", -1))
        if len(need_objs(req.get("topics", []))) > MAX_TOPICS:
            raise ValueError(f"a request names over {MAX_TOPICS} topics")
        op = req.get("op")
        if op == "epoch_end":
            c.send(encode({"topics": [self._epoch_end(t)
                                      for t in need_objs(req.get("topics"))]}))
        elif op == "fetch":
            home = self._home(req)
            if home is not None and home is not c.loop and c.parked is None \
                    and c.moves < MAX_MOVES:
                self._move(c, home, req)
            else:
                self._fetch(c, req, final=final, hold=True)
        else:
            raise ValueError(f"unknown request {op!r}")

    def _home(self, req: JsonObj) -> EventLoop | None:
        """The loop that owns the first topic of a fetch this node has (None: none):
        the connection is served there, so that its acknowledgements and the writes
        that answer it need no thread hand-off (a follower's fetcher asks, per leader,
        for the topics one of its own loops owns; with several loops here, those are
        mostly owned by one loop too)."""
        replicas = self.node.replicas
        loops = self.node.runtime.loops
        for t in need_objs(req.get("topics")):
            r = replicas.get(need_str(t.get("name")))
            if r is not None:
                owner = owner_loop(r.topic.owner)
                return owner if owner in loops else None
        return None

    def _move(self, c: _Conn, home: EventLoop, req: JsonObj) -> None:
        """On c's loop: hand c (and the fetch just read) to ``home``."""
        try:
            c.loop.selector.unregister(c.sock)
        except (KeyError, ValueError):
            pass
        c.loop = home
        c.moves += 1
        with self.lock:
            self.loops[id(home)] = home
        home.call_soon_threadsafe(self._moved, c, req)

    def _moved(self, c: _Conn, req: JsonObj) -> None:
        """On c's new loop: serve it here, beginning with the fetch it sent."""
        if c.closed:
            return
        c.writing = bool(c.out)
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if c.out else 0)
        c.loop.selector.register(c.sock, events, c)
        try:
            self.handle(c, req)
        except (WireError, ValueError, KeyError, TypeError) as e:
            log.error("CLUSTER: replication peer %s: %s", c.node, e)
            c.close(str(e))
            return
        self._more(c)

    def _epoch_end(self, t: JsonObj) -> JsonObj:
        name = need_str(t.get("name"))
        r = self.node.replicas.get(name)
        if r is None or r.role != LEADER:
            return {"name": name, "error": "not_leader"}
        e, end = r.history.end_for_epoch(need_int(t.get("epoch")), r.topic.log.written)
        return {"name": name, "epoch": e, "end": end, "leader_epoch": r.epoch,
                "history": [[e, s] for e, s in r.history.entries],
                "written": r.topic.log.written}

    def _fetch(self, c: _Conn, req: JsonObj, final: bool = False,
               again: bool = False, hold: bool = False) -> bool:
        """Answer a fetch (True), or leave it to wait for records (False): parked
        here unless ``again`` (it is parked already; its acknowledgement was posted).
        ``hold``: a fetch just read: its acknowledgement is posted now and, when it has
        something to be sent, it is answered at the end of this turn (``notify``, or
        the next turn's start: ``read_again``), so that the answer also carries what
        this turn's publishes append; else it is parked."""
        wait_ms = min(need_int(req.get("wait_ms", 0)), MAX_WAIT_MS)
        if hold and wait_ms > 0 and not final:
            c.parked = req
            if self._acknowledge(c, req):
                c.held = True
                c.loop.read_again(c.late)
            else:
                c.timer = c.loop.call_later(wait_ms * 1_000_000, self._unpark, c)
            return False
        node = self.node
        budget = min(need_int(req.get("max_bytes", MAX_FETCH_BYTES)), MAX_FETCH_BYTES)
        out: list[Json] = []
        posts: list[tuple[Replica, int, int]] = []
        blobs: list[memoryview] = []
        at = 0
        any_data = False
        for t in need_objs(req.get("topics")):
            name = need_str(t.get("name"))
            r = node.replicas.get(name)
            if r is None or r.role != LEADER:
                out.append({"name": name, "error": "not_leader"})
                any_data = True
                continue
            if need_int(t.get("epoch")) != r.epoch:
                out.append({"name": name, "error": "epoch", "epoch": r.epoch})
                any_data = True
                continue
            lg = r.topic.log
            offset = need_int(t.get("offset"))
            if offset < 0:
                raise ValueError(f"offset {offset} asked")
            written = lg.written
            entry: JsonObj = {"name": name, "hw": r.hw}
            hist = r.history.entries
            if not hist or t.get("hist") != [len(hist), *hist[-1]]:
                # changed since it last heard
                entry["history"] = [[e, s] for e, s in hist]
            if offset > written:
                entry["error"] = "offset"      # it holds more: truncate again
                out.append(entry)
                any_data = True
                continue
            sent_to = offset
            if r.chan_version > need_int(t.get("version", 0)):
                # ChannelState documents are JSON
                entry["channels"] = cast(JsonObj, dict(r.channels))
                entry["version"] = r.chan_version
                any_data = True
            if offset < written and budget > 0:
                read = self._read(r, offset, written, budget)
                if read is None:
                    entry["error"] = "out_of_range"
                    out.append(entry)
                    any_data = True
                    continue
                n, raws, size = read
                if n:
                    sent_to = offset + n
                    entry["first"] = offset
                    entry["blob"] = [at, size]
                    blobs.extend(raws)
                    at += size
                    budget -= size
                    any_data = True
            # what it holds is its acknowledgement; it caught up if this answer
            # leaves nothing behind
            posts.append((r, offset, sent_to if sent_to < written else written))
            out.append(entry)
        if not any_data and wait_ms > 0 and not final:
            if again:
                return False
            c.parked = req
            c.timer = c.loop.call_later(wait_ms * 1_000_000, self._unpark, c)
            answered = False
        else:
            c.send(encode({"topics": out}, *blobs))
            answered = True
        for r, offset, sent_end in posts:
            owner = owner_loop(r.topic.owner)
            if owner is c.loop:
                r.fetched(c.node, offset, sent_end)
            else:
                owner.call_soon_threadsafe(r.fetched, c.node, offset, sent_end)
        return answered

    def _acknowledge(self, c: _Conn, req: JsonObj) -> bool:
        """Post a fetch's acknowledgements (what the follower holds of each topic);
        True when an answer would carry something (records, an error, an epoch
        history or channel states it lacks). Nothing is read or encoded here."""
        node = self.node
        something = False
        for t in need_objs(req.get("topics")):
            r = node.replicas.get(need_str(t.get("name")))
            if r is None or r.role != LEADER or need_int(t.get("epoch")) != r.epoch:
                something = True
                continue
            offset = need_int(t.get("offset"))
            if offset < 0:
                raise ValueError(f"offset {offset} asked")
            hist = r.history.entries
            if offset != r.topic.log.written or r.chan_version > need_int(
                    t.get("version", 0)) or not hist or t.get("hist") != [len(hist),
                                                                          *hist[-1]]:
                something = True
            owner = owner_loop(r.topic.owner)
            if owner is c.loop:
                r.acked(c.node, offset)
            else:
                owner.call_soon_threadsafe(r.acked, c.node, offset)
        return something


__all__ = ["MAX_FETCH_BYTES", "ReplicationServer", "record_bytes"]
