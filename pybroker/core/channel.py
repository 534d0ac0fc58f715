"""Channel: a cursor over its topic's log, plus the state only it needs (docs/storage.md).

A channel holds no message bodies. Its state is keyed by log offset (a message id is its
offset in 16 hex digits): ``cursor`` (the next offset to hand out), ``in_flight`` (offset ->
the Flight it went out in), ``requeued`` (offsets ready again, with their deliveries so
far) and ``deferred`` (offsets waiting for a due time, in a TimeoutWheel).

Dead letters (docs/dead-letters.md): with ``max_attempts`` set, a requeued message that
would go out for the (max_attempts+1)-th time is handed to the owner loop to be published
to the dead-letter topic instead; until that publish is confirmed it sits in ``dying``
(neither deliverable nor finished), then it is finished.

Ownership: a channel is owned by one event loop (``owner``, chosen by hashing its name);
only that loop's thread calls dispatch/finish/requeue/touch/empty/rewind and changes
consumers. The queue-scanner threads call ``expire`` only. ``lock`` guards the two
timeout wheels, which both sides touch; it is taken inside these methods only and never
held while calling out to another object.
"""
from __future__ import annotations

import random
import threading
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from pybroker.core.timeouts import Handle, TimeoutWheel
from pybroker.errors import BrokerError, NotInFlight, NotOwner, TooManyConsumers
from pybroker.protocol.deadletter import dead_letter_target, envelope

if TYPE_CHECKING:
    from pybroker.core.stats import LatencyWindow
    from pybroker.core.topic import Topic

# the most records one dispatch reads per consumer turn (bounds the work of one call)
READ_BATCH = 2500
READ_BYTES = 4 * 1024 * 1024
# records one dispatch call may hand out in total before yielding the loop
DISPATCH_BUDGET = 20_000


class Consumer(Protocol):
    """What a channel needs from a subscribed client (implemented by the server)."""

    msg_timeout_ns: int
    sample_rate: int
    in_flight_count: int

    def ready_room(self) -> int:
        """How many more messages the client may take now (RDY minus in flight)."""

    def send_frames(self, frames: bytes, n: int) -> None:
        """Queue n encoded message frames for this client (already in flight)."""


class Flight:
    """One slice of messages sent to one client together: the offsets that still map to
    it in ``Channel.in_flight`` are in flight. ``attempts`` counts this channel's
    deliveries of each of them (a record's stored attempts come on top)."""

    __slots__ = ("client", "first", "n", "live", "attempts", "delivery_ns", "handle")

    def __init__(self, client: Consumer | None, first: int, n: int, attempts: int,
                 delivery_ns: int) -> None:
        self.client = client
        self.first = first
        self.n = n
        self.live = n
        self.attempts = attempts
        self.delivery_ns = delivery_ns
        self.handle: Handle | None = None

    def offsets(self) -> range:
        return range(self.first, self.first + self.n)


class Deferred:
    """A message waiting for its time: a REQ with a delay (``due_wall_ns`` kept so a
    restart keeps it) or a DPUB read at the cursor before it was due."""

    __slots__ = ("offset", "attempts", "due_wall_ns", "handle")

    def __init__(self, offset: int, attempts: int, due_wall_ns: int) -> None:
        self.offset = offset
        self.attempts = attempts
        self.due_wall_ns = due_wall_ns
        self.handle: Handle | None = None


def offset_of(msg_id: bytes) -> int:
    """The log offset a message id names (16 lowercase hex digits); -1 otherwise."""
    if len(msg_id) != 16 or not _HEX_LOWER.issuperset(msg_id):
        return -1
    off = int(msg_id, 16)
    return off if off < 1 << 63 else -1


_HEX_LOWER = frozenset(b"0123456789abcdef")


class Channel:
    """One channel of a topic. See the module docstring for who may call what."""

    def __init__(self, topic: "Topic", name: str, owner: Any, ephemeral: bool,
                 cursor: int) -> None:
        self.topic = topic
        self.topic_name = topic.name
        self.name = name
        self.owner = owner
        self.ephemeral = ephemeral
        # between the owner loop and the scanner workers (expire): the timeout wheels
        self.lock = threading.Lock()
        self.cursor = cursor
        self.start_offset = cursor        # for message_count
        self.in_flight: dict[int, Flight] = {}
        self.in_flight_wheel: TimeoutWheel[Flight] = TimeoutWheel()
        self.requeued: deque[tuple[int, int]] = deque()   # (offset, deliveries so far)
        self.deferred: dict[int, Deferred] = {}
        self.deferred_wheel: TimeoutWheel[Deferred] = TimeoutWheel()
        self.consumers: list[Consumer] = []
        self._rr = 0
        self.paused = False
        self.deleted = False
        self.extra_count = 0               # message_count beyond what the cursor saw
        self.requeue_count = 0
        self.timeout_count = 0
        self.dropped_count = 0             # ephemeral overflow, sampled out
        # end-to-end latency window, created on the first FIN when e2e percentiles are set
        self.e2e: LatencyWindow | None = None
        # dead letters: settings given for this channel (over HTTP; kept in nsqd.dat),
        # else the topic's defaults (from the config)
        self.dl_settings: dict[str, Any] = {}
        self.max_attempts = 0
        self.dead_letter_topic: str | None = None   # where dead letters go (None: nowhere)
        self.dead_letter_count = 0
        # offsets being dead-lettered: published, not yet confirmed -> deliveries so far
        self.dying: dict[int, int] = {}
        # only with max_attempts: offset -> (first, last) delivery (monotonic ns) of the
        # messages requeued at least once
        self.delivery_times: dict[int, tuple[int, int]] = {}
        self.configure_dead_letters({})

    def __repr__(self) -> str:
        return f"Channel({self.topic_name}/{self.name})"

    # -- consumers (owner thread) ---------------------------------------------------
    def add_consumer(self, c: Consumer, max_consumers: int) -> None:
        if max_consumers and len(self.consumers) >= max_consumers:
            raise TooManyConsumers(f"consumers for {self.topic_name}:{self.name} "
                                   f"exceeds limit of {max_consumers}")
        self.consumers.append(c)

    def remove_consumer(self, c: Consumer) -> int:
        """Detach c and requeue its in-flight messages at once; returns how many.

        Goes beyond nsqd, which leaves them until their timeout (nsq #137).
        """
        try:
            self.consumers.remove(c)
        except ValueError:
            return 0
        mine = sorted(off for off, f in self.in_flight.items() if f.client is c)
        if not mine:
            return 0
        self._requeue_offsets(mine)
        self.requeue_count += len(mine)
        return len(mine)

    def _requeue_offsets(self, offsets: list[int]) -> None:
        """Owner: take offsets out of flight (any client) and make them ready again."""
        in_flight = self.in_flight
        emptied = []
        for off in offsets:
            f = in_flight.pop(off)
            f.live -= 1
            if f.client is not None:
                f.client.in_flight_count -= 1
            if f.live == 0:
                emptied.append(f)
            self.requeued.append((off, f.attempts))
            if self.max_attempts:
                self._note_delivery(off, f.delivery_ns)
        self._drop_flights(emptied)

    def _note_delivery(self, off: int, delivery_ns: int) -> None:
        """Remember when a message about to be requeued was first and last delivered."""
        seen = self.delivery_times.get(off)
        self.delivery_times[off] = (delivery_ns if seen is None else seen[0], delivery_ns)

    # -- dead letters ---------------------------------------------------------------
    def configure_dead_letters(self, settings: dict[str, Any]) -> None:
        """Take this channel's own settings (``max_attempts``, ``dead_letter_topic``;
        a missing key means the topic's default) and resolve where dead letters go."""
        self.dl_settings = dict(settings)
        default_max, default_topic = getattr(self.topic, "dl_defaults", (0, ""))
        self.max_attempts = int(settings.get("max_attempts", default_max))
        name = str(settings.get("dead_letter_topic", default_topic))
        self.dead_letter_topic = dead_letter_target(self.topic_name, name)
        if not self.max_attempts:
            self.delivery_times.clear()

    def _dead_letter(self, dead: list[tuple[int, int, Any]], now_ns: int,
                     wall_ns: int) -> None:
        """Owner: these requeued messages ran out of attempts: build their envelopes,
        hold them in ``dying`` and ask the owner loop to publish them."""
        offsets = []
        bodies = []
        target = self.dead_letter_topic
        assert target is not None
        for off, attempts, batch in dead:
            stored = batch.stored_attempts(0)
            seen = self.delivery_times.get(off)
            first_ns, last_ns = seen if seen is not None else (now_ns, now_ns)
            bodies.append(envelope(
                topic=self.topic_name, channel=self.name, offset=off,
                attempts=attempts + stored,
                first_delivery_ms=(wall_ns - (now_ns - first_ns)) // 1_000_000,
                last_delivery_ms=(wall_ns - (now_ns - last_ns)) // 1_000_000,
                dead_at_ms=wall_ns // 1_000_000,
                published_ms=batch.ts_ns(0) // 1_000_000,
                body=batch.payload(0)[34:]))
            offsets.append(off)
            self.dying[off] = attempts
        self.owner.dead_letter(self, target, offsets, bodies)

    def dead_lettered(self, offsets: list[int], ok: bool) -> int:
        """Owner: the dead-letter publish of these offsets was confirmed (written, and
        synced in fsync mode): they are finished. If it failed they are requeued as
        they were. Returns how many were finished."""
        done = 0
        for off in offsets:
            attempts = self.dying.pop(off, None)
            if attempts is None:
                continue     # emptied meanwhile
            if ok:
                self.delivery_times.pop(off, None)
                done += 1
            else:
                self.requeued.append((off, attempts))
        self.dead_letter_count += done
        return done

    def _drop_flights(self, flights: list[Flight]) -> None:
        if not flights:
            return
        with self.lock:
            remove = self.in_flight_wheel.remove
            for f in flights:
                if f.handle is not None:
                    remove(f.handle)
                    f.handle = None

    # -- counts (owner thread; also read for stats) ---------------------------------
    @property
    def message_count(self) -> int:
        """Messages this channel was given (nsqd counts each put to the channel)."""
        return max(0, self.topic.released - self.start_offset) + self.extra_count

    def depth(self, wall_ns: int) -> int:
        """Queued messages: released and not yet handed out, plus requeued ones (not in
        flight or deferred; DPUBs not yet read and not yet due count as deferred)."""
        t = self.topic
        ahead = t.released - self.cursor - t.gap_count(self.cursor)
        return max(0, ahead) - t.deferred_ahead(self.cursor, wall_ns) + len(self.requeued)

    def deferred_count(self, wall_ns: int) -> int:
        return len(self.deferred) + self.topic.deferred_ahead(self.cursor, wall_ns)

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
            low = min(low, min(self.in_flight))
        if self.requeued:
            low = min(low, min(off for off, _ in self.requeued))
        if self.deferred:
            low = min(low, min(self.deferred))
        if self.dying:
            low = min(low, min(self.dying))
        return low

    # -- delivery (owner thread) ----------------------------------------------------
    def dispatch(self, now_ns: int, wall_ns: int) -> bool:
        """Hand messages to ready consumers, round-robin; True if any were sent. At most
        DISPATCH_BUDGET messages per call: with more to hand out, the channel marks
        itself dirty again so the loop comes back to it next turn."""
        consumers = self.consumers
        if self.paused or not consumers:
            return False
        n = len(consumers)
        idle = 0
        i = self._rr
        budget = DISPATCH_BUDGET
        sent = False
        topic = self.topic
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
            got = self._send_requeued(c, room, now_ns, wall_ns) if self.requeued else 0
            if got < room and self.cursor < topic.released:
                got += self._send_from_cursor(c, room - got, now_ns, wall_ns)
            moved = self.cursor - before
            if not got and not moved:
                idle += 1    # nothing this consumer could take
                continue
            idle = 0
            budget -= max(got, moved)
            sent = sent or got > 0
        self._rr = i % n if n else 0
        if budget <= 0:
            self.owner.mark_dirty(self)   # more to do: next turn, after other work
        return sent

    def _send_from_cursor(self, c: Consumer, room: int, now_ns: int, wall_ns: int) -> int:
        topic = self.topic
        log = topic.log
        released = topic.released
        if topic.gaps:
            # /topic/empty dropped a paused topic's backlog: never read it
            self.cursor = topic.skip_gap(self.cursor)
            released = min(released, topic.next_gap(self.cursor))
            if self.cursor >= released:
                return 0
        if self.ephemeral and released - self.cursor > self.topic.mem_queue_size:
            # matches nsqd: an ephemeral channel discards what overflows its memory queue
            skip = released - self.cursor - self.topic.mem_queue_size
            self.dropped_count += skip
            self.cursor += skip
        if self.cursor < log.oldest:
            # records gone from an ephemeral log before this channel read them
            self.dropped_count += log.oldest - self.cursor
            self.cursor = log.oldest
            if self.cursor >= released:
                return 0
        want = min(room, READ_BATCH, released - self.cursor)
        batch = log.read(self.cursor, want, READ_BYTES)
        if batch.first > self.cursor:      # damaged records skipped by the log
            self.dropped_count += batch.first - self.cursor
            self.cursor = batch.first
        count = min(batch.n, released - batch.first)
        if count <= 0:
            return 0
        first = batch.first
        sent = 0
        start = 0
        for k in batch.deferred_indices(count):
            # a DPUB: records before it go now, it waits for its time
            if k > start:
                sent += self._fly(c, batch, start, k, now_ns)
            due = batch.deliver_at(k)
            if due > wall_ns:
                self._defer(Deferred(first + k, 0, 0), now_ns + (due - wall_ns))
            else:
                sent += self._fly(c, batch, k, k + 1, now_ns)
            start = k + 1
        if start < count:
            sent += self._fly(c, batch, start, count, now_ns)
        self.cursor = first + count
        return sent

    def _fly(self, c: Consumer, batch: Any, i: int, j: int, now_ns: int) -> int:
        """Send records [i, j) of batch to c as one flight."""
        first = batch.first + i
        if c.sample_rate:
            return self._fly_sampled(c, batch, i, j, now_ns)
        f = Flight(c, first, j - i, 1, now_ns)
        with self.lock:
            f.handle = self.in_flight_wheel.add(now_ns + c.msg_timeout_ns, f)
        self.in_flight.update(dict.fromkeys(range(first, first + j - i), f))
        c.in_flight_count += j - i
        c.send_frames(batch.frames(i, j), j - i)
        return j - i

    def _fly_sampled(self, c: Consumer, batch: Any, i: int, j: int, now_ns: int) -> int:
        # matches nsqd: a message sampled out for this client is dropped from the channel
        rate = c.sample_rate
        sent = 0
        for k in range(i, j):
            if random.randrange(100) <= rate:
                f = Flight(c, batch.first + k, 1, 1, now_ns)
                with self.lock:
                    f.handle = self.in_flight_wheel.add(now_ns + c.msg_timeout_ns, f)
                self.in_flight[batch.first + k] = f
                c.in_flight_count += 1
                c.send_frames(batch.frames(k, k + 1), 1)
                sent += 1
            else:
                self.dropped_count += 1
        return sent

    def _send_requeued(self, c: Consumer, room: int, now_ns: int, wall_ns: int) -> int:
        """Redeliver requeued messages (re-read one by one: the rare path); those out of
        attempts (``max_attempts``) go to the dead-letter topic instead."""
        log = self.topic.log
        sent = 0
        frames = []
        deadline = now_ns + c.msg_timeout_ns
        flights = []
        limit = self.max_attempts if self.dead_letter_topic is not None else 0
        dead: list[tuple[int, int, Any]] = []
        while self.requeued and sent < room:
            off, attempts = self.requeued.popleft()
            batch = None
            if off >= log.oldest:   # else dropped from an ephemeral log meanwhile
                try:
                    batch = log.read(off, 1, READ_BYTES)
                except ValueError:     # OffsetOutOfRange: gone from the log meanwhile
                    pass
            if batch is None or batch.n == 0 or batch.first != off:
                if self.delivery_times:   # gone, or damaged and skipped
                    self.delivery_times.pop(off, None)
                continue
            if limit and attempts + 1 + batch.stored_attempts(0) > limit:
                dead.append((off, attempts, batch))
                continue
            f = Flight(c, off, 1, attempts + 1, now_ns)
            frames.append(batch.frames(0, 1, attempts + 1 + batch.stored_attempts(0)))
            flights.append(f)
            self.in_flight[off] = f
            sent += 1
        if dead:
            self._dead_letter(dead, now_ns, wall_ns)
        if not sent:
            return 0
        with self.lock:
            add = self.in_flight_wheel.add
            for f in flights:
                f.handle = add(deadline, f)
        c.in_flight_count += sent
        c.send_frames(b"".join(frames), sent)
        return sent

    def _defer(self, d: Deferred, deadline_ns: int) -> None:
        with self.lock:
            d.handle = self.deferred_wheel.add(deadline_ns, d)
        self.deferred[d.offset] = d

    # -- acknowledgements (owner thread) --------------------------------------------
    def _held(self, client: Consumer, msg_id: bytes) -> tuple[int, Flight]:
        """The offset and flight of a message client holds; raises NotInFlight/NotOwner."""
        off = offset_of(msg_id)
        f = self.in_flight.get(off)
        if f is None:
            raise NotInFlight()
        if f.client is not client:
            raise NotOwner()
        return off, f

    def _take(self, client: Consumer, msg_id: bytes) -> tuple[int, Flight]:
        off, f = self._held(client, msg_id)
        del self.in_flight[off]
        f.live -= 1
        client.in_flight_count -= 1
        if f.live == 0:
            self._drop_flights([f])
        return off, f

    def finish(self, client: Consumer, msg_id: bytes) -> int:
        """FIN: the message is done; returns its offset. Raises NotInFlight / NotOwner."""
        off = self._take(client, msg_id)[0]
        if self.delivery_times:
            self.delivery_times.pop(off, None)
        return off

    def finish_offsets(self, client: Consumer, offsets: Sequence[int]
                       ) -> list[tuple[int, BrokerError]]:
        """FIN a batch (offsets from the ids; -1 for an id that names none), in order;
        returns the failures as (index in offsets, error)."""
        failed: list[tuple[int, BrokerError]] = []
        in_flight = self.in_flight
        emptied: list[Flight] = []
        i = 0
        for off in offsets:
            f = in_flight.get(off)
            if f is None or f.client is not client:
                failed.append((i, NotInFlight() if f is None else NotOwner()))
            else:
                del in_flight[off]
                f.live -= 1
                if f.live == 0:
                    emptied.append(f)
            i += 1
        client.in_flight_count -= len(offsets) - len(failed)
        if emptied:
            self._drop_flights(emptied)
        if self.delivery_times:
            times = self.delivery_times
            for off in offsets:
                if off not in in_flight:
                    times.pop(off, None)
        return failed

    def requeue(self, client: Consumer, msg_id: bytes, delay_ns: int, now_ns: int,
                wall_ns: int) -> None:
        """REQ: back to the queue now (delay 0) or after delay_ns."""
        off, f = self._take(client, msg_id)
        self.requeue_count += 1
        if self.max_attempts:
            self._note_delivery(off, f.delivery_ns)
        if delay_ns <= 0:
            self.requeued.append((off, f.attempts))
        else:
            self._defer(Deferred(off, f.attempts, wall_ns + delay_ns), now_ns + delay_ns)

    def touch(self, client: Consumer, msg_id: bytes, now_ns: int, max_msg_timeout_ns: int) -> None:
        """TOUCH: push the deadline to now + the client's msg_timeout, capped at
        delivery + max_msg_timeout (matches nsqd)."""
        off, f = self._held(client, msg_id)
        deadline = min(now_ns + client.msg_timeout_ns, f.delivery_ns + max_msg_timeout_ns)
        if f.live > 1:
            # the others of its flight keep their deadline: this one gets a flight alone
            f.live -= 1
            single = Flight(client, off, 1, f.attempts, f.delivery_ns)
            self.in_flight[off] = single
            with self.lock:
                single.handle = self.in_flight_wheel.add(deadline, single)
            return
        with self.lock:
            if f.handle is not None:
                self.in_flight_wheel.remove(f.handle)
            f.handle = self.in_flight_wheel.add(deadline, f)

    # -- timeouts (scanner threads, then the owner) ---------------------------------
    def expire(self, now_ns: int) -> tuple[list[Flight], list[Deferred]]:
        """Pop timed-out flights and due deferred messages (called by a scanner).

        The caller hands both lists to the owner loop's ``requeue_expired``.
        """
        with self.lock:
            timed_out = self.in_flight_wheel.pop_expired(now_ns)
            for f in timed_out:
                f.handle = None
            due = self.deferred_wheel.pop_expired(now_ns)
            for d in due:
                d.handle = None
        return timed_out, due

    def requeue_expired(self, timed_out: list[Flight], due: list[Deferred]) -> None:
        """Owner side of expiry: release the clients' in-flight slots and requeue."""
        in_flight = self.in_flight
        for f in timed_out:
            offs = [off for off in f.offsets() if in_flight.get(off) is f]
            for off in offs:
                del in_flight[off]
                self.requeued.append((off, f.attempts))
                if self.max_attempts:
                    self._note_delivery(off, f.delivery_ns)
            if f.client is not None:
                f.client.in_flight_count -= len(offs)
            f.live = 0
            self.timeout_count += len(offs)
        for d in due:
            if self.deferred.get(d.offset) is d:
                del self.deferred[d.offset]
                self.requeued.append((d.offset, d.attempts))

    # -- admin (owner thread) -------------------------------------------------------
    def empty(self) -> None:
        """Drop every queued, in-flight and deferred message (HTTP /channel/empty)."""
        for f in set(self.in_flight.values()):
            if f.client is not None:
                f.client.in_flight_count -= sum(1 for off in f.offsets()
                                                if self.in_flight.get(off) is f)
        self.in_flight.clear()
        self.requeued.clear()
        self.deferred.clear()
        self.dying.clear()
        self.delivery_times.clear()
        with self.lock:
            self.in_flight_wheel.clear()
            self.deferred_wheel.clear()
        self.cursor = max(self.cursor, self.topic.released)

    def rewind(self, offset: int) -> None:
        """Deliver again from offset (within what the log holds; checked by the caller).
        Requeued and deferred messages at or after it are read again at the cursor;
        in-flight ones stay in flight (a FIN of either copy finishes it)."""
        self.extra_count += max(0, self.cursor - offset)
        self.requeued = deque(e for e in self.requeued if e[0] < offset)
        for off in [o for o in self.delivery_times if o >= offset and o not in self.in_flight]:
            del self.delivery_times[off]     # delivered anew: attempts counted anew
        later = [d for off, d in self.deferred.items() if off >= offset]
        for d in later:
            del self.deferred[d.offset]
        with self.lock:
            for d in later:
                if d.handle is not None:
                    self.deferred_wheel.remove(d.handle)
        self.cursor = offset

    # -- persistence (owner thread builds it; the storage thread writes it) ---------
    def snapshot(self, wall_ns: int, now_ns: int) -> dict[str, Any]:
        """The channel's saved state: everything below ``cursor`` not listed in
        ``pending`` is finished. pending: [offset, deliveries, due_wall_ns (0 = ready)]."""
        pending: list[list[int]] = [[off, f.attempts, 0] for off, f in self.in_flight.items()]
        pending += [[off, a, 0] for off, a in self.requeued]
        pending += [[off, a, 0] for off, a in self.dying.items()]    # dead-lettered again if need be
        with self.lock:
            wheel = self.deferred_wheel
            for d in self.deferred.values():
                due = d.due_wall_ns
                if not due and d.handle is not None:
                    due = wall_ns + max(0, wheel.deadline_of(d.handle) - now_ns)
                pending.append([d.offset, d.attempts, due])
        state: dict[str, Any] = {"cursor": self.cursor, "pending": pending,
                                 "paused": self.paused}
        if self.delivery_times:
            # first and last delivery (wall ms) of the requeued ones, for the envelope
            state["deliveries"] = [
                [off, (wall_ns - (now_ns - a)) // 1_000_000, (wall_ns - (now_ns - b)) // 1_000_000]
                for off, (a, b) in self.delivery_times.items()]
        return state

    def restore(self, state: dict[str, Any], now_ns: int, wall_ns: int) -> None:
        """Start-up, before clients: take a saved state (in flight becomes requeued)."""
        oldest = self.topic.log.oldest
        self.cursor = max(int(state.get("cursor", oldest)), oldest)
        self.start_offset = self.cursor
        for off, attempts, due in sorted(state.get("pending", [])):
            if off < oldest or off >= self.cursor:
                continue
            if due > wall_ns:
                self._defer(Deferred(off, attempts, due), now_ns + (due - wall_ns))
            else:
                self.requeued.append((off, attempts))
        for off, first_ms, last_ms in state.get("deliveries", []):
            if off >= oldest and self.max_attempts:
                self.delivery_times[off] = (now_ns - (wall_ns - first_ms * 1_000_000),
                                            now_ns - (wall_ns - last_ms * 1_000_000))
