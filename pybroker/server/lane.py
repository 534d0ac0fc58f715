"""The publish lane: a loop turn's plain publishing connections read and published in
one pass (docs/io.md, "The publish lane").

Why: a producer that sends one PUB (or a small MPUB) and waits for its OK costs the
general path a trip through Python per command (a Command object, the verbs table, the
handler, an append of its own, a settlement of its own). nsqd pays a goroutine's few
microseconds. Here, the connections that became readable in a turn and are in the plain
steady state (``Conn.lane_kind``: magic read, no TLS or compression, nothing
held or half-parsed, not subscribed, no publish waiting, no auth server) are
collected (``taken``) instead of being read at once. At the end of the turn, before the
Publisher writes, ``run`` sorts them (``Conn.lane_kind``, once each: the others are read
the general way there and then) and receives each one's bytes into one kept buffer (one
``recv_into`` each), and one C call (``nsqf_pub_lane``) says which of them hold only
complete, valid PUB/MPUB commands to one topic, and where their messages are. Those are
appended with one record build per topic (``Publisher.lane_publish``) and answered like
any publish (an OK per command once the write of their epoch worked). Every other
connection's bytes go to its general path (``Conn.take_input``) unchanged, so
errors, odd input and every other verb are answered exactly as before.

Budget: at most PIECE bytes per connection per turn (FIN_PIECE for a subscribed one:
a line that fails, an id not in flight, costs about 8 us for its error, so a piece of
failing FIN or REQ lines is kept near 12 ms of the loop; the rest is read next turn:
the selector is level-triggered), the buffer is BUF bytes, reused every turn; at most
PARTS messages per C call; once a buffer full has been handled past TURN_NS, the
connections not yet read wait for the next turn (their sockets stay readable). The
connections read the general way (new ones, those with a command the lane does not
take) stop being read after TURN_NS of such reads too, the rest asked for again next
turn (``read_again``): 10,000 clients connecting and subscribing at once held a turn
30-50 ms. Ownership: the loop's thread only.
"""
from __future__ import annotations

import array
import errno
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from pybroker import _native
from pybroker._native.batchio import EAGAIN, BatchIO
from pybroker.errors import Exiting
from pybroker.protocol.names import is_valid_name
from pybroker.protocol.wire import MAX_LINE
from pybroker.server.handlers import acks_read, fins_read, fins_read_singles
from pybroker.server.iostate import OPEN
from pybroker.server.ports import LANE_FIN, LANE_PUB
from pybroker.server.publish import LANE_MPUB

if TYPE_CHECKING:
    from pybroker.core.channel import Channel
    from pybroker.core.topic import Topic
    from pybroker.server.ports import Conn, Loop

log = logging.getLogger("pybroker")
monotonic_ns = time.monotonic_ns
PIECE = 64 * 1024        # bytes read per connection per turn
FIN_PIECE = 32 * 1024    # the same for a subscribed connection (its FIN and REQ lines)
BUF = 2 * 1024 * 1024    # the kept receive buffer: BUF // PIECE connections per C call
TURN_NS = 4_000_000      # a turn reads more lane connections only until this much time
PARTS = 32 * 1024        # messages per C call (more: the connection takes the general path)
GENERAL_LOOK = 16        # connections read the general way between looks at the clock
_PER_CALL = BUF // PIECE  # connections read per C call (each may fill its PIECE)
NAMES = 4096             # valid topic names remembered (then forgotten, and checked again)
_FAST = _native.LANE_FAST
_FIELDS = _native.LANE_FIELDS
_FIN_SLOW = _native.FIN_LANE_SLOW


class Lane:
    """One per event loop (see the module)."""

    def __init__(self, loop: Loop) -> None:
        self.loop = loop
        o = loop.options
        self.taken: list[Conn] = []     # readable this turn, read at its end (run)
        self.fins: list[Conn] = []      # of those, the subscribed ones (run_fins)
        self.fin_scanner = _native.FinLane(FIN_PIECE // 21 * _PER_CALL)
        self.buf = bytearray(BUF)
        self.batch_io = BatchIO()      # the reads into buf
        self.view = memoryview(self.buf)
        self.scanner = _native.PubLane(MAX_LINE, o.max_msg_size, o.max_body_size, PARTS)
        self._names: dict[bytes, str] = {}

    def enabled(self) -> bool:
        """The lane applies to this loop's connections now: no auth server to ask, no
        per-command debug log. (A replicated topic this node does not lead, or may not
        take publishes for now, goes the general way: ``_publish``.)"""
        loop = self.loop
        return loop.runtime.auth is None and not log.isEnabledFor(logging.DEBUG)

    def run(self) -> None:
        """The end of the turn: every connection taken this turn is read. Those not in a
        lane's steady state now (``Conn.lane_kind``) are read the general way at once;
        then the publishers (``_publish``). The subscribed connections are kept for
        ``run_fins``, after the Publisher's writes and the OKs they allow: their bytes
        one C call (``nsqf_fin_lane``) finds to be nothing but FIN and REQ lines or
        not (``_finish``; docs/io.md, "REQs in the FIN lane"). Then the channels
        dispatch."""
        taken, self.taken = self.taken, []
        pubs: list[Conn] = []
        fins: list[Conn] = []
        general = 0
        deadline = 0
        for conn in taken:
            kind = conn.lane_kind()
            if kind == LANE_FIN:
                fins.append(conn)
            elif kind == LANE_PUB:
                pubs.append(conn)
            elif general and general % GENERAL_LOOK == 0 and monotonic_ns() >= deadline:
                self.loop.read_again(conn)      # past TURN_NS of general reads: next turn
            else:
                if not general:
                    deadline = monotonic_ns() + TURN_NS
                conn.read_now()
                general += 1
        if general:
            # a command run the general way may have changed another connection (closed
            # it, held its input): sort those again
            pubs = _still(pubs, LANE_PUB)
            fins = _still(fins, LANE_FIN)
        if pubs:
            self._read_all(pubs, self._publish, PIECE)
        self.fins = fins

    def run_fins(self) -> None:
        """The subscribed connections ``run`` kept: read, their FINs and REQs run."""
        fins, self.fins = self.fins, []
        self._read_all(fins, self._finish, FIN_PIECE)

    def _read_all(self, conns: list[Conn],
                  handle: Callable[[list[Conn], array.array[int], array.array[int]], None],
                  piece: int) -> None:
        """One read each (at most ``piece`` bytes) into the kept buffer, a buffer full
        (BUF // PIECE connections) per C call (``BatchIO.recv_many``), then
        ``handle(batch, starts, lens)`` for those that sent bytes. Past TURN_NS the rest
        are not read this turn (their sockets stay readable: the next turn reads them)."""
        deadline = monotonic_ns() + TURN_NS
        bio = self.batch_io
        for at in range(0, len(conns), _PER_CALL):
            if at and monotonic_ns() >= deadline:
                return
            # only connections still open: a closed one's descriptor may be another's now
            chunk = [c for c in conns[at:at + _PER_CALL] if c.io is OPEN]
            got_at, got = bio.recv_many([c.sock for c in chunk], [c.fd for c in chunk],
                                        self.buf, piece)
            k = len(got)
            if k and min(got) > 0:     # the steady state: each sent something
                handle(chunk[:k], array.array("I", got_at), array.array("I", got))
                continue
            starts = array.array("I")
            lens = array.array("I")
            batch: list[Conn] = []
            for i in range(k):
                n = got[i]
                conn = chunk[i]
                if n > 0:
                    starts.append(got_at[i])
                    lens.append(n)
                    batch.append(conn)
                elif n == 0:
                    conn.take_input(b"")      # the peer closed
                elif n != -EAGAIN and n != -errno.EWOULDBLOCK:
                    conn.close(f"read error: {os.strerror(-n)}")
            if batch:
                handle(batch, starts, lens)

    def _finish(self, batch: list[Conn], starts: array.array[int],
                lens: array.array[int]) -> None:
        n = len(batch)
        res, offs, ms, stored = self.fin_scanner.scan(self.buf, starts, lens, n)
        view = self.view
        now = monotonic_ns()
        ch = batch[0].channel
        reqs = stored > 0 and max(ms[:stored]) >= 0        # REQ lines among them
        if n > 1 and not reqs and res[:n].count(1) == n and \
                all(c.channel is ch for c in batch):
            # the steady state at RDY 1: one FIN each, one channel
            assert ch is not None     # LANE_FIN: subscribed
            for conn in batch:
                conn.last_read_ns = now
            fins_read_singles(ch, batch, offs[:n], starts, view)
            return
        at = 0
        # channel -> its connections' runs of FINs: finished together (one lock)
        runs: dict[Channel, list[tuple[Conn, Sequence[int], int]]] = {}
        for i, conn in enumerate(batch):
            k = res[i]
            start = starts[i]
            if k == _FIN_SLOW:
                conn.take_input(bytes(view[start:start + lens[i]]))
                continue
            conn.last_read_ns = now
            if reqs and max(ms[at:at + k]) >= 0:
                # REQs too: this connection's lines in their order, now
                acks_read(conn, offs[at:at + k], ms[at:at + k], view[start:start + lens[i]])
                at += k
                continue
            ch = conn.channel
            assert ch is not None     # LANE_FIN: subscribed
            run = (conn, offs[at:at + k], start)
            got = runs.get(ch)
            if got is None:
                runs[ch] = [run]
            else:
                got.append(run)
            at += k
        for ch, chruns in runs.items():
            fins_read(ch, chruns, view)

    def _publish(self, batch: list[Conn], starts: array.array[int],
                 lens: array.array[int]) -> None:
        res, offs, plens, _ = self.scanner.scan(self.buf, starts, lens, len(batch))
        loop = self.loop
        now = monotonic_ns()
        # topic -> (its parts' index ranges, its connections with their commands)
        groups: dict[Topic, tuple[list[int], list[tuple[Conn, int, int]]]] = {}
        # the first connection naming a topic -> its group (None: that name goes slow)
        firsts: dict[int, tuple[list[int], list[tuple[Conn, int, int]]] | None] = {}
        slow: list[int] = []
        part = 0
        for i, conn in enumerate(batch):
            conn.last_read_ns = now
            k = _FIELDS * i
            if res[k] != _FAST:
                slow.append(i)
                continue
            msgs = res[k + 4]
            first = part
            part += msgs & ~LANE_MPUB
            same = res[k + 5]
            if same != i:       # the C scan matched its name to an earlier connection's
                group = firsts[same]
            else:
                group = firsts[i] = self._group_of(res[k + 1], res[k + 2], groups)
            if group is None:
                slow.append(i)
                continue
            ranges = group[0]
            if ranges and ranges[-1] == first:
                ranges[-1] = part
            else:
                ranges += (first, part)
            group[1].append((conn, res[k + 3], msgs))
        publisher = loop.publisher
        ts = time.time_ns()
        for topic, (ranges, conns) in groups.items():
            if len(ranges) == 2:
                o, ln = offs[ranges[0]:ranges[1]], plens[ranges[0]:ranges[1]]
            else:
                o, ln = array.array("I"), array.array("I")
                for j in range(0, len(ranges), 2):
                    o.extend(offs[ranges[j]:ranges[j + 1]])
                    ln.extend(plens[ranges[j]:ranges[j + 1]])
            if not publisher.lane_publish(topic, self.buf, o, ln, ts, conns):
                # deleted meanwhile: the general path finds (or makes) the topic anew
                slow.extend(batch.index(c) for c, _, _ in conns)
        for i in slow:
            batch[i].take_input(bytes(self.view[starts[i]:starts[i] + lens[i]]))


    def _group_of(self, at: int, n: int, groups: dict[Topic, tuple[list[int], list[
            tuple[Conn, int, int]]]]) -> tuple[list[int], list[tuple[Conn, int, int]]] | None:
        """The turn's group of the topic named by buf[at:at + n] (made if new), or None:
        its publishes go the general way (a name to refuse, a topic another loop owns or
        another node leads, or refused there; the broker exiting)."""
        raw = bytes(self.view[at:at + n])
        names = self._names
        name = names.get(raw)
        if name is None:
            if not is_valid_name(raw):
                return None     # its handler answers E_BAD_TOPIC
            if len(names) >= NAMES:
                names.clear()
            name = names[raw] = raw.decode()
        loop = self.loop
        try:
            topic = loop.runtime.broker.get_topic(name)
        except Exiting:
            return None
        cluster = loop.publisher.cluster
        if topic.owner is not loop or (cluster is not None and (
                cluster.diverts(name) or cluster.refusal(name) is not None)):
            return None     # handed to its owner, its leader, or refused there
        group = groups.get(topic)
        if group is None:
            group = groups[topic] = ([], [])
        return group


def _still(conns: list[Conn], kind: int) -> list[Conn]:
    """Those of conns still in lane ``kind``; the others are read the general way now."""
    out = []
    for conn in conns:
        if conn.lane_kind() == kind:
            out.append(conn)
        else:
            conn.read_now()
    return out


__all__ = ["BUF", "FIN_PIECE", "Lane", "PIECE"]
