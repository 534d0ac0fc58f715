"""Fetchers: the follower side of replication (Kafka's replica fetchers), one
connection per (leader node, event loop), owned by that loop: registered with its
selector, non-blocking, every step run on the loop that owns the topics it fetches.

A link loops: for the topics it follows whose divergence is not yet cut, it asks where
their last epochs end (``epoch_end``) and cuts each log there (``Replica.truncate``);
then one ``fetch`` for all of them, each naming the offset its log holds (what it has
written, in fsync mode synced: the acknowledgement), long-polled by the leader. The
records answered are appended in the same loop turn (``Replica.apply``, one call per
topic) and the next fetch goes out at once, carrying the new offsets: the
acknowledgement of this round is the request of the next, with no thread in between.
In fsync mode the next fetch waits for the storage thread's fsync of what was appended,
so the offsets a fetch names are always on this node. Once the leader's JSON answers say
``"compact": 1``, a fetch that names the same topics, epochs, versions and history
marks as the last JSON one on the connection goes out compact (offsets only:
wire.COMPACT_FETCH), and a compact answer is applied like a JSON one.

Budgets: each exchange has a deadline (the long poll plus ``IO_SLACK_NS``, however the
answer trickles); an answer whose header says more than the wire's frame limit drops
the connection before anything is allocated for it; its body is read straight into one
buffer of its size; a leader answers at most FETCH_BYTES of records per fetch, so one
round's appends hold the loop a few milliseconds at most; a failed connection is
retried after ``RETRY_NS``.

With ``max_insync_replicas`` set, a follower outside a full in-sync set is not waited
for by any OK, so once an answer finds it near the leader's end (under half a fetch's
budget) it rests ``LAZY_NS`` before the next fetch: its records come a few milliseconds
late, in bigger rounds, and neither it nor the leader wakes for every publish. It is
eager again as soon as the set has room (then it must catch up to join it) or it is a
member.

While records flow (the last answer carried some and came within ``REPLY_SPIN_NS`` of
its fetch), a compact fetch tells the loop its answer is coming (``spin_for``): the loop
looks for it before sleeping, a wake-up saved on the round's path.
"""
from __future__ import annotations

import errno
import logging
import mmap
import selectors
import socket
import threading
import time
from typing import TYPE_CHECKING

from pybroker.cluster.ports import Json, JsonObj, as_list, as_obj, need_int, need_objs
from pybroker.cluster.replica import FOLLOWER, ShippedParts, ShippedStates
from pybroker.cluster.states import parts_of
from pybroker.cluster.rules import EpochHistory, divergence
from pybroker.cluster.wire import (MAX_TOPICS, Buffer, WireError, blob_span, blob_view,
                                   encode, encode_compact_fetch, history_of, is_json,
                                   parse_compact_answer, parse_head, parse_header)
from pybroker.config import split_hostport
from pybroker.evloop import REPLY_SPIN_NS
from pybroker.server.services import owner_loop

if TYPE_CHECKING:
    from pybroker.cluster.nodeport import NodePort
    from pybroker.cluster.replica import Replica
    from pybroker.server.loop import EventLoop

log = logging.getLogger("pybroker")
WAIT_MS = 500
IO_SLACK_NS = 5_000_000_000
RETRY_NS = 200_000_000
IDLE_NS = 200_000_000          # nothing to follow: look again this often
FETCH_BYTES = 2 * 1024 * 1024
RECV_BYTES = 256 * 1024
MAPPED_BODY = 4 * 1024 * 1024   # answers this large are received into an anonymous mapping
LAZY_NS = 2_000_000            # a follower no OK waits for fetches at most this often


class Fetcher:
    """One leader's records for the topics one loop owns (every method on that loop)."""

    def __init__(self, node: NodePort, loop: EventLoop, leader: int) -> None:
        self.node = node
        self.loop = loop
        self.leader = leader
        self.address = ""
        self.topics: list[Replica] = []
        self.stopped = False
        self.sock: socket.socket | None = None
        self.connected = False
        self.out = bytearray()
        self.writing = False      # registered for writing too (``_modify``)
        self.hdr = bytearray(8)
        self.scratch = memoryview(bytearray(RECV_BYTES))
        self.got = 0
        self.body: bytearray | mmap.mmap | None = None
        self.asked: tuple[str, list[Replica]] | None = None   # the exchange under way
        self.deadline = 0         # monotonic ns: its answer is late after this
        self.pending = 0          # appends (or cuts) of this round not yet done
        self.timer: object = None
        self.idle: object = None
        self.rounds = 0           # where the next window of topics starts (over MAX_TOPICS)
        # the compact steady state (wire.COMPACT_FETCH): the leader said it takes them
        # on this connection, and what the last JSON fetch sent named of each topic
        # (a compact fetch repeats it with new offsets)
        self.compact_ok = False
        self.plan: list[tuple[Replica, int, int, list[int]]] = []
        self.rest_until = 0       # monotonic ns: a lazy follower's next fetch (0: at once)
        self.flowing = False      # the last answer carried records, soon (no rest follows)
        self.asked_ns = 0         # when the last request was sent (monotonic ns)

    def __repr__(self) -> str:
        return f"fetch-from-{self.leader}"

    # -- assignment (posted by Fetchers) -----------------------------------------------
    def assign(self, topics: list[Replica], address: str) -> None:
        self.topics = topics
        if address != self.address:
            self.address = address
            if self.sock is not None:
                self.close("the leader moved")
                return
        self.step()

    def stop(self) -> None:
        self.stopped = True
        self.close("stopping")

    # -- the loop of exchanges ---------------------------------------------------------
    def _following(self) -> list[Replica]:
        """The topics this round asks for: at most MAX_TOPICS, a window that moves on
        each round when there are more."""
        now = time.monotonic_ns()
        topics = [r for r in self.topics if r.role == FOLLOWER and r.leader == self.leader
                  and r.unsynced_from is None and r.retry_ns <= now]
        if len(topics) > MAX_TOPICS:
            self.rounds += 1
            at = (self.rounds * MAX_TOPICS) % len(topics)
            topics = (topics[at:] + topics[:at])[:MAX_TOPICS]
        return topics

    def step(self) -> None:
        """Send the next request if none is under way and nothing is being appended."""
        if self.stopped or self.asked is not None or self.pending:
            return
        self.loop.cancel(self.idle)
        self.idle = None
        if self.rest_until:
            rest = self.rest_until - time.monotonic_ns()
            if rest > 0:
                self.idle = self.loop.call_later(rest, self.step)
                return
            self.rest_until = 0
        topics = self._following()
        if not topics or not self.address:
            self.idle = self.loop.call_later(IDLE_NS, self.step)
            return
        if self.sock is None:
            try:
                self._connect()
            except (OSError, ValueError) as e:
                self._failed(f"cannot connect: {e}")
            return
        if not self.connected:
            return
        todo = [r for r in topics if r.truncated_for != r.epoch]
        if todo:
            ask: list[Json] = [{"name": r.name, "epoch": r.history.last_epoch()}
                               for r in todo]
            self._send({"op": "epoch_end", "node": self.node.id, "topics": ask},
                       ("epoch_end", todo), 0)
            return
        plan = [(r, r.epoch, r.chan_from_leader, r.history.mark()) for r in topics]
        if self.compact_ok and plan == self.plan:
            # the steady state: the same topics, epochs, versions and histories
            self._send_frame(encode_compact_fetch(
                self.node.id, WAIT_MS, FETCH_BYTES, [r.topic.log.written for r in topics]),
                ("fetch", topics), WAIT_MS * 1_000_000)
            if self.flowing:
                self.loop.spin_for(REPLY_SPIN_NS)
            return
        self.plan = plan
        fetch: list[Json] = [{"name": r.name, "epoch": epoch, "offset": r.topic.log.written,
                              "version": version, "hist": [*hist]}
                             for r, epoch, version, hist in plan]
        self._send({"op": "fetch", "node": self.node.id, "wait_ms": WAIT_MS,
                    "max_bytes": FETCH_BYTES, "parts": 1, "topics": fetch}, ("fetch", topics),
                   WAIT_MS * 1_000_000)

    def _send(self, head: JsonObj, asked: tuple[str, list[Replica]], wait_ns: int) -> None:
        self._send_frame(encode(head), asked, wait_ns)

    def _send_frame(self, frame: list[Buffer], asked: tuple[str, list[Replica]],
                    wait_ns: int) -> None:
        self.asked = asked
        # one watchdog timer, moved on only when it fires (not set and cancelled per
        # exchange: an exchange is a few hundred microseconds under load)
        self.asked_ns = time.monotonic_ns()
        self.deadline = self.asked_ns + wait_ns + IO_SLACK_NS
        if self.timer is None:
            self.timer = self.loop.call_later(wait_ns + IO_SLACK_NS, self._late)
        for b in frame:
            self.out += b
        self.on_writable()

    def _late(self) -> None:
        self.timer = None
        if self.asked is None:
            return
        left = self.deadline - time.monotonic_ns()
        if left > 0:
            self.timer = self.loop.call_later(left, self._late)
        else:
            self._failed("the leader did not answer in time")

    def _answered(self, raw: memoryview, blob: memoryview) -> None:
        assert self.asked is not None
        kind, topics = self.asked
        self.asked = None
        # records came soon after it asked: more are likely on their way as soon
        # (the next fetch looks for its answer before sleeping), unless it rests
        self.flowing = len(blob) > 0 and \
            time.monotonic_ns() - self.asked_ns < REPLY_SPIN_NS
        if kind == "fetch" and self._lazy(topics, len(blob)):
            # before the appends: one done at once asks for the next fetch from there
            self.rest_until = time.monotonic_ns() + LAZY_NS
            self.flowing = False
        if not is_json(raw):
            if kind != "fetch":
                raise WireError(f"a compact answer to {kind}")
            self._apply_compact(parse_compact_answer(raw, len(blob)), blob, topics)
        elif kind == "epoch_end":
            self._cut(parse_head(raw), topics)
        else:
            self._apply(parse_head(raw), blob, topics)
        self.step()

    def _lazy(self, topics: list[Replica], size: int) -> bool:
        """No OK waits for this node on any of these topics: the in-sync sets are
        capped (``max_insync``), full and without it, and the answer found it near
        the leader's end."""
        cap = self.node.max_insync
        me = self.node.id
        return bool(cap) and size < FETCH_BYTES // 2 and all(
            me not in r.isr and len(r.isr) >= cap for r in topics)

    def _cut(self, head: JsonObj, todo: list[Replica]) -> None:
        by_name = {t.get("name"): t for t in need_objs(head.get("topics"))}
        cuts = []
        for r in todo:
            ans = by_name.get(r.name, {})
            if "error" in ans or need_int(ans.get("leader_epoch", -1)) != r.epoch:
                continue
            leader = EpochHistory([(e, s) for e, s in history_of(ans.get("history"))])
            cuts.append((r, divergence(r.history, r.topic.log.written, leader,
                                       need_int(ans.get("written")))))
        if not cuts:
            # the leader does not lead them (yet): ask again shortly
            self.pending += 1
            self.loop.call_later(RETRY_NS // 2, self._done_one)
            return
        self.pending += len(cuts)
        for r, cut in cuts:
            r.truncate(cut, self._done_one)

    def _apply_compact(self, entries: list[tuple[int, int, int]], blob: memoryview,
                       topics: list[Replica]) -> None:
        """A compact answer (wire.COMPACT_ANSWER): per topic asked, in order, records
        and the high watermark."""
        if len(entries) != len(topics):
            raise WireError(f"a compact answer of {len(entries)} topics to a fetch "
                            f"of {len(topics)}")
        jobs = []
        at = 0
        for r, (first, hw, n) in zip(topics, entries):
            data = bytes(blob[at:at + n])
            at += n
            if n or hw > r.hw:
                jobs.append((r, first, data, hw))
        self.pending += len(jobs)
        for r, first, data, hw in jobs:
            r.apply(first, data, hw, None, None, 0, self._done_one)

    def _apply(self, head: JsonObj, blob: memoryview, topics: list[Replica]) -> None:
        if head.get("compact") == 1:
            self.compact_ok = True
        mine = {r.name: r for r in topics}
        jobs = []
        restarts: list[tuple[Replica, int]] = []
        for t in need_objs(head.get("topics")):
            r = mine.get(str(t.get("name")))
            if r is None:
                continue
            err = t.get("error")
            oldest = need_int(t.get("oldest", 0))
            if err == "out_of_range" and oldest > r.topic.log.written:
                # it lacks records the leader no longer has (its retention dropped
                # them while this node was away): begin again at the leader's oldest
                restarts.append((r, oldest))
                continue
            if err in ("offset", "out_of_range"):
                r.truncated_for = 0
                continue
            if err is not None:
                continue
            chans: JsonObj | ShippedStates | ShippedParts | None = None
            if "parts" in t:
                # each channel's pieces this node lacks (pybroker.cluster.states)
                chans = ShippedParts(parts_of(t.get("parts"), blob))
            elif "states" in t:
                # kept as a view of the frame: a copy of 35 MB of states (1,000,000
                # deferred messages) held the loop about 10 ms at each new version
                chans = ShippedStates(blob_view(blob, t.get("states")),
                                      [need_int(f) for f in as_list(t.get("floors"))])
            elif "channels" in t:
                chans = as_obj(t["channels"])      # (a leader of an earlier version)
            data = blob_span(blob, t.get("blob"))
            hw = need_int(t.get("hw", 0))
            if not data and chans is None and hw <= r.hw and "history" not in t:
                continue
            history = history_of(t["history"]) if "history" in t else None
            flag = t.get("paused")
            paused = (flag, need_int(t.get("released", 0))) \
                if isinstance(flag, bool) else None
            jobs.append((r, need_int(t.get("first", r.topic.log.written)), data, hw,
                         history, chans, need_int(t.get("version", 0)), paused))
        self.pending += len(jobs) + len(restarts)
        for r, oldest in restarts:
            r.restart_at(oldest, self._done_one)
        for r, first, data, hw, history, chans, version, paused in jobs:
            r.apply(first, data, hw, history, chans, version, self._done_one, paused)

    def _done_one(self) -> None:
        """An append (or cut) of this round is done (synced, in fsync mode): the storage
        thread says so from its own thread."""
        if not self.loop.in_loop_thread():
            self.loop.call_soon_threadsafe(self._done_one)
            return
        self.pending -= 1
        if not self.pending:
            self.step()

    # -- the socket ---------------------------------------------------------------------
    def _connect(self) -> None:
        host, port = split_hostport(self.address)
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                             socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.connected = False
        err = sock.connect_ex((host, port))
        if err not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
            raise OSError(err, f"connect to {self.address} failed: {errno.errorcode.get(err)}")
        self.loop.selector.register(sock, selectors.EVENT_WRITE, self)
        self.writing = True       # (connecting: registered for writing only)
        self.timer = self.loop.call_later(IO_SLACK_NS, self._late_connect)

    def _late_connect(self) -> None:
        self.timer = None
        if not self.connected and self.sock is not None:
            self._failed("connect timed out")

    def on_writable(self) -> None:
        sock = self.sock
        if sock is None:
            return
        if not self.connected:
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                self._failed(f"connect failed: {err}")
                return
            self.connected = True
            self.loop.cancel(self.timer)
            self.timer = None
            self._modify()
            self.step()
            return
        if self.out:
            try:
                n = sock.send(self.out)
                del self.out[:n]
            except (BlockingIOError, InterruptedError):
                pass
            except OSError as e:
                self._failed(f"write error: {e}")
                return
        self._modify()

    def _modify(self) -> None:
        if self.sock is None or bool(self.out) == self.writing:
            return              # (registered so already: every round's fetch is sent whole)
        self.writing = bool(self.out)
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if self.out else 0)
        try:
            self.loop.selector.modify(self.sock, events, self)
        except (KeyError, ValueError):
            pass

    def on_readable(self) -> None:
        sock = self.sock
        if sock is None or not self.connected:
            return
        try:
            while True:
                if self.body is None:
                    # one read for the header and, mostly, the whole answer
                    n = sock.recv_into(self.scratch)
                    if not n:
                        self._failed("the leader closed the connection")
                        return
                    take = min(n, 8 - self.got)
                    self.hdr[self.got:self.got + take] = self.scratch[:take]
                    self.got += take
                    if self.got < 8:
                        return
                    size, _ = parse_header(self.hdr)
                    if n - take > size - 4:
                        raise WireError("the leader sent more than it was asked for")
                    # a large answer (channel states) in pages mapped as it arrives: a
                    # bytearray is zeroed whole first (35 MB of states held the loop
                    # 10-20 ms)
                    self.body = mmap.mmap(-1, size - 4) if size - 4 >= MAPPED_BODY \
                        else bytearray(size - 4)
                    self.body[:n - take] = self.scratch[take:n]
                    self.got = n - take
                body = self.body
                if self.got < len(body):
                    n = sock.recv_into(memoryview(body)[self.got:])
                    if not n:
                        self._failed("the leader closed the connection")
                        return
                    self.got += n
                    if self.got < len(body):
                        return
                self.body, self.got = None, 0
                _, hlen = parse_header(self.hdr)
                view = memoryview(body)
                if self.asked is None:
                    raise WireError("an answer to no request")
                self._answered(view[:hlen], view[hlen:])
                # one answer per request: nothing more is due until the next request
                # (sent by now) is answered, and the selector is level-triggered, so
                # no read that would only say EAGAIN
                return
        except (BlockingIOError, InterruptedError):
            return
        except (OSError, WireError, ValueError, KeyError, TypeError) as e:
            self._failed(str(e))

    def _failed(self, why: str) -> None:
        if not self.stopped:
            log.warning("CLUSTER: fetching from node %d (%s): %s", self.leader,
                        self.address, why)
        self.close(why)

    def close(self, why: str) -> None:
        """Drop the connection (an exchange under way is forgotten; appends already
        started finish, and the next round, after RETRY_NS or at once if the leader
        moved, asks again from what the logs hold)."""
        self.loop.cancel(self.timer)
        self.timer = None
        self.loop.cancel(self.idle)
        self.idle = None
        self.asked = None
        self.compact_ok = False
        self.plan = []
        self.out.clear()
        self.body, self.got = None, 0
        sock, self.sock = self.sock, None
        self.connected = False
        if sock is not None:
            try:
                self.loop.selector.unregister(sock)
            except (KeyError, ValueError):
                pass
            sock.close()
        if not self.stopped:
            self.idle = self.loop.call_later(0 if why == "the leader moved" else RETRY_NS,
                                             self.step)


class Fetchers:
    """The links, by (leader node, loop); assigned by the coordinator's thread, each
    link touched only on its loop."""

    def __init__(self, node: NodePort) -> None:
        self.node = node
        self.links: dict[tuple[int, int], Fetcher] = {}     # (leader, id(loop)) -> link
        self.lock = threading.Lock()

    def assign(self, by_leader: dict[int, list[Replica]], addresses: dict[int, str]) -> None:
        with self.lock:
            want: dict[tuple[int, int], tuple[EventLoop, list[Replica]]] = {}
            for leader, reps in by_leader.items():
                for r in reps:
                    loop = owner_loop(r.topic.owner)
                    want.setdefault((leader, id(loop)), (loop, []))[1].append(r)
            for key, (loop, reps) in want.items():
                f = self.links.get(key)
                if f is None:
                    f = self.links[key] = Fetcher(self.node, loop, key[0])
                loop.call_soon_threadsafe(f.assign, reps, addresses.get(key[0], ""))
            for key, f in self.links.items():
                if key not in want:
                    f.loop.call_soon_threadsafe(f.assign, [], f.address)

    def stop(self, timeout_s: float) -> None:
        """Close every link (on its loop; ``timeout_s`` is not waited: nothing here has
        a thread of its own)."""
        with self.lock:
            links = list(self.links.values())
        for f in links:
            f.loop.call_soon_threadsafe(f.stop)


__all__ = ["Fetcher", "Fetchers"]
