"""ReplicationServer: the leader side of replication, listening on ``cluster_address``
(a connection NSQ clients never see; frames of pybroker.cluster.wire). Its own thread
(``cluster-serve``) only accepts: each connection is handed to an event loop (in turn)
and, at its first fetch, moved to the loop that owns the topics it fetches (the first
one named; at most MAX_MOVES times), so that on the loop that owns the topics (all of
them, with the default one loop) a follower's acknowledgement moves the high watermark
and a write answers a parked fetch without a thread in between.

Requests (fetches one at a time per connection, answered in order; forwarded publishes
pipelined, each answered by its id as it settles):
- ``{"op": "epoch_end", "node", "topics": [{"name", "epoch"}]}``: where each asked
  epoch ends in this leader's log (``EpochHistory.end_for_epoch``), for the follower's
  truncation;
- ``{"op": "fetch", "node", "wait_ms", "max_bytes", "parts", "topics": [{"name", "epoch",
  "offset", "version", "hist"}]}``: ``offset`` is what the follower holds (its
  acknowledgement, posted when the fetch is read: ``Replica.acked`` on the topic's
  owner loop) and where it reads next. The answer carries, per topic, the records from
  there (raw log bytes in the blob: every write since, pybroker.cluster.reads), the
  high watermark, the epoch history when it differs from what ``hist`` says the
  follower holds, and the channel states when the follower's ``version`` is older:
  to a fetch with ``"parts": 1``, of each channel what the follower lacks
  (``"parts"``, pybroker.cluster.states; Replica.states_for), else all of them as one
  JSON object made off the loops, in the blob (``"states": [at, length]``, with each
  channel's floor in ``"floors"``; Replica.shipped_states). It
  is sent at the loop's next idle moment (``SelectorLoop.when_idle``: a look finds no
  event, at most IDLE_MAX_NS later), after the writes of the turns until then, so that
  one answer carries the publishes that arrive together; every follower's answer waits
  for the same moment (none stays a write behind the others). With no record to send,
  the request waits (long poll) until a write (then it is answered at the next idle
  moment too) or ``wait_ms`` (at most MAX_WAIT_MS);
- ``{"op": "publish", "id", "node", "topic", "kind": "pub"|"dpub"|"mpub", "defer_ns"}``
  with the message (``pub``, ``dpub``) or the MPUB body as NSQ frames it (``mpub``) in
  the blob: a publish another node took from its client and forwards here
  (pybroker.cluster.forward), checked as the NSQ command would be (refused with that
  command's error, by id), appended as a client's, and answered ``{"id"}`` once
  acknowledged, or ``{"id", "error"}`` with the error frame's text that command would
  have got (a node that does not lead the topic says so, ``ports.NOT_LEADER``: the
  sender tries the next leader). Unlike the node's NSQ port, this
  one asks no TLS and no AUTH of the sender: the nodes of a cluster trust each other
  (the sending node checked its client), and NSQ clients never see this port;
- a compact fetch (wire.COMPACT_FETCH, once a JSON answer said ``"compact": 1``): the
  connection's last JSON fetch, kept checked (pybroker.cluster.fetchreq.Fetch), with
  new offsets; answered compact (wire.COMPACT_ANSWER) when every topic's answer is
  records and a high watermark only, else in JSON. The steady state of one topic (the
  follower holds this epoch's history and the newest channel states, and the
  connection is on the topic's owner loop) is served in few steps (``_steady_fetch``,
  ``_steady_answer``), the same answer the general path would make; a parked fetch
  waits under one timer per connection (``_park``), moved on only when it fires early.

Budgets: ``max_bytes`` is capped at MAX_FETCH_BYTES per answer; a request frame over
MAX_REQUEST and the node's ``max_body_size`` (``serveconn.request_limit``; or a head
over the wire's limit) drops the connection from its header, so a connection buffers at
most that much (pybroker.cluster.serveconn); forwarded publishes waiting for their
acknowledgement hold at most FORWARDED_BYTES a connection (more are refused with an
error answer, not read into memory unbounded), and one naming over
MAX_TOPICS topics drops it too (a request is served on an event loop); at most
MAX_CONNS connections. The last read of each topic is kept for the next follower that
asks for the same records (pybroker.cluster.reads: bounded in topics and bytes;
records are sent from it uncopied).
"""
from __future__ import annotations

import logging
import selectors
import socket
import threading
from collections.abc import Callable, Sequence
from time import monotonic_ns
from typing import TYPE_CHECKING, cast

from pybroker.cluster.fetchreq import MAX_FETCH_BYTES, Fetch
from pybroker.cluster.ports import NOT_LEADER, Json, JsonObj, need_int, need_objs, need_str
from pybroker.cluster.reads import LastReads, record_bytes
from pybroker.cluster.replica import LEADER, Replica
from pybroker.cluster.serveconn import MAX_REQUEST, FollowerConn, request_limit
from pybroker.cluster.wire import (MAX_TOPICS, WireError, encode, encode_compact_answer,
                                   encode_compact_one, is_json, parse_compact_fetch,
                                   parse_head)
from pybroker import _native
from pybroker.config import split_hostport
from pybroker.errors import BadTopic, ClientError, DpubFailed, Invalid, MpubFailed, \
    PubFailed, go_quote
from pybroker.evloop import REPLY_SPIN_NS, SelectorLoop
from pybroker.protocol.decoder import mpub_body_error, size_error
from pybroker.protocol.names import is_valid_name
from pybroker.server.services import owner_loop

if TYPE_CHECKING:
    from pybroker.cluster.nodeport import NodePort
    from pybroker.config import Options
    from pybroker.server.loop import EventLoop

log = logging.getLogger("pybroker")
MAX_CONNS = 64
MAX_MOVES = 8                 # a connection changes loops at most this often
FORWARDED_BYTES = 64 * 1024 * 1024   # forwarded publishes awaiting an answer, a connection
# a forwarded publish's kind: the error its NSQ command fails with, and its verb
_VERBS: dict[str, tuple[type[ClientError], str]] = {
    "pub": (PubFailed, "PUB"), "dpub": (DpubFailed, "DPUB"), "mpub": (MpubFailed, "MPUB")}


def _refusal(verb: str, kind: str, name: str, defer_ns: int, body: bytes, o: Options
             ) -> ClientError | list[bytes] | tuple[bytes, Sequence[int], Sequence[int]]:
    """A forwarded publish as its NSQ command would be checked here: the error that
    command would get, or its payload (the message, or the MPUB body with its parts)."""
    if not is_valid_name(name):
        return BadTopic(f"{verb} topic name {go_quote(name)} is not valid")
    if defer_ns and (kind != "dpub" or not 0 < defer_ns <= o.max_req_timeout):
        return Invalid(f"{verb} timeout {defer_ns // 1_000_000} out of range "
                       f"0-{o.max_req_timeout // 1_000_000}")
    if kind == "mpub":
        try:
            offs, lens = _native.mpub_parts(body, o.max_msg_size, (o.max_body_size - 4) // 5)
        except _native.ScanError as e:
            return mpub_body_error(e, o.max_msg_size, len(body))
        return body, offs, lens
    if not 0 < len(body) <= o.max_msg_size:
        return size_error(verb.encode(), _native.E_MSG_SIZE, len(body), o.max_msg_size,
                          o.max_body_size)
    return [body]


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
        c = FollowerConn(server, loop, sock, server.max_request)
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
        self.conns: set[FollowerConn] = set()            # (under lock) every loop's
        self.loops: dict[int, EventLoop] = {}     # (under lock) loops serving some
        self.lock = threading.Lock()
        self.accepted = 0
        self.max_request = request_limit(int(node.options.max_body_size))
        self.reads = LastReads()
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

    def serves(self, loop: EventLoop) -> bool:
        """Does a follower's connection live on loop now (any thread)?"""
        with self.lock:
            return any(c.loop is loop for c in self.conns)

    def adopt(self, c: FollowerConn) -> None:
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
            if req is not None and name in req.names:
                loop.when_idle(c, self._answer_idle, c, loop)

    def _answer_idle(self, c: FollowerConn, loop: EventLoop) -> None:
        """The loop's idle moment after a fetch found records, or records were written
        for a parked one (``when_idle``): answered with every write since."""
        if c.loop is loop and not c.closed and c.parked is not None:
            self.unpark(c, final=c.held)

    def unpark(self, c: FollowerConn, final: bool = True) -> None:
        """Answer a parked fetch: at its deadline (``final``: even with nothing to
        send), or after a write, when there is something (else it stays parked, its
        deadline kept)."""
        req = c.parked
        if req is None:
            return
        # (a parked fetch's acknowledgement was posted when it was read)
        if req.compact and len(req.wants) == 1 and self._steady_answer(c, req):
            self._more(c)
            return
        if not final and not self._fetch(c, req, again=True, acked=True):
            return                   # nothing new for it (records it was sent already)
        c.parked = None
        c.held = False
        if final:
            self._fetch(c, req, final=True, acked=True)
        self._more(c)

    def _wait(self, c: FollowerConn, req: Fetch, something: bool) -> None:
        """A fetch just read, its acknowledgement posted: answered at the loop's next
        idle moment, after the writes of the turns until then, when it has
        ``something`` to be sent (held), else parked."""
        if something:
            c.held = True
            c.loop.when_idle(c, self._answer_idle, c, c.loop)
        else:
            self._park(c, req)

    def _park(self, c: FollowerConn, req: Fetch) -> None:
        """Park a fetch until a write or its deadline. One timer per connection, moved
        on only when it fires before the deadline of the fetch parked then (a fetch is
        parked and answered every round: no timer made and cancelled for each)."""
        c.parked = req
        wait_ns = req.wait_ms * 1_000_000
        c.deadline = monotonic_ns() + wait_ns
        if c.timer is None:
            c.timer = c.loop.call_later(wait_ns, self._due, c)

    def _due(self, c: FollowerConn) -> None:
        """The connection's timer: answer the parked fetch if its deadline passed."""
        c.timer = None
        if c.parked is None or c.held or c.closed:
            return
        left = c.deadline - monotonic_ns()
        if left > 0:
            c.timer = c.loop.call_later(left, self._due, c)
        else:
            self.unpark(c)

    def _more(self, c: FollowerConn) -> None:
        # frames that arrived while the fetch was parked
        loop = c.loop
        try:
            while c.parked is None and c.loop is loop and not c.closed:
                frame = c.reader.next_raw()
                if frame is None:
                    break
                self.handle_raw(c, frame[0], frame[1])
        except (WireError, ValueError, KeyError, TypeError) as e:
            c.close(str(e))

    def forget(self, c: FollowerConn) -> None:
        with self.lock:
            self.conns.discard(c)
        c.loop.cancel(c.timer)
        c.timer = None
        if c.plan is None or c.node < 0:
            return
        # what it said it holds is not believed for an in-sync add until it fetches
        # again (LeaderState.disconnected)
        for t in c.plan.wants:
            r = self.node.replicas.get(t.name)
            if r is not None:
                owner = owner_loop(r.topic.owner)
                if owner is c.loop:
                    r.follower_gone(c.node)
                else:
                    owner.call_soon_threadsafe(r.follower_gone, c.node)

    # -- requests ----------------------------------------------------------------------
    def handle_raw(self, c: FollowerConn, head: bytes, blob: memoryview) -> None:
        """A request frame: its head JSON (checked here, once), or a compact fetch
        (wire.COMPACT_FETCH): the connection's last JSON fetch again, with new offsets
        (and wait and budget); its blob (only a forwarded publish has one)."""
        if not is_json(head):
            node, wait_ms, max_bytes, offsets = parse_compact_fetch(head)
            fetch = c.plan
            if fetch is None:
                raise WireError("a compact fetch before any fetch")
            if node != c.node or len(offsets) != len(fetch.wants):
                raise WireError(f"a compact fetch of node {node}, {len(offsets)} topics, "
                                f"after a fetch of node {c.node}, {len(fetch.wants)} "
                                "topics")
            fetch.renew(wait_ms, max_bytes, offsets)
            if len(offsets) != 1 or not self._steady_fetch(c, fetch):
                self.handle(c, fetch)
            return
        req = parse_head(head)
        if req.get("op") == "publish":
            self._publish(c, req, blob)
            return
        c.node = need_int(req.get("node", -1))
        topics = need_objs(req.get("topics", []))
        if len(topics) > MAX_TOPICS:
            raise ValueError(f"a request names over {MAX_TOPICS} topics")
        op = req.get("op")
        if op == "epoch_end":
            c.send(encode({"topics": [self._epoch_end(t) for t in topics]}))
        elif op == "fetch":
            fetch = c.plan = Fetch(req, topics)
            self.handle(c, fetch)
        else:
            raise ValueError(f"unknown request {op!r}")

    def _publish(self, c: FollowerConn, req: JsonObj, blob: memoryview) -> None:
        """A publish forwarded by another node (on c's loop): checked as its NSQ command
        would be (what the command would be refused for is answered with that error,
        by id: nodes whose limits differ; a request without an id or a kind drops the
        connection, as nonsense does), appended as a client's, answered when settled
        (``{"id"}``, or ``{"id", "error"}``)."""
        rid = need_int(req.get("id"))
        name = need_str(req.get("topic"))
        kind = need_str(req.get("kind"))
        defer_ns = need_int(req.get("defer_ns", 0))
        failed, verb = _VERBS[kind]            # (KeyError: not a kind: dropped)
        o = c.loop.options
        body = bytes(blob)
        bad = _refusal(verb, kind, name, defer_ns, body, o)
        if isinstance(bad, ClientError):
            c.send(encode({"id": rid, "error": bad.payload().decode("utf-8", "replace")}))
            return
        payload = bad
        loop = c.loop

        def answer(err: Exception | None) -> None:
            if c.loop is not loop:          # (moved by a fetch meanwhile: answered there)
                c.loop.call_soon_threadsafe(answer, err)
                return
            c.forwarded -= len(body)
            if c.closed:
                return
            if err is None:
                c.send(encode({"id": rid}))
            else:
                text = failed(f"{verb} failed {err}").payload().decode("utf-8", "replace")
                c.send(encode({"id": rid, "error": text}))

        if self.node.diverts(name):
            # not the leader (any more): the sender asks the next one, never a chain
            c.forwarded += len(body)
            answer(RuntimeError(f"{NOT_LEADER} {name} (node {self.node.id})"))
            return
        if c.forwarded + len(body) > FORWARDED_BYTES:
            c.forwarded += len(body)
            answer(RuntimeError(f"over {FORWARDED_BYTES} bytes of forwarded publishes "
                                "wait for their acknowledgement on this leader"))
            return
        c.forwarded += len(body)
        loop.publisher.submit(name, payload, defer_ns, answer)

    def handle(self, c: FollowerConn, req: Fetch) -> None:
        home = self._home(req)
        if home is not None and home is not c.loop and c.parked is None \
                and c.moves < MAX_MOVES:
            self._move(c, home, req)
        else:
            self._fetch(c, req, hold=True)

    def _home(self, req: Fetch) -> EventLoop | None:
        """The loop that owns the first topic of a fetch this node has (None: none):
        the connection is served there, so that its acknowledgements and the writes
        that answer it need no thread hand-off (a follower's fetcher asks, per leader,
        for the topics one of its own loops owns; with several loops here, those are
        mostly owned by one loop too)."""
        replicas = self.node.replicas
        loops = self.node.runtime.loops
        for t in req.wants:
            r = replicas.get(t.name)
            if r is not None:
                owner = owner_loop(r.topic.owner)
                return owner if owner in loops else None
        return None

    def _move(self, c: FollowerConn, home: EventLoop, req: Fetch) -> None:
        """On c's loop: hand c (and the fetch just read) to ``home``."""
        try:
            c.loop.selector.unregister(c.sock)
        except (KeyError, ValueError):
            pass
        c.loop.cancel(c.timer)       # (this loop's: nothing is parked now)
        c.timer = None
        c.loop = home
        c.moves += 1
        with self.lock:
            self.loops[id(home)] = home
        home.call_soon_threadsafe(self._moved, c, req)

    def _moved(self, c: FollowerConn, req: Fetch) -> None:
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

    # -- the steady state: one topic, nothing but records ---------------------------------
    def _steady(self, c: FollowerConn, req: Fetch) -> Replica | None:
        """The replica of a one-topic fetch in the steady state, else None: this node
        leads it in the fetch's epoch, on c's loop, and the follower holds its newest
        channel states and epoch history. Then its answer is records and a high
        watermark only, and the two functions below serve it in a few steps; anything
        else takes the general path (``handle``, ``_fetch``), which answers the same."""
        w = req.wants[0]
        r = self.node.replicas.get(w.name)
        if r is None or r.role != LEADER or w.epoch != r.epoch \
                or r.topic.owner is not c.loop or r.chan_version > w.version:
            return None
        hist = r.history
        if not hist.entries or w.hist != hist.mark():
            return None
        return r

    def _steady_fetch(self, c: FollowerConn, req: Fetch) -> bool:
        """A compact fetch just read (``_fetch(hold=True)`` in few steps): its
        acknowledgement posted; held to the loop's next idle moment if records are
        there for it, else parked. False: not the steady state (nothing done)."""
        if c.parked is not None or req.wait_ms <= 0:
            return False
        r = self._steady(c, req)
        if r is None:
            return False
        offset = req.wants[0].offset
        written = r.topic.log.written
        if offset > written:
            return False
        c.quick = monotonic_ns() - c.answered_ns < REPLY_SPIN_NS
        c.parked = req
        r.acked(c.node, offset)
        self._wait(c, req, offset < written)
        return True

    def _steady_answer(self, c: FollowerConn, req: Fetch) -> bool:
        """Answer a parked compact fetch with the records it lacks (``_fetch(acked=True)``
        in few steps). False: not the steady state, or no record to send (nothing
        done)."""
        r = self._steady(c, req)
        if r is None or req.max_bytes <= 0:
            return False
        offset = req.wants[0].offset
        written = r.topic.log.written
        if offset >= written:
            return False
        read = self.reads.read(r, offset, written, req.max_bytes)
        if read is None or not read[0]:
            return False
        n, raws, size = read
        c.parked = None
        c.held = False
        c.send(encode_compact_one(offset, r.hw, size, raws))
        r.sent(c.node, min(offset + n, written))
        c.answered_ns = monotonic_ns()
        if c.quick and c.node in r.isr:
            # publishes wait for its acknowledgement, and the last one came soon
            # after its records: look for it before sleeping
            c.loop.spin_for(REPLY_SPIN_NS)
        return True

    def _epoch_end(self, t: JsonObj) -> JsonObj:
        name = need_str(t.get("name"))
        r = self.node.replicas.get(name)
        if r is None or r.role != LEADER:
            return {"name": name, "error": "not_leader"}
        e, end = r.history.end_for_epoch(need_int(t.get("epoch")), r.topic.log.written)
        return {"name": name, "epoch": e, "end": end, "leader_epoch": r.epoch,
                "history": [[e, s] for e, s in r.history.entries],
                "written": r.topic.log.written}

    def _fetch(self, c: FollowerConn, req: Fetch, final: bool = False,
               again: bool = False, hold: bool = False, acked: bool = False) -> bool:
        """Answer a fetch (True), or leave it to wait for records (False): parked
        here unless ``again`` (it is parked already; its acknowledgement was posted).
        ``hold``: a fetch just read: its acknowledgement is posted now and, when it has
        something to be sent, it is answered at the loop's next idle moment
        (``when_idle``), so that the answer also carries what the publishes until then
        append; else it is parked. ``acked``: it was parked, and its
        acknowledgement was posted then; only what the answer sent is posted now. A
        compact fetch is answered compact unless a topic's answer carries more than
        records and a high watermark."""
        wait_ms = req.wait_ms
        if hold and wait_ms > 0 and not final:
            c.parked = req
            self._wait(c, req, self._acknowledge(c, req))
            return False
        node = self.node
        budget = req.max_bytes
        out: list[Json] = []
        compact: list[tuple[int, int, int]] | None = [] if req.compact else None
        posts: list[tuple[Replica, int, int]] = []
        blobs: list[memoryview] = []
        at = 0
        any_data = False
        for t in req.wants:
            name = t.name
            r = node.replicas.get(name)
            if r is None or r.role != LEADER:
                out.append({"name": name, "error": "not_leader"})
                any_data = True
                compact = None
                continue
            if t.epoch != r.epoch:
                out.append({"name": name, "error": "epoch", "epoch": r.epoch})
                any_data = True
                compact = None
                continue
            lg = r.topic.log
            offset = t.offset
            written = lg.written
            entry: JsonObj = {"name": name, "hw": r.hw}
            hist = r.history
            if not hist.entries or t.hist != hist.mark():
                # changed since it last heard
                entry["history"] = [[e, s] for e, s in hist.entries]
                compact = None
            if offset > written:
                entry["error"] = "offset"      # it holds more: truncate again
                out.append(entry)
                any_data = True
                compact = None
                continue
            sent_to = offset
            if r.chan_version > t.version and req.parts:
                # the channel states in parts: of each channel, what the follower
                # lacks (pybroker.cluster.states), made off the loops; its spans from at
                items, pieces, length = r.states_for(t.version)
                entry["parts"] = [[*i[:5], i[5] + at, i[6], i[7] + at, i[8]]
                                  for i in cast("list[list[int]]", items)]
                blobs.extend(map(memoryview, pieces))
                at += length
                r.states_sent += length
            elif r.chan_version > t.version:
                # the channel states, one JSON object made off the loops, in the blob
                # (the follower keeps it unparsed until it takes over), and their floors
                states, length, floors = r.shipped_states()
                entry["states"] = [at, length]
                entry["floors"] = cast(Json, floors)
                blobs.extend(map(memoryview, states))
                at += length
                r.states_sent += length
            if r.chan_version > t.version:
                entry["version"] = r.chan_version
                if r.paused_shipped is not None:
                    entry["paused"] = r.paused_shipped
                    entry["released"] = r.released_shipped
                any_data = True
                compact = None
            size = 0
            if offset < written and budget > 0:
                read = self.reads.read(r, offset, written, budget)
                if read is None:
                    entry["error"] = "out_of_range"
                    entry["oldest"] = lg.oldest      # where it may fetch from (restart_at)
                    out.append(entry)
                    any_data = True
                    compact = None
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
            if compact is not None:
                compact.append((offset, r.hw, size if sent_to > offset else 0))
        if not any_data and wait_ms > 0 and not final:
            if again:
                return False
            self._park(c, req)
            answered = False
        elif compact is not None:
            c.send(encode_compact_answer(compact, blobs))      # the steady state
            answered = True
        else:
            # "compact": this leader takes compact fetches (wire.COMPACT_FETCH)
            c.send(encode({"topics": out, "compact": 1}, *blobs))
            answered = True
        for r, offset, sent_end in posts:
            owner = owner_loop(r.topic.owner)
            # (acked: posted when it was read; only what was sent is new)
            fn: Callable[..., None] = r.sent if acked else r.fetched
            args = (c.node, sent_end) if acked else (c.node, offset, sent_end)
            if owner is c.loop:
                fn(*args)
            else:
                owner.call_soon_threadsafe(fn, *args)
        return answered

    def _acknowledge(self, c: FollowerConn, req: Fetch) -> bool:
        """Post a fetch's acknowledgements (what the follower holds of each topic);
        True when an answer would carry something (records, an error, an epoch
        history or channel states it lacks). Nothing is read or encoded here."""
        node = self.node
        something = False
        for t in req.wants:
            r = node.replicas.get(t.name)
            if r is None or r.role != LEADER or t.epoch != r.epoch:
                something = True
                continue
            offset = t.offset
            hist = r.history
            if offset != r.topic.log.written or r.chan_version > t.version \
                    or not hist.entries or t.hist != hist.mark():
                something = True
            owner = owner_loop(r.topic.owner)
            if owner is c.loop:
                r.acked(c.node, offset)
            else:
                owner.call_soon_threadsafe(r.acked, c.node, offset)
        return something


__all__ = ["MAX_FETCH_BYTES", "MAX_REQUEST", "ReplicationServer", "record_bytes"]
