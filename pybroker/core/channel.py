"""Channel: a cursor over its topic's log, plus the state only it needs (docs/storage.md).

A channel holds no message bodies. Its per-message state is keyed by log offset (a
message id is its offset in 16 hex digits) and changes only in the transitions of
``pybroker.core.lifecycle.Lifecycle`` (the state table of docs/storage.md), which this
class extends with what needs the log and the consumers: reading records at the cursor
or by offset, handing them to ready consumers round-robin, and building dead letters.

Dead letters (docs/dead-letters.md): with ``max_attempts`` set, a requeued message that
would go out for the (max_attempts+1)-th time is handed to the owner loop to be published
to the dead-letter topic instead, at most ``DEAD_BATCH`` at a time (their envelopes are
built as each record is read, so no read stays alive); until that publish is confirmed
it is dying, then finished. A message that would re-enter a topic it was already
dead-lettered from is not moved again.

Ownership: a channel is owned by one event loop (``owner``, chosen by hashing its name);
only that loop's thread calls dispatch/finish/requeue/touch/empty/rewind and changes
consumers. The queue-scanner threads call ``expire`` only.
"""
from __future__ import annotations

import array
import bisect
import itertools
import logging
import random
from typing import TYPE_CHECKING

from pybroker._native.inflight import sort_order
from pybroker.core.deferred import Chunks
from pybroker.core.flight import Consumer, Deferred, Flight, offset_of
from pybroker.core.lifecycle import ChannelState, Lifecycle, Litter
from pybroker.errors import TooManyConsumers
from pybroker.protocol.deadletter import (KEEP_CHANNEL, DeadLetterSettings, dead_letter_target,
                                          wrap)

if TYPE_CHECKING:
    from pybroker.core.seams import Batch, LogReader, Owner, TopicView
    from pybroker.core.skip import Skip
    from pybroker.core.stats import LatencyWindow

__all__ = ["Channel", "Consumer", "Deferred", "Flight", "offset_of"]

# skipped DPUBs a sorted block of their deliver-at times covers (_skipped_dpubs): a
# count walks at most one block and bisects each of the others
DUE_BLOCK = 4096
log = logging.getLogger("pybroker")
# the most records one dispatch reads per consumer turn (bounds the work of one call)
READ_BATCH = 2500
READ_BYTES = 4 * 1024 * 1024
# records one dispatch call may hand out in total before yielding the loop
DISPATCH_BUDGET = 20_000
# dead letters handed to the owner loop at once: the envelopes in memory are bounded by
# this many messages and bytes, whatever the burst; the rest go on the next turn
DEAD_BATCH = 256
DEAD_BATCH_BYTES = 4 * 1024 * 1024
# the requeued messages' reader reads at least this much at a time (they are sparse)
REQUEUE_MIN_READ = 4096


class Channel(Lifecycle):
    """One channel of a topic. See the module docstring for who may call what."""

    def __init__(self, topic: TopicView, name: str, owner: Owner[Channel], ephemeral: bool,
                 cursor: int) -> None:
        super().__init__(cursor)
        self.topic = topic
        self.topic_name = topic.name
        self.name = name
        self.owner = owner
        self.ephemeral = ephemeral
        self.consumers: list[Consumer] = []
        self._rr = 0
        self.paused = False
        self.deleted = False
        # end-to-end latency window, created on the first FIN when e2e percentiles are set
        self.e2e: LatencyWindow | None = None
        # dead letters: settings given for this channel (over HTTP; kept in nsqd.dat),
        # else the topic's defaults (from the config)
        self.dl_settings: DeadLetterSettings = {}
        self.max_attempts = 0
        self.dead_letter_topic: str | None = None   # where dead letters go (None: nowhere)
        self.configure_dead_letters({})
        # readers of the log (storage/cursor.py), made on the first read: one at the
        # cursor, one for requeued messages (their reads would make the first seek)
        self._reader: LogReader | None = None
        self._requeue_reader: LogReader | None = None
        # the DPUBs among skip's offsets (_skipped_dpubs): (that skip, the DPUBs'
        # changes then, their offsets, their deliver-at times, and those times sorted
        # in blocks of DUE_BLOCK)
        self._skip_dpubs: tuple[Skip, int, array.array[int], array.array[int],
                                list[array.array[int]]] | None = None

    def __repr__(self) -> str:
        return f"Channel({self.topic_name}/{self.name})"

    # -- consumers (owner thread) ---------------------------------------------------
    def add_consumer(self, c: Consumer, max_consumers: int) -> None:
        if max_consumers and len(self.consumers) >= max_consumers:
            raise TooManyConsumers(f"consumers for {self.topic_name}:{self.name} "
                                   f"exceeds limit of {max_consumers}")
        self.consumers.append(c)

    def remove_consumer(self, c: Consumer) -> int:
        """Detach c and requeue its in-flight messages at once (the steps of ``leave``
        all taken now; the loop takes them a turn each); returns how many."""
        if not self.detach(c) or not self.leave((c,)):
            return 0
        n, more = 0, True
        while more:
            k, more = self.requeue_step()
            n += k
        return n

    def detach(self, c: Consumer) -> bool:
        """c is no consumer of this channel from now on (False: it was none); what it
        holds in flight stays in flight until ``leave`` and ``requeue_step`` requeue
        it (the loop's, from the end of the turn on: ``EventLoop.consumer_leaving``)."""
        try:
            self.consumers.remove(c)
        except ValueError:
            return False
        if not self.consumers:
            self.release_readers()
        return True

    def empty(self) -> list[Litter]:
        """Drop every message the channel holds (Lifecycle._empty), its consumers
        holding nothing in flight after; returns what to free (``freeing``)."""
        return self._empty(self.consumers)

    def release_readers(self) -> None:
        """Close the log readers' files and drop their buffers (no one reads now)."""
        for r in (self._reader, self._requeue_reader):
            if r is not None:
                r.release()

    # -- dead letters ---------------------------------------------------------------
    def configure_dead_letters(self, settings: DeadLetterSettings) -> None:
        """Take this channel's own settings (``max_attempts``, ``dead_letter_topic``;
        a missing key means the topic's default) and resolve where dead letters go."""
        self.dl_settings = settings.copy()
        default_max, default_topic = self.topic.dl_defaults
        self.max_attempts = int(settings.get("max_attempts", default_max))
        name = str(settings.get("dead_letter_topic", default_topic))
        self.dead_letter_topic = dead_letter_target(self.topic_name, name)
        if not self.max_attempts:
            self.delivery_times.clear()

    def _envelope(self, off: int, attempts: int, batch: Batch, i: int, target: str,
                  now_ns: int, wall_ns: int) -> bytes | None:
        """The dead letter of record i of batch (bytes copied: the read may go), or
        None if the message was already dead-lettered from ``target`` (a cycle)."""
        seen = self.delivery_times.get(off)
        first_ns, last_ns = seen if seen is not None else (now_ns, now_ns)
        return wrap(topic=self.topic_name, channel=self.name, offset=off,
                    attempts=attempts + batch.stored_attempts(i),
                    first_delivery_ms=(wall_ns - (now_ns - first_ns)) // 1_000_000,
                    last_delivery_ms=(wall_ns - (now_ns - last_ns)) // 1_000_000,
                    dead_at_ms=wall_ns // 1_000_000,
                    published_ms=batch.ts_ns(i) // 1_000_000,
                    body=batch.payload(i)[34:], target=target)

    def _cycle(self, off: int, first_time: bool) -> bool:
        """A message out of attempts whose dead-letter topic it already left: finished
        here when this topic's dead-letters channel keeps it (True); else it stays,
        delivered as nsqd would (False). Counted and logged once (``first_time``: it
        has just run out of attempts)."""
        kept = self.name != KEEP_CHANNEL and KEEP_CHANNEL in self.topic.channels
        if kept or first_time:
            log.warning("CHANNEL(%s/%s): message %016x is out of attempts but was already "
                        "dead-lettered from %s: not moved again (%s)", self.topic_name,
                        self.name, off, self.dead_letter_topic,
                        "kept by this topic's dead-letters channel" if kept
                        else "delivered again")
            self._not_moved(off, kept)
        return kept

    # -- counts (owner thread; also read for stats) ---------------------------------
    @property
    def message_count(self) -> int:
        """Messages this channel was given (nsqd counts each put to the channel)."""
        return max(0, self.topic.released - self.start_offset) + self.extra_count

    def _dpubs_ahead(self, wall_ns: int) -> int:
        n = self.topic.deferred_ahead(self.cursor, wall_ns)
        if n and self.skip:
            n -= self._skipped_dpubs(wall_ns)   # held elsewhere: counted there
        return n

    def _skipped_dpubs(self, wall_ns: int) -> int:
        """How many of skip's offsets are DPUBs not yet due. The DPUBs among them are
        found once per skip (after a rewind or a restore it only loses its head, as
        the cursor passes it) and per change of the topic's DPUBs other than appends,
        with their deliver-at times also sorted in blocks of DUE_BLOCK; then counted
        from the cursor on: the block the cursor is in walked, each block after it one
        bisection. /stats asks this twice per channel: a walk over the times of
        250,000 skipped DPUBs took 10 ms a call."""
        dp = self.topic.dpubs
        found = self._skip_dpubs
        if found is None or found[0] is not self.skip or found[1] != dp.changes:
            # only skip's offsets within the DPUBs' span are looked up (a rewind's
            # skip is often wholly below DPUBs published since: then none)
            skip = self.skip
            offs, dues = array.array("q"), array.array("q")
            if dp and skip:
                lo = max(skip.first(), dp.peekitem(0)[0])
                hi = min(skip.last(), dp.peekitem(-1)[0])
                if lo <= hi:
                    offs, dues = dp.among(skip.span(lo, hi))
            blocks = [dues[i:i + DUE_BLOCK] for i in range(0, len(dues), DUE_BLOCK)]
            for block in blocks:
                sort_order(block)       # in place, in C
            found = self._skip_dpubs = (self.skip, dp.changes, offs, dues, blocks)
        _, _, offs, dues, blocks = found
        i = bisect.bisect_left(offs, self.cursor)
        b = i // DUE_BLOCK + 1          # the blocks wholly from the cursor on
        n = sum(1 for at in dues[i:b * DUE_BLOCK] if at > wall_ns)
        for block in blocks[b:]:
            n += len(block) - bisect.bisect_right(block, wall_ns)
        return n

    def depth(self, wall_ns: int) -> int:
        """Queued messages: released and not yet handed out, plus requeued ones (not in
        flight or deferred; DPUBs not yet read and not yet due count as deferred)."""
        t = self.topic
        ahead = t.released - self.cursor - t.gap_count(self.cursor) - len(self.skip)
        return max(0, ahead) - self._dpubs_ahead(wall_ns) + len(self.requeued)

    def deferred_count(self, wall_ns: int) -> int:
        return len(self.deferred) + self._dpubs_ahead(wall_ns)

    def backend_depth(self) -> int:
        """The part of depth that only the segment files hold (not the memory tail)."""
        if self.topic.log.directory is None:
            return 0
        tail = self.topic.log.tail_start
        return max(0, min(tail, self.topic.released) - self.cursor)

    def floor(self) -> int:
        """The lowest offset this channel still needs (segments below may go)."""
        low = self.cursor
        if self.in_flight:
            low = min(low, self.in_flight.min())
        if self.requeued:
            low = min(low, min(e[0] for e in self.requeued))
        lowest = self.deferred.lowest()
        if lowest is not None:
            low = min(low, lowest)
        if self.dying:
            low = min(low, min(self.dying))
        return low

    def snapshot_parts(self, wall_ns: int, now_ns: int) -> tuple[ChannelState, Chunks]:
        state, deferred = super().snapshot_parts(wall_ns, now_ns)
        state["paused"] = self.paused
        return state, deferred

    # -- delivery (owner thread) ----------------------------------------------------
    def dispatch(self, now_ns: int, wall_ns: int) -> bool:
        """Hand messages to ready consumers, round-robin; True if any were sent. At most
        DISPATCH_BUDGET messages (and DEAD_BATCH dead letters) per call: with more to
        do, the channel marks itself dirty again so the loop comes back to it."""
        consumers = self.consumers
        if self.paused or not consumers:
            return False
        n = len(consumers)
        if n > 1 and not (self.requeued or self.skip or self.ephemeral or self.topic.gaps):
            spread = self._spread(now_ns)
            if spread is not None:
                return spread
        idle = 0
        i = self._rr
        budget = DISPATCH_BUDGET
        sent = False
        topic = self.topic
        more = False
        while idle < n and budget > 0:
            if not self.requeued and self.cursor >= topic.released:
                break
            c = consumers[i % n]
            i += 1
            room = c.ready_room()
            if room <= 0:
                idle += 1
                continue
            room = min(room, budget)
            before = self.cursor
            got = popped = 0
            if self.requeued and self.head_ready():
                got, popped, more = self._send_requeued(c, room, now_ns, wall_ns)
                if more:
                    break
            if got < room and self.cursor < topic.released:
                got += self._send_from_cursor(c, room - got, now_ns, wall_ns)
            moved = self.cursor - before
            if not got and not moved and not popped:
                idle += 1    # nothing this consumer could take
                continue
            idle = 0
            budget -= max(got, moved, popped)
            sent = sent or got > 0
        self._rr = i % n if n else 0
        if budget <= 0 or more:
            self.owner.mark_dirty(self)   # more to do: next turn, after other work
        return sent

    def _spread(self, now_ns: int) -> bool | None:
        """dispatch's common case: several consumers, messages only at the cursor (none
        requeued, held, gapped or ephemeral), none deferred. One read and one frames
        call (C) for every ready consumer of this pass, each taking its room in
        round-robin order, so a consumer at RDY 1 costs a slice, not a read. None: the
        general loop must run (a consumer samples, the read met a DPUB or damage)."""
        topic = self.topic
        released = topic.released
        if self.cursor >= released or self.cursor < topic.log.oldest:
            return None if self.cursor < topic.log.oldest else False
        consumers = self.consumers
        n = len(consumers)
        start = self._rr % n
        ready: list[tuple[Consumer, int]] = []
        total = 0
        # round-robin from _rr (the rotated list is built in C)
        for c in (consumers[start:] + consumers[:start] if start else consumers):
            room = c.ready_room()
            if room > 0:
                if c.sample_rate:
                    return None
                ready.append((c, room))
                total += room
        if not ready:
            return False
        want = min(total, READ_BATCH, released - self.cursor)
        reader = self._reader
        if reader is None:
            reader = self._reader = topic.log.cursor()
        batch = reader.read(self.cursor, want, READ_BYTES, want)
        count = min(batch.n, released - batch.first)
        if batch.first != self.cursor or count <= 0 or batch.deferred_indices(count):
            return None
        pos = batch.pos
        base = pos[0]
        out = batch.frames(0, count)
        frames = memoryview(out)
        # a frame is its record less the 16-byte record header, and the records lie
        # back to back: record j's frame starts at pos[j] - base - 16 j
        if len(frames) != batch.end_of(count - 1) - base - 16 * count:
            return None
        first = batch.first
        i = 0
        last = ready[0][0]
        sends: list[tuple[Consumer, int, int]] = []
        for c, room in ready:
            if i >= count:
                break
            j = min(count, i + room)
            sends.append((c, j - i, pos[j] - base - 16 * j if j < count else len(frames)))
            i, last = j, c
        # counted in flight before their frames are handed over: a client whose room
        # is now taken has them written at once
        self._fly_pass(first, sends, now_ns)
        self.cursor = first + i
        self._rr = (consumers.index(last) + 1) % n
        if i == count and total > i and released > self.cursor:
            self.owner.mark_dirty(self)    # room and records left: on, next turn
        # last: a write that fails closes its consumer, which leaves this channel (its
        # messages requeued) while the owner delivers
        self.owner.deliver(sends, out)
        return True

    def _send_from_cursor(self, c: Consumer, room: int, now_ns: int, wall_ns: int) -> int:
        topic = self.topic
        log = topic.log
        released = topic.released
        if topic.gaps:
            # /topic/empty dropped a paused topic's backlog: never read it
            self._advance(topic.skip_gap(self.cursor))
            released = min(released, topic.next_gap(self.cursor))
        if self.ephemeral and released - self.cursor > self.topic.mem_queue_size:
            # matches nsqd: an ephemeral channel discards what overflows its memory queue
            skip = released - self.cursor - self.topic.mem_queue_size
            self.dropped_count += skip
            self._advance(self.cursor + skip)
        if self.cursor < log.oldest:
            # records gone from an ephemeral log before this channel read them
            self.dropped_count += log.oldest - self.cursor
            self._advance(log.oldest)
        if self.skip:
            self._pass_skipped()
            if self.skip:
                released = min(released, self.skip.first())
        if self.requeued:
            if self.head_ready():
                return 0       # its turn has come: the requeued one goes first
            released = min(released, self.requeued[0][2])   # its turn comes there
        if self.cursor >= released:
            return 0
        want = min(room, READ_BATCH, released - self.cursor)
        reader = self._reader
        if reader is None:
            reader = self._reader = log.cursor()
        # read ahead what the consumers may take soon (about this one's room each)
        ahead = min(room * len(self.consumers), released - self.cursor)
        batch = reader.read(self.cursor, want, READ_BYTES, ahead)
        if batch.first > self.cursor:      # damaged records skipped by the log
            self.dropped_count += batch.first - self.cursor
            self._advance(batch.first)
        count = min(batch.n, released - batch.first)
        if count <= 0:
            return 0
        first = batch.first
        sent = 0
        start = 0
        for k in batch.deferred_indices(count):
            # a DPUB: records before it go now, it waits for its time
            if k > start:
                sent += self._send_slice(c, batch, start, k, now_ns)
            due = batch.deliver_at(k)
            if due > wall_ns:
                self._defer((first + k, 0, due), now_ns + (due - wall_ns))
            else:
                sent += self._send_slice(c, batch, k, k + 1, now_ns)
            start = k + 1
        if start < count:
            sent += self._send_slice(c, batch, start, count, now_ns)
        self.cursor = first + count
        return sent

    def _send_slice(self, c: Consumer, batch: Batch, i: int, j: int, now_ns: int) -> int:
        """Send records [i, j) of batch to c as one flight."""
        if c.sample_rate:
            return self._send_sampled(c, batch, i, j, now_ns)
        self._fly(c, batch.first + i, j - i, 1, now_ns, now_ns + c.msg_timeout_ns)
        c.send_frames(batch.frames(i, j), j - i)
        return j - i

    def _send_sampled(self, c: Consumer, batch: Batch, i: int, j: int, now_ns: int) -> int:
        # matches nsqd: a message sampled out for this client is dropped from the channel
        rate = c.sample_rate
        sent = 0
        for k in range(i, j):
            if random.randrange(100) <= rate:
                self._fly(c, batch.first + k, 1, 1, now_ns, now_ns + c.msg_timeout_ns)
                c.send_frames(batch.frames(k, k + 1), 1)
                sent += 1
            else:
                self.dropped_count += 1
        return sent

    def _send_requeued(self, c: Consumer, room: int, now_ns: int,
                       wall_ns: int) -> tuple[int, int, bool]:
        """Redeliver requeued messages whose turn has come (read by offset; one read
        serves the following offsets it holds); those out of attempts (``max_attempts``)
        go to the dead-letter topic instead. Returns (sent, taken off the queue, more
        dead letters wait for the next turn)."""
        log = self.topic.log
        sent = popped = 0
        frames: list[bytes | bytearray] = []
        # the records of ``batch`` flown so far, and each one's attempts beyond its
        # stored count: framed in one call when the batch changes or the pass ends
        idx: list[int] = []
        adds: list[int] = []
        deadline = now_ns + c.msg_timeout_ns
        target = self.dead_letter_topic
        limit = self.max_attempts if target is not None else 0
        dead: list[int] = []
        bodies: list[bytes] = []
        dead_bytes = 0
        batch: Batch | None = None
        more = False
        reader = self._requeue_reader
        if reader is None:
            reader = self._requeue_reader = log.cursor(REQUEUE_MIN_READ)
        while self.requeued and sent < room and self.head_ready():
            off, attempts, _ = self._pop_requeued()
            popped += 1
            if batch is None or not batch.first <= off < batch.first + batch.n:
                if idx:
                    assert batch is not None
                    frames.append(batch.frames_each(idx, adds))
                    idx, adds = [], []
                batch = None
                if off >= log.oldest:   # else dropped from an ephemeral log meanwhile
                    try:
                        run = self._requeued_run(off, room - sent)
                        batch = reader.read(off, run, READ_BYTES, run)
                    except ValueError:     # OffsetOutOfRange: gone from the log meanwhile
                        pass
                if batch is None or batch.n == 0 or batch.first != off:
                    batch = None
                    self.delivery_times.pop(off, None)   # gone, or damaged and skipped
                    continue
            i = off - batch.first
            if limit and attempts + 1 + batch.stored_attempts(i) > limit:
                assert target is not None
                env = self._envelope(off, attempts, batch, i, target, now_ns, wall_ns)
                if env is None:
                    if not self._cycle(off, attempts + 1 + batch.stored_attempts(i)
                                       == limit + 1):
                        self._fly(c, off, 1, attempts + 1, now_ns, deadline)
                        idx.append(i)
                        adds.append(attempts + 1)
                        sent += 1
                    continue
                dead.append(off)
                bodies.append(env)
                self._dying(off, attempts)
                dead_bytes += len(env)
                if len(dead) >= DEAD_BATCH or dead_bytes >= DEAD_BATCH_BYTES:
                    more = bool(self.requeued)
                    break
                continue
            self._fly(c, off, 1, attempts + 1, now_ns, deadline)
            idx.append(i)
            adds.append(attempts + 1)
            sent += 1
        if idx:
            assert batch is not None
            frames.append(batch.frames_each(idx, adds))
        batch = None
        if not self.requeued:
            reader.release()    # until the next requeue: no descriptor, no buffer
        if sent:
            c.send_frames(frames[0] if len(frames) == 1 else b"".join(frames), sent)
        if dead and target is not None:  # dead letters only with a target
            self.owner.dead_letter(self, target, dead, bodies)
        return sent, popped, more

    def _requeued_run(self, off: int, limit: int) -> int:
        """How many requeued offsets from off on follow each other (off, off + 1, ...;
        at most limit): the records one requeued read should take."""
        n = 1
        for nxt, _, _ in itertools.islice(self.requeued, 0, max(0, limit - 1)):
            if nxt != off + n:
                break
            n += 1
        return n
