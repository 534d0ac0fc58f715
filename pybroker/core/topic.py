"""Topic: one append-only log, its channels (cursors over it), pause and the exit flag.

Publishing: a topic has one owner loop (``owner``, set by the Broker: its name hashed
over the loops), and only that loop's Publisher (pybroker.server.publish) appends to the
log and writes it, so every record appended is carried by the next ``write`` of the one
thread that appended it. ``publish*`` append records for the write of epoch
``log.epoch``; ``write`` (once per loop turn per topic published to) hands them to the
kernel in one write, releases them to the channels and returns the epoch it carried;
on a storage error the records of that epoch are discarded and the error, naming the
epoch, is raised. At start-up, before any loop runs, the start-up thread is the owner.

Thread-safety: ``lock`` (the log's lock) guards the log, ``released``, the channel map,
``paused`` and ``deleted`` against the other threads that read them (channels' owner
loops, HTTP, storage) and against a delete: a publish racing a delete either lands
before the delete or gets ``Exiting`` (nsqd's exit flag checked under the topic's
lock), never a half-deleted log.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from pybroker.core.channel import Channel
from pybroker.core.dpubs import DpubIndex
from pybroker.core.seams import Log, Owner
from pybroker.errors import Exiting
from pybroker.protocol.names import is_ephemeral


PRUNE_STEP = 32_768   # DPUBs a step of ``prune_dpubs`` forgets (about 3 ms)


class Topic:
    def __init__(self, name: str, log: "Log", mem_queue_size: int,
                 pick_owner: Callable[[str, str], Owner[Channel]]) -> None:
        self.name = name
        self.ephemeral = is_ephemeral(name)
        self.mem_queue_size = mem_queue_size
        self.log = log
        self.lock = log.lock
        self.channels: dict[str, Channel] = {}
        self.paused = False
        self.deleted = False
        # every offset below released may be read by the channels
        self.released = log.written
        # a replicated topic (pybroker.cluster): channels get records only below this
        # (the high watermark); None: everything written
        self.release_cap: int | None = None
        # where a first channel starts: everything before was consumed by channels that
        # are gone (nsqd hands a topic's buffer to its first channel, not old messages)
        self.orphan_start = log.oldest
        # offsets in [released, written) dropped by /topic/empty while paused
        self.gaps: list[tuple[int, int]] = []
        # DPUB records not yet read by every channel: offset -> deliver_at (wall ns)
        # (and their deliver-at times by chunk: a channel's count of those not yet due
        # is not a walk over them; core/dpubs.py)
        self.dpubs = DpubIndex(getattr(log, "recovered_dpubs", ()))
        self.message_count = 0
        self.message_bytes = 0
        # the loop whose Publisher appends to and writes this topic (Broker.topic_owner)
        self.owner: Owner[Channel] | None = None
        # (max_attempts, dead_letter_topic) for channels with no settings of their own
        self.dl_defaults: tuple[int, str] = (0, "")
        self._pick_owner = pick_owner

    def __repr__(self) -> str:
        return f"Topic({self.name})"

    # -- publishing (the owner loop) -------------------------------------------------
    def publish(self, bodies: list[bytes], ts_ns: int, defer_ns: int = 0) -> int:
        """Append messages for the write of epoch ``log.epoch`` (see ``write``); returns
        the first offset. Raises Exiting once the topic is being deleted."""
        with self.lock:
            if self.deleted:
                raise Exiting()
            deliver_at = ts_ns + defer_ns if defer_ns else 0
            first = self.log.append(bodies, ts_ns, deliver_at)
            if deliver_at:
                for i in range(len(bodies)):
                    self.dpubs[first + i] = deliver_at
            self.message_count += len(bodies)
            self.message_bytes += sum(map(len, bodies))
            return first

    def publish_parts(self, src: bytes | bytearray, offs: Sequence[int], lens: Sequence[int],
                      ts_ns: int) -> int:
        """Append the parts src[offs[i]:offs[i] + lens[i]] of an MPUB body (as
        mpub_parts found them) in one C call, with no object per part."""
        with self.lock:
            if self.deleted:
                raise Exiting()
            first = self.log.append_parts(src, offs, lens, ts_ns)
            self.message_count += len(lens)
            self.message_bytes += sum(lens)
            return first

    def publish_records(self, items: list[tuple[int, int, bytes, int]]) -> int:
        """Append records that keep their own (ts_ns, attempts, body, deliver_at_ns):
        imported queues."""
        with self.lock:
            if self.deleted:
                raise Exiting()
            first = self.log.append_records(items)
            for i, (_, _, body, deliver_at) in enumerate(items):
                if deliver_at:
                    self.dpubs[first + i] = deliver_at
                self.message_bytes += len(body)
            self.message_count += len(items)
            return first

    def write(self) -> tuple[int, int, list[Channel]]:
        """Hand the appended records to the kernel (one write) and release them to the
        channels: returns (the epoch this write carried, how many records it wrote, the
        channels to wake); (0, 0, []) when nothing was appended. On a storage error the
        records are discarded (the publishes of that epoch failed) and the error, its
        ``epoch`` set, is raised."""
        with self.lock:
            log = self.log
            n = log.head - log.written
            if not n:
                return 0, 0, []
            if self.deleted:
                # appended before the delete: the messages go with the topic (nsqd: a
                # publish that won the race is answered, then emptied with its topic)
                epoch = log.epoch
                log.epoch += 1
                self._discard()
                return epoch, 0, []
            try:
                epoch = log.write_pending()
            except Exception:
                self._discard()
                raise
            if self.paused:
                return epoch, n, []
            cap = self.release_cap
            to = log.written if cap is None else min(log.written, cap)
            if to <= self.released:
                return epoch, n, []
            self.released = to
            return epoch, n, list(self.channels.values())

    def _discard(self) -> None:
        # caller holds the lock: forget appended, unwritten records
        head = self.log.head
        self.log.discard_pending()
        for off in list(self.dpubs.irange(self.log.head, head, inclusive=(True, False))):
            del self.dpubs[off]

    def deferred_ahead(self, cursor: int, wall_ns: int) -> int:
        """DPUBs in [cursor, released) not yet due: they count as deferred, not depth."""
        return self.dpubs.not_due(cursor, self.released, wall_ns)

    # -- channels -------------------------------------------------------------------
    def get_channel(self, name: str) -> tuple[Channel, bool]:
        """Find or create a channel -> (channel, created). A topic's first channel starts
        at the oldest message the topic holds for it; later ones at ``released``."""
        with self.lock:
            ch = self.channels.get(name)
            if ch is not None:
                return ch, False
            if self.deleted:
                raise Exiting()
            return self.new_channel(name), True

    def new_channel(self, name: str, cursor: int | None = None) -> Channel:
        """Create and add a channel (caller holds the lock)."""
        if cursor is None:
            cursor = self.released if self.channels else max(self.orphan_start, self.log.oldest)
        ch = self.make_channel(name, cursor)
        # a first channel inherits the topic's dropped gaps; later ones start past them
        self.channels[name] = ch
        return ch

    def make_channel(self, name: str, cursor: int) -> Channel:
        """A channel of this topic not yet added to it (any thread: a new leader builds
        the channels it takes over off its loop, pybroker.cluster.takeover)."""
        return Channel(self, name, self._pick_owner(self.name, name), is_ephemeral(name), cursor)

    def find_channel(self, name: str) -> Channel | None:
        return self.channels.get(name)

    def remove_channel(self, name: str) -> Channel | None:
        with self.lock:
            ch = self.channels.pop(name, None)
            if ch is not None and not self.channels:
                self.orphan_start = self.released
        if ch is not None:
            ch.deleted = True
        return ch

    def set_paused(self, paused: bool) -> list[Channel]:
        """Pause: nothing written from now on reaches the channels; unpause releases it.
        Returns the channels to wake."""
        with self.lock:
            self.paused = paused
            cap = self.release_cap
            to = self.log.written if cap is None else min(self.log.written, cap)
            if paused or to <= self.released:
                return []
            self.released = to
            return list(self.channels.values())

    def skip_gap(self, cursor: int) -> int:
        """The cursor moved past any gap it stood in (owner loops call it)."""
        for start, end in self.gaps:
            if start <= cursor < end:
                return end
        return cursor

    def next_gap(self, cursor: int) -> int:
        """Where the next gap at or after cursor starts (``released`` if none)."""
        return min((s for s, _ in self.gaps if s >= cursor), default=self.released)

    def gap_count(self, cursor: int) -> int:
        """How many offsets in [cursor, released) are in gaps."""
        return sum(max(0, min(e, self.released) - max(s, cursor)) for s, e in self.gaps)

    def prune_gaps(self, below: int) -> None:
        with self.lock:
            self.gaps = [(s, e) for s, e in self.gaps if e > below]

    def empty(self) -> None:
        """/topic/empty: drop what the topic holds that no channel has been given yet
        (all of it when it has no channel; what a pause held back otherwise)."""
        with self.lock:
            written = self.log.written
            if not self.channels:
                self.orphan_start = written
            elif written > self.released:
                self.gaps.append((self.released, written))
            self.dpubs.clear()

    def depth(self) -> int:
        """nsqd's topic depth: messages not yet handed to channels."""
        written = self.log.written
        if not self.channels:
            return max(0, written - max(self.orphan_start, self.log.oldest))
        held = written - self.released
        for start, end in self.gaps:
            held -= max(0, min(end, written) - max(start, self.released))
        return max(0, held)

    def backend_depth(self) -> int:
        """The part of depth that only the segment files hold (not the memory tail)."""
        if self.log.directory is None:
            return 0
        start = max(self.orphan_start, self.log.oldest) if not self.channels else self.released
        return min(self.depth(), max(0, min(self.log.tail_start, self.log.written) - start))

    def floor(self) -> int:
        """The lowest offset any channel (or a future first channel) still needs."""
        chans = list(self.channels.values())
        if not chans:
            return max(self.orphan_start, self.log.oldest)
        return min(ch.floor() for ch in chans)

    def prune_dpubs(self, below: int) -> None:
        # in steps of PRUNE_STEP, the lock let go between (it is the owner loop's to
        # publish): 1,000,000 DPUBs read at once by every channel held it about 80 ms
        while True:
            with self.lock:
                if self.dpubs.drop_below(below, PRUNE_STEP) < PRUNE_STEP:
                    return
