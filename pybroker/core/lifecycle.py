"""A message's life on a channel: the state machine of docs/storage.md ("A message's
life on a channel"), its counters, and nothing else.

Every change of a message's state on a channel, and every counter /stats shows for
it, happens in a method of ``Lifecycle`` (one per event of the table). The Channel
subclass reads records and talks to consumers, and calls these; the one thing it does
itself is move the cursor over the records it read (each slice handed to ``_fly`` or
``_defer``). The states of an offset on one channel:

- **queued**: at or after ``cursor``, not in ``skip``: not yet read by this channel;
- **in flight**: ``in_flight.get(off)`` is the Flight it went out in (client,
  attempts, deadline in ``in_flight_wheel``); ``in_flight`` is an InFlight table
  (pybroker/_native/inflight.py: C arrays, a call per flight and per batch of FINs);
- **requeued**: an entry ``(off, attempts, mark)`` of the FIFO ``requeued``; it may go
  once the cursor has reached ``mark`` (nsqd's order: behind what was queued ahead of
  it, see ``_tail_mark``) or nothing is left at the cursor; the first ``ready_head``
  entries may go at once, whatever their marks (the ones a rewind found);
- **deferred**: ``deferred.get(off)`` (a DeferredSet, core/deferred.py; due time in
  ``deferred_wheel``);
- **dying**: ``dying[off]`` = attempts: its dead-letter publish is not yet confirmed;
- **finished**: none of the above and below the cursor: nothing is kept.

A rewind moves the cursor back; the offsets the channel still holds at or after it go
to ``skip`` (the cursor passes over them: each is delivered through its own state, so
no message is ever delivered while another delivery of it is in flight), and those in
flight or dying are owed a replay: when that life ends by FIN or dead-lettering, the
message is requeued once more with its attempts counted anew (the rewind's promise:
everything from the offset on is delivered again after it). The dying ones are listed
in ``replay``; the ones in flight are not listed: a rewind is noted in ``rewinds``
(with the count ``gen`` of rewinds so far, which each flight keeps from when it went
out), and a FIN'd message is owed its replay if a rewind after its flight went out
began at or before it (``_owed``). So a rewind costs a pass over the in-flight table
in C and one sorted list (``skip``), not a Python object per message in flight; the
offsets held elsewhere are kept as int64s beside their containers (``_rq_offs`` for
the requeued FIFO, ``DeferredSet.offsets_from`` a chunk of deferred ones) and copied
into that list's input, and the requeued entries it makes ready at once are counted
(``ready_head``), not rewritten.

Ownership: the channel's owner loop calls everything here except ``expire`` (the queue
scanners). ``lock`` guards the two timeout wheels only.
"""
from __future__ import annotations

import array
import bisect
import threading
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from itertools import repeat
from operator import itemgetter
from typing import TYPE_CHECKING, Any, TypedDict

from pybroker._native.inflight import InFlight, sort_order, sort_pairs
from pybroker.core.deferred import CHUNK_BITS, Chunks, DeferredSet
from pybroker.core.flight import Consumer, Deferred, Flight, offset_of
from pybroker.core.skip import Skip
from pybroker.core.timeouts import TimeoutWheel
from pybroker.errors import BrokerError, NotInFlight, NotOwner
from pybroker.jsonvalue import KeyedPart, PartedList, PartTexts

if TYPE_CHECKING:
    from pybroker.core.seams import TopicView

_FIRST = itemgetter(0)


RESTORE_STEP = 2048   # saved pending messages ``restore_steps`` takes per step
ARRAY_SLICE = 16_384  # offsets put into an array per call (``pending_chunks``)
# what one ``requeue_step`` of consumers that left does at most: the flights it looks
# through for theirs (a look about 50-100 ns: 250,000 one-message flights, scattered
# in memory, took 12-24 ms in one pass), and the messages it requeues (a one-message
# flight about 1 us: 16,384 of them took 21 ms)
SCAN_STEP = 32_768
LEAVE_STEP = 4096
# objects a step frees of what ``_empty`` dropped (``freeing``) (a flight of one message and its
# timer entry cost about 0.1-0.2 us to free: 250,000 took 11-21 ms in one go)
FREE_STEP = 32_768
# offsets of requeued messages taken that ``_rq_offs`` keeps at most before it cuts
# them off (once they are half of it)
RQ_CUT = 4096


# a container of what an empty dropped: flights by offset or by slot, timer buckets,
# offsets requeued or owed a replay
Litter = dict[Any, Any] | list[Any] | deque[Any] | set[Any]


def free_some(litter: list[Litter], budget: int) -> None:
    """Drop about ``budget`` entries of these containers (the last one's first), and
    the containers once empty; an entry that is itself a container of more than a few
    (a timer bucket) joins them, freed in the same way."""
    while litter and budget > 0:
        x = litter[-1]
        n = min(budget, len(x))
        nested: list[Litter] = []
        if isinstance(x, dict):
            for _ in range(n):
                v = x.popitem()[1]
                if type(v) is dict and len(v) > 64:
                    nested.append(v)
        elif isinstance(x, list):
            del x[len(x) - n:]
        else:
            for _ in range(n):
                x.pop()
        budget -= max(n, 1)
        if not x:
            litter.pop()           # (x: the nested ones are added after)
        litter += nested


def freeing(litter: list[Litter]) -> Generator[None, None, None]:
    """What an empty dropped (``_empty``'s return), freed FREE_STEP entries a step
    (the owner loop's ``run_steps``)."""
    while True:
        free_some(litter, FREE_STEP)
        if not litter:
            return
        yield


class _Leave:
    """Consumers that left together (``Lifecycle.leave``): the channel's flights as
    they were then, looked through SCAN_STEP a step for theirs, which are requeued
    LEAVE_STEP messages a step."""

    __slots__ = ("gone", "scan", "at", "found", "done")

    def __init__(self, gone: set[Consumer], scan: list[Flight]) -> None:
        self.gone = gone
        self.scan = scan
        self.at = 0            # flights of scan looked through
        self.found: list[Flight] = []
        self.done = 0          # flights of found requeued


def deferred_states(state: ChannelState, deferred: Chunks,
                    texts: PartTexts | None = None) -> None:
    """Complete a ``snapshot_parts`` state with its deferred messages, off the owner
    loop: its ``pending`` goes on in their chunks (a PartedList: encoded by
    ``dumps_yielding`` without copying them into it; core/deferred.py). ``texts``: the
    chunks' JSON kept from the last encoding of this channel's state (by the thread
    that encodes it), so that only the chunks that changed are encoded again."""
    if texts is None:
        state["pending"] = PartedList(state["pending"], deferred)
    else:
        state["pending"] = PartedList((), [*pending_chunks(state["pending"], texts),
                                           *deferred], texts)
    if isinstance(state.get("deliveries"), MadeLater):
        state["deliveries"] = list(state["deliveries"])
    if isinstance(state.get("skip"), MadeLater):
        state["skip"] = list(state["skip"])


class MadeLater(Sequence[Any]):
    """A list a channel's owner loop leaves to be made where it is first read (the
    storage thread, which completes and encodes the channel's state): it takes only
    C-level copies of its tables (``key``) and ``make(key)`` makes the items from
    them. A channel with 250,000 messages in flight took 52-84 ms of its loop to list
    them at each snapshot (every 200 ms on a replicated topic's leader); the copies
    take a few. Equal to another MadeLater of an equal key (the loop compares snapshots
    to find a changed one without making either), and to a list of its items."""

    __slots__ = ("key", "make", "_items")

    def __init__(self, key: tuple[Any, ...],
                 make: Callable[[tuple[Any, ...]], list[Any]]) -> None:
        self.key = key
        self.make = make
        self._items: list[Any] | None = None

    @property
    def made(self) -> list[Any] | None:
        """The items, if made already (else None)."""
        return self._items

    def items(self) -> list[Any]:
        got = self._items
        if got is None:
            got = self._items = self.make(self.key)   # (two threads: the same list)
        return got

    def __len__(self) -> int:
        return len(self.items())

    def __getitem__(self, i: Any) -> Any:
        return self.items()[i]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.items())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, MadeLater):
            return self.key == other.key
        if isinstance(other, list):
            return self.items() == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"MadeLater({self.items()!r})"


def _pending_of(key: tuple[Any, ...]) -> list[Any]:
    """A snapshot's ``pending`` entries but the deferred ones: in flight, requeued,
    dying; [offset, deliveries, 0] each (as tuples: untracked by the garbage
    collector once it has seen them)."""
    flying, requeued, dying = key
    out: list[Any] = flying.entries()
    out += [(off, a, 0) for off, a, _ in requeued]
    out += [(off, a, 0) for off, a in dying.items()]   # dead-lettered again if need be
    return out


def _pending_columns(key: tuple[Any, ...]) -> tuple[array.array[int], array.array[int]]:
    """``_pending_of`` as two arrays, in no order: the offsets ('q') and the attempts
    of each ('i')."""
    flying, requeued, dying = key
    offs, attempts = flying.columns()
    offs.extend([off for off, _, _ in requeued])
    attempts.extend([a for _, a, _ in requeued])
    offs.extend(dying)
    attempts.extend(dying.values())
    return offs, attempts


def _skip_of(key: tuple[Any, ...]) -> list[Any]:
    """A snapshot's ``skip``: the offsets of its copy (``Skip.copy``)."""
    return key[0].tolist()  # type: ignore[no-any-return]


def _deliveries_of(key: tuple[Any, ...]) -> list[Any]:
    """A snapshot's ``deliveries``: first and last delivery (wall ms) of each
    requeued message that has them. The key holds the wall clock's lead on the
    monotonic one in whole ms (not both clocks: two snapshots of the same deliveries
    then compare equal, and the leader ships no unchanged state)."""
    times, lead_ms = key
    return [[off, lead_ms + a // 1_000_000, lead_ms + b // 1_000_000]
            for off, (a, b) in times.items()]


def pending_chunks(entries: Iterable[Sequence[int]],
                   texts: PartTexts | None = None) -> list[KeyedPart]:
    """A state's pending entries but the deferred ones (in flight, requeued, dying),
    sorted and cut by offset into the chunks the deferred ones are kept in (CHUNK
    offsets each), each keyed by its chunk and kind (``jsonvalue.KeyedPart``). So the
    storage thread encodes again, and a leader ships again, only the chunks whose
    entries changed since the last encoding: a replicated channel holding 100,000 in
    flight, a few FINs a second, had its leader ship the whole list five times a
    second (15 MB/s to two followers).

    A snapshot's own entries (a MadeLater of ``_pending_of``) are taken as two arrays
    instead (``_pending_columns``), and with ``texts`` a chunk whose offsets and
    attempts are those of the part the last encoding kept for its key is that part
    again: only the chunks that changed are made as Python tuples. Made whole at each
    version, 250,000 in flight cost a leader's storage thread 30% of a core (five
    versions a second)."""
    if isinstance(entries, MadeLater) and entries.make is _pending_of \
            and entries.made is None:
        offs, attempts = _pending_columns(entries.key)
        return _column_chunks(offs, attempts, texts)
    listed = entries if isinstance(entries, list) else list(entries)
    n = len(listed)
    # sorted in C by offset, with each entry's index: a sort of the entries by Python
    # held the GIL throughout (63 ms with 250,000 in no order, every loop waiting);
    # the loops around it are bytecode, which offers the GIL as it goes, and the
    # offsets go into the array a slice at a time (250,000 scattered in memory took
    # 10-30 ms in one call)
    offs = array.array("q")
    for at in range(0, n, ARRAY_SLICE):
        offs.extend([e[0] for e in listed[at:at + ARRAY_SLICE]])
    order = sort_order(offs)
    items = listed if order is None else [listed[i] for i in order]
    return [KeyedPart(items[i:j], key) for key, i, j in _chunk_spans(offs)]


def _chunk_spans(offs: array.array[int]) -> Iterator[tuple[tuple[str, int], int, int]]:
    """Of sorted offsets, each chunk's key and its [i, j) (one bisection a chunk)."""
    i, n = 0, len(offs)
    while i < n:
        k = offs[i] >> CHUNK_BITS
        j = bisect.bisect_left(offs, (k + 1) << CHUNK_BITS, i)
        yield ("pending", k), i, j
        i = j


def _column_chunks(offs: array.array[int], attempts: array.array[int],
                   texts: PartTexts | None) -> list[KeyedPart]:
    """``pending_chunks`` of entries (offset, attempts, 0) given as two arrays in no
    order: sorted in C, and each chunk made as tuples only when the part kept for its
    key has other offsets or attempts (``KeyedPart.sig``: their bytes)."""
    sort_pairs(offs, attempts)
    ob, ab = memoryview(offs).cast("B"), memoryview(attempts).cast("B")
    out: list[KeyedPart] = []
    for key, i, j in _chunk_spans(offs):
        sig = ob[8 * i:8 * j].tobytes() + ab[4 * i:4 * j].tobytes()
        last = texts.last_part(key) if texts is not None else None
        if isinstance(last, KeyedPart) and last.sig == sig:
            out.append(last)
        else:
            part = KeyedPart(zip(offs[i:j], attempts[i:j], repeat(0, j - i)), key)
            part.sig = sig
            out.append(part)
    return out


def state_floor(state: ChannelState) -> int:
    """The lowest offset a complete state still needs: its lowest pending offset, or its
    cursor. The chunks of a complete state's ``pending`` (``deferred_states``: of the
    deferred messages, and of the others) each hold a range of CHUNK offsets: the
    lowest is in the lowest range, so a look at each chunk's first message and through
    the chunks of that range (two at most: one of each kind) finds it."""
    cursor = state["cursor"]
    pending = state["pending"]
    low = min(min(map(_FIRST, pending), default=cursor), cursor)
    parts = [p for p in getattr(pending, "parts", ()) if p]
    if parts:
        k = min(p[0][0] for p in parts) >> CHUNK_BITS
        for p in parts:
            if p[0][0] >> CHUNK_BITS == k:
                low = min(low, min(map(_FIRST, p)))
    return low


class ChannelState(TypedDict, total=False):
    """A channel's saved state (state/<topic>.json; docs/storage.md): built by
    ``snapshot`` on the owner loop, written by the storage thread, read back by
    ``restore``. pending: [offset, deliveries, due_wall_ns (0 = ready)]; deliveries:
    [offset, first_ms, last_ms]; ``paused`` is the Channel's, ``floor`` the storage
    thread's (the lowest offset the channel still needs)."""

    cursor: int
    # a deferred message's entry is the tuple it is kept as; a snapshot's are a MadeLater
    # until the thread that completes it reads them (``deferred_states``)
    pending: Sequence[Sequence[int]]
    skip: Sequence[int]
    deliveries: Sequence[Sequence[int]]
    paused: bool
    floor: int
    settings: dict[str, object]   # a replicated topic's leader ships its own dead-letter
    #                               settings with it (not in the state files: nsqd.dat)


class Lifecycle:
    """The per-message state of one channel and the transitions between states."""

    topic: TopicView
    max_attempts: int

    def __init__(self, cursor: int) -> None:
        # between the owner loop and the scanner workers (expire): the timeout wheels
        self.lock = threading.Lock()
        self.cursor = cursor
        self.start_offset = cursor        # for message_count
        self.in_flight: InFlight[Flight] = InFlight()
        self.in_flight_wheel: TimeoutWheel[Flight] = TimeoutWheel()
        self.requeued: deque[tuple[int, int, int]] = deque()   # (offset, attempts, mark)
        self.ready_head = 0      # requeued entries at the head ready at once (a rewind's)
        # the offsets of ``requeued`` as int64s, from ``_rq_head`` on (a rewind's listing)
        self._rq_offs = array.array("q")
        self._rq_head = 0
        self.deferred = DeferredSet()
        self.deferred_wheel: TimeoutWheel[Deferred] = TimeoutWheel()
        self.dying: dict[int, int] = {}    # dead-letter publish not yet confirmed
        self.skip = Skip()                 # held offsets at or after the cursor, sorted
        self.replay: set[int] = set()      # dying when rewound over
        self.gen = 0                       # rewinds so far (a flight keeps its value)
        # (gen after it, offset) of each rewind that may concern a flight in flight
        self.rewinds: list[tuple[int, int]] = []
        # only with max_attempts: offset -> (first, last) delivery (monotonic ns) of the
        # messages requeued at least once
        self.delivery_times: dict[int, tuple[int, int]] = {}
        self.extra_count = 0               # message_count beyond what the cursor saw
        # consumers that left, their messages in flight requeued a step at a time
        self.leaving: deque[_Leave] = deque()
        self.requeue_count = 0
        self.timeout_count = 0
        self.dropped_count = 0             # ephemeral overflow, sampled out
        self.dead_letter_count = 0
        self.dead_letter_cycles = 0        # not moved: they would re-enter a topic

    # -- where a requeued message goes (nsqd's order) ---------------------------------
    def _tail_mark(self) -> int:
        """The cursor position a message requeued now waits for: the messages queued
        ahead of it (nsqd puts it at the tail of the channel's memory queue), at most
        mem_queue_size of them (what nsqd's memory queue holds; a deeper backlog is on
        nsqd's disk, read in no fixed order with the memory queue)."""
        released = self.topic.released
        depth = self.topic.mem_queue_size
        return released if depth <= 0 else min(released, self.cursor + depth)

    def _requeue(self, off: int, attempts: int, mark: int) -> None:
        self.requeued.append((off, attempts, mark))
        self._rq_offs.append(off)

    def head_ready(self) -> bool:
        """The first requeued message may go now."""
        mark = self.requeued[0][2]
        return self.ready_head > 0 or mark <= self.cursor or self.cursor >= self.topic.released

    def _pop_requeued(self) -> tuple[int, int, int]:
        """The first requeued entry, taken off the FIFO."""
        if self.ready_head:
            self.ready_head -= 1
        head = self._rq_head = self._rq_head + 1
        if head >= RQ_CUT and 2 * head >= len(self._rq_offs):
            del self._rq_offs[:head]        # (amortized: at least as many since)
            self._rq_head = 0
        return self.requeued.popleft()

    def requeued_offsets(self) -> array.array[int]:
        """The offsets of ``requeued``, in its order (a copy of int64s)."""
        return self._rq_offs[self._rq_head:]

    def requeue_imported(self, offsets: Sequence[int]) -> None:
        """Import (nsqd data): these offsets are queued for this channel, ready now."""
        self.requeued.extend((off, 0, 0) for off in offsets)
        self._rq_offs.extend(offsets)

    # -- deliver: queued / requeued -> in flight ---------------------------------------
    def _fly(self, c: Consumer, first: int, n: int, attempts: int, now_ns: int,
             deadline_ns: int) -> Flight:
        f = self._flight(c, first, n, attempts, now_ns)
        with self.lock:
            f.handle = self.in_flight_wheel.add(deadline_ns, f)
        return f

    def _flight(self, c: Consumer, first: int, n: int, attempts: int,
                now_ns: int) -> Flight:
        """Messages [first, first + n) in flight to c, not yet on the timeout wheel
        (``_fly`` puts it there; a dispatch pass may put several at once)."""
        f = Flight(c, first, n, attempts, now_ns, self.gen)
        self.in_flight.add_flights((f,))
        c.in_flight_count += n
        return f

    def _fly_pass(self, first: int, sends: list[tuple[Consumer, int, int]],
                  now_ns: int) -> None:
        """dispatch's common case (Channel._spread): a pass hands consecutive messages
        from ``first`` on to consumers, (consumer, count, _) each in order, a first
        delivery. Each slice becomes a flight, counted in flight to its consumer; all of
        them go into the table in one call and onto the timeout wheel under one taking
        of the lock (one bucket when the consumers share a msg_timeout)."""
        flights = []
        timeout = sends[0][0].msg_timeout_ns
        shared = True
        gen = self.gen
        for c, n, _ in sends:
            c.in_flight_count += n
            flights.append(Flight(c, first, n, 1, now_ns, gen))
            first += n
            if c.msg_timeout_ns != timeout:
                shared = False
        self.in_flight.add_flights(flights)
        with self.lock:
            if shared:
                for f, h in zip(flights, self.in_flight_wheel.add_all(now_ns + timeout,
                                                                        flights)):
                    f.handle = h
                return
            add = self.in_flight_wheel.add
            for f, (c, _, _) in zip(flights, sends):
                f.handle = add(now_ns + c.msg_timeout_ns, f)

    def _pass_skipped(self) -> None:
        """The cursor moves over held offsets a rewind left at it (delivered through
        their own states)."""
        skip = self.skip
        while skip and skip.first() <= self.cursor:
            if skip.popleft() == self.cursor:
                self.cursor += 1

    def _advance(self, to: int) -> None:
        """The cursor jumps forward to ``to`` (messages between are dropped or gone)."""
        if to > self.cursor:
            self.cursor = to
            self.skip.drop_below(to)

    # -- FIN: in flight -> finished ------------------------------------------------------
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
        emptied = self.in_flight.pop(off)[1]
        client.in_flight_count -= 1
        if emptied:
            self._drop_flights([f])
        return off, f

    def _drop_flights(self, flights: Sequence[Flight]) -> None:
        if not flights:
            return
        if self.rewinds and not self.in_flight:
            self.rewinds.clear()          # no flight is left that one concerns
        with self.lock:
            remove = self.in_flight_wheel.remove
            for f in flights:
                if f.handle is not None:
                    remove(f.handle)
                    f.handle = None

    def _owed(self, off: int, f: Flight) -> bool:
        """Was off, in flight in f, rewound over since f went out?"""
        for gen, at in reversed(self.rewinds):
            if gen <= f.gen:
                return False
            if off >= at:
                return True
        return False

    def _replayed(self, off: int) -> None:
        """A rewound-over message's life ended (FIN, dead-lettered): once more, anew."""
        self.replay.discard(off)
        self.delivery_times.pop(off, None)
        self._requeue(off, 0, 0)
        self.extra_count += 1

    def finish(self, client: Consumer, msg_id: bytes) -> int:
        """FIN: the message is done; returns its offset. Raises NotInFlight / NotOwner."""
        # (owed asked before it leaves: the last one out of flight ends ``rewinds``)
        owed = bool(self.rewinds) and self._owed(*self._held(client, msg_id))
        off = self._take(client, msg_id)[0]
        if self.delivery_times:
            self.delivery_times.pop(off, None)
        if owed:
            self._replayed(off)
        return off

    def finish_offsets(self, client: Consumer, offsets: Sequence[int]
                       ) -> list[tuple[int, BrokerError]]:
        """FIN a batch (offsets from the ids; -1 for an id that names none), in order;
        returns the failures as (index in offsets, error)."""
        return self.finish_runs(((client, offsets),))[0]

    def finish_runs(self, runs: Sequence[tuple[Consumer, Sequence[int]]]
                    ) -> list[list[tuple[int, BrokerError]]]:
        """finish_offsets for several consumers' batches at once (a turn's FINs read by
        the lane): the timeout wheel is changed under one taking of the lock. Returns
        each run's failures."""
        owed: set[int] = set()
        if self.rewinds:
            # which were rewound over since they went out (asked before they leave)
            get = self.in_flight.get
            for client, offsets in runs:
                for off in offsets:
                    f = get(off)
                    if f is not None and f.client is client and self._owed(off, f):
                        owed.add(off)
        bads, emptied = self.in_flight.finish(runs)
        times = self.delivery_times
        out: list[list[tuple[int, BrokerError]]] = []
        for (client, offsets), bad in zip(runs, bads):
            failed: list[tuple[int, BrokerError]] = [
                (i, NotOwner() if other else NotInFlight()) for i, other in bad] if bad else []
            if times or owed:
                skip = {i for i, _ in bad}
                for i, off in enumerate(offsets):
                    if i in skip:
                        continue
                    if times:
                        times.pop(off, None)
                    if owed and off in owed:
                        self._replayed(off)
            client.in_flight_count -= len(offsets) - len(failed)
            out.append(failed)
        if emptied:
            self._drop_flights(emptied)
        return out

    def finish_singles(self, clients: Sequence[Consumer], offs: Sequence[int]
                       ) -> list[tuple[int, BrokerError]]:
        """finish_runs where each consumer FINs one offset (a turn's FINs at RDY 1):
        the same outcome, in the same order (the same offset named twice fails the
        second time as it would there), without a run per consumer. Returns the
        failures as (index, error)."""
        if self.delivery_times or self.rewinds:
            rest = list(range(len(offs)))   # their bookkeeping is finish_runs'
        else:
            gone, rest = self.in_flight.finish_singles(clients, offs)
            for f in gone:
                f.client.in_flight_count -= 1    # type: ignore[union-attr]
            if gone:
                self._drop_flights(gone)
        if not rest:
            return []
        fails = self.finish_runs([(clients[i], (offs[i],)) for i in rest])
        return [(i, f[0][1]) for i, f in zip(rest, fails) if f]

    # -- REQ: in flight -> requeued (no delay) / deferred --------------------------------
    def requeue(self, client: Consumer, msg_id: bytes, delay_ns: int, now_ns: int,
                wall_ns: int) -> None:
        """REQ: to the tail of the queue now (delay 0) or after delay_ns."""
        failed = self.requeue_run(client, (offset_of(msg_id),), (delay_ns,), now_ns, wall_ns)
        if failed:
            raise failed[0][1]

    def requeue_run(self, client: Consumer, offsets: Sequence[int], delays: Sequence[int],
                    now_ns: int, wall_ns: int) -> list[tuple[int, BrokerError]]:
        """REQs of ``client`` in order (offsets, -1 for an id that names none; each
        with its delay), as one by one, with the timeout wheel changed under one
        taking of the lock (a REQ, or a run of REQ lines the FIN lane read:
        server/lane.py).
        Returns the failures as (index, error)."""
        failed: list[tuple[int, BrokerError]] = []
        emptied: list[Flight] = []
        get = self.in_flight.get
        pop = self.in_flight.pop
        for i, off in enumerate(offsets):
            f = get(off)
            if f is None or f.client is not client:
                failed.append((i, NotInFlight() if f is None else NotOwner()))
                continue
            if pop(off)[1]:
                emptied.append(f)
            client.in_flight_count -= 1
            self.requeue_count += 1
            self.replay.discard(off)
            if self.max_attempts:
                self._note_delivery(off, f.delivery_ns)
            delay_ns = delays[i]
            if delay_ns <= 0:
                self._requeue(off, f.attempts, self._tail_mark())
            else:
                self._defer((off, f.attempts, wall_ns + delay_ns), now_ns + delay_ns)
        self._drop_flights(emptied)
        return failed

    def _defer(self, d: Deferred, deadline_ns: int) -> None:
        with self.lock:
            self.deferred_wheel.add(deadline_ns, d)
        self.deferred.add(d)

    def _note_delivery(self, off: int, delivery_ns: int) -> None:
        """Remember when a message about to be requeued was first and last delivered."""
        seen = self.delivery_times.get(off)
        self.delivery_times[off] = (delivery_ns if seen is None else seen[0], delivery_ns)

    # -- TOUCH: in flight, new deadline --------------------------------------------------
    def touch(self, client: Consumer, msg_id: bytes, now_ns: int, max_msg_timeout_ns: int) -> None:
        """TOUCH: push the deadline to now + the client's msg_timeout, capped at
        delivery + max_msg_timeout (matches nsqd)."""
        off, f = self._held(client, msg_id)
        deadline = min(now_ns + client.msg_timeout_ns, f.delivery_ns + max_msg_timeout_ns)
        if self.in_flight.live(f) > 1:
            # the others of its flight keep their deadline: this one gets a flight alone
            self.in_flight.pop(off)
            single = Flight(client, off, 1, f.attempts, f.delivery_ns, f.gen)
            self.in_flight.add_flights((single,))
            with self.lock:
                single.handle = self.in_flight_wheel.add(deadline, single)
            return
        with self.lock:
            if f.handle is not None:
                self.in_flight_wheel.remove(f.handle)
            f.handle = self.in_flight_wheel.add(deadline, f)

    # -- timeout: in flight -> requeued; deferred due -> requeued ------------------------
    def expire(self, now_ns: int) -> tuple[list[Flight], list[Deferred]]:
        """Pop timed-out flights and due deferred messages (called by a scanner).

        The caller hands both lists to the owner loop's ``requeue_expired``.
        """
        with self.lock:
            timed_out = self.in_flight_wheel.pop_expired(now_ns)
            for f in timed_out:
                f.handle = None
            due = self.deferred_wheel.pop_expired(now_ns)
        return timed_out, due

    def requeue_expired(self, timed_out: list[Flight], due: list[Deferred]) -> None:
        """Owner side of expiry: release the clients' in-flight slots and requeue at
        the tail (nsqd: a timed-out or due message is put behind the queued ones)."""
        in_flight = self.in_flight
        mark = self._tail_mark()
        for f in timed_out:
            offs = in_flight.take(f)
            for off in offs:
                self.replay.discard(off)
                self._requeue(off, f.attempts, mark)
                if self.max_attempts:
                    self._note_delivery(off, f.delivery_ns)
            if f.client is not None:
                f.client.in_flight_count -= len(offs)
            self.timeout_count += len(offs)
        for d in due:
            if self.deferred.discard(d):    # not dropped (or deferred again) meanwhile
                self._requeue(d[0], d[1], mark)

    # -- client disconnect: its in flight -> requeued -------------------------------------
    def leave(self, cs: Sequence[Consumer]) -> bool:
        """These detached consumers went away together (a loop turn's): what they hold
        in flight is requeued (beyond nsqd, which waits for their timeout: nsq #137),
        at the tail, in offset order, by ``requeue_step``, a step at a time; True if
        there is any (their flights looked for in one pass for all of them, not one
        each: a fleet of 100 leaving with 250,000 one-message flights took 485 ms in a
        turn, one pass each)."""
        holding = {c for c in cs if c.in_flight_count > 0}
        if not holding:
            return False
        self.leaving.append(_Leave(holding, self.in_flight.flights()))
        return True

    def requeue_step(self) -> tuple[int, bool]:
        """A step of what ``leave`` left to do: at most SCAN_STEP flights looked
        through and LEAVE_STEP messages (a flight at least) requeued. Returns (how many
        were requeued, whether steps are left)."""
        requeued = 0
        scan = SCAN_STEP
        budget = LEAVE_STEP
        while self.leaving and budget > 0:
            job = self.leaving[0]
            if job.at < len(job.scan):
                if scan <= 0:
                    break
                chunk = job.scan[job.at:job.at + scan]
                gone = job.gone
                job.found += [f for f in chunk if f.client in gone]
                job.at += len(chunk)
                scan -= len(chunk)
                if job.at == len(job.scan):
                    job.scan = []
                    job.at = 0
                continue
            i = job.done
            found = job.found
            while i < len(found) and (budget > 0 or i == job.done):
                budget -= found[i].n
                i += 1
            requeued += self._requeue_flights(found[job.done:i])
            job.done = i
            if i == len(found):
                self.leaving.popleft()
        return requeued, bool(self.leaving)

    def _requeue_flights(self, flights: Sequence[Flight]) -> int:
        """Requeue what is still in flight in these flights (found now or steps ago),
        at the tail, in offset order; returns how many."""
        if not flights:
            return 0
        in_flight = self.in_flight
        mine = sorted(((off, f) for f in flights for off in in_flight.take(f)), key=_FIRST)
        mark = self._tail_mark()
        for off, f in mine:
            self.replay.discard(off)
            self._requeue(off, f.attempts, mark)
            if self.max_attempts:
                self._note_delivery(off, f.delivery_ns)
            client = f.client
            if client is not None:
                client.in_flight_count -= 1
        self._drop_flights(flights)
        self.requeue_count += len(mine)
        return len(mine)

    # -- max attempts: requeued -> dying -> finished (or requeued) -----------------------
    def _dying(self, off: int, attempts: int) -> None:
        self.dying[off] = attempts

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
                if off in self.replay:
                    self._replayed(off)
            else:
                self.replay.discard(off)
                self._requeue(off, attempts, 0)
        self.dead_letter_count += done
        return done

    def _not_moved(self, off: int, finished: bool) -> None:
        """A message out of attempts that would re-enter a topic it was dead-lettered
        from, first met: finished here (its topic's dead-letters channel keeps it), or
        (nothing keeps it) delivered on by the caller."""
        if finished:
            self.delivery_times.pop(off, None)
        self.dead_letter_cycles += 1

    # -- admin: empty, rewind, commit ----------------------------------------------------
    def _empty(self, consumers: Iterable[Consumer]) -> list[Litter]:
        """Drop every queued, in-flight, requeued, deferred and dying message
        (``Channel.empty``: HTTP /channel/empty, channel delete). ``consumers``: every
        consumer of the channel; each then holds nothing in flight, since what a consumer holds is on
        its one channel (no pass over the messages in flight counts them: 250,000
        counted a call each took 42 ms). Returns the containers dropped, not freed
        (``freeing``: 250,000 one-message flights freed in one go took 11-21 ms)."""
        for c in consumers:
            c.in_flight_count = 0
        litter: list[Litter] = [*self.in_flight.drop_all(), self.requeued,
                                self.replay, self.delivery_times]
        self.requeued = deque()
        self.ready_head = 0
        self._rq_offs, self._rq_head = array.array("q"), 0
        self.skip = Skip()           # (one array: freed at once)
        self.replay = set()
        self.delivery_times = {}
        self.deferred.clear()
        self.dying.clear()
        self.rewinds.clear()
        self.leaving.clear()
        with self.lock:
            litter.append(self.in_flight_wheel.drop_all())
            litter.append(self.deferred_wheel.drop_all())
        self.cursor = max(self.cursor, self.topic.released)
        return [x for x in litter if x]

    def _to_read(self) -> int:
        """Offsets the cursor has yet to hand out (queued), gaps and DPUBs included."""
        return max(0, self.topic.released - self.cursor - len(self.skip))

    def rewind(self, offset: int) -> None:
        """Deliver again from offset (within what the log holds; checked by the caller).
        Messages the channel holds at or after it keep their state (in flight ones
        stay in flight and are owed one more delivery once FIN'd); requeued ones are
        ready at once, ahead of the replayed range. See the module docstring."""
        before = self._to_read()
        if self.in_flight:
            # each FIN'd later is owed its replay if it went out before this (``_owed``)
            self.gen += 1
            self.rewinds.append((self.gen, offset))
        dying = [off for off in self.dying if off >= offset]
        self.replay.update(dying)
        # the offsets held elsewhere, packed a container (a chunk) at a time; the ones
        # below offset are dropped in C (250,000 requeued and 250,000 deferred listed
        # and filtered in Python, the requeued entries made again with mark 0, held
        # the loop 61-68 ms)
        held = array.array("q", dying)
        self.deferred.offsets_from(offset, held)
        if self.requeued:
            held += self.requeued_offsets()
            self.ready_head = len(self.requeued)     # ready at once, ahead of the range
        # and every offset in flight from there on: sorted in C with the others
        self.skip = Skip(self.in_flight.sorted_from(offset, held))
        self.cursor = offset
        self.extra_count += max(0, self._to_read() - before)

    def commit(self, offset: int) -> int:
        """/channel/commit: what is below offset is finished for this channel (never
        moves the cursor back); returns the cursor."""
        self._advance(offset)
        return self.cursor

    # -- persistence (owner thread builds it; the storage thread writes it) -------------
    def snapshot(self, wall_ns: int, now_ns: int) -> ChannelState:
        """The channel's saved state: everything below ``cursor`` not listed in
        ``pending`` is finished, and so is everything in ``skip`` not pending.
        pending: [offset, deliveries, due_wall_ns (0 = ready)]. Whole, in one list (the
        loops take ``snapshot_parts``, and the storage thread completes it)."""
        state, deferred = self.snapshot_parts(wall_ns, now_ns)
        state["pending"] = [*state["pending"], *(e for part in deferred for e in part)]
        if "deliveries" in state:
            state["deliveries"] = list(state["deliveries"])
        if "skip" in state:
            state["skip"] = list(state["skip"])
        return state

    def snapshot_parts(self, wall_ns: int, now_ns: int) -> tuple[ChannelState, Chunks]:
        """``snapshot`` without its deferred messages, and those (in chunks: their
        entries go in ``pending``; ``deferred_states`` adds them on another thread). The
        owner loop builds again only the chunks that changed since the last snapshot
        (core/deferred.py); what it returns is never changed (callers read it, on any
        thread). Copied whole at each change, 1,000,000 deferred messages cost the loop
        about 10 ms a snapshot (each 200 ms on a replicated topic's leader)."""
        # copies only (MadeLater): the entries are made by the thread that completes it
        pending = MadeLater((self.in_flight.copy(), tuple(self.requeued), self.dying.copy()),
                        _pending_of)
        state: ChannelState = {"cursor": self.cursor, "pending": pending}
        if self.skip:
            state["skip"] = MadeLater((self.skip.copy(),), _skip_of)
        if self.delivery_times:
            # first and last delivery (wall ms) of the requeued ones, for the envelope
            state["deliveries"] = MadeLater(
                (self.delivery_times.copy(), (wall_ns - now_ns) // 1_000_000), _deliveries_of)
        return state, self.deferred.snapshot()

    def restore(self, state: ChannelState, now_ns: int, wall_ns: int) -> None:
        """Start-up, before clients: take a saved state (in flight and dying become
        requeued, ready at once, in offset order)."""
        for _ in self.restore_steps(state, now_ns, wall_ns):
            pass

    def restore_steps(self, state: ChannelState, now_ns: int,
                      wall_ns: int) -> Generator[None, None, None]:
        """``restore`` in steps of RESTORE_STEP pending messages (a new leader's channel,
        built a step a turn before it is added to its topic: pybroker.cluster.takeover)."""
        oldest, written = self.topic.log.oldest, self.topic.log.written
        # never past the log's end: a saved cursor beyond it names messages this log
        # does not hold (a state not of this log), and would skip the ones published
        # there next; what it does hold is delivered again instead
        self.cursor = min(max(int(state.get("cursor", oldest)), oldest), max(written, oldest))
        self.start_offset = self.cursor
        skip = sorted({int(o) for o in state.get("skip", []) if int(o) >= self.cursor})
        self.skip = Skip(skip)
        self.extra_count = -len(skip)      # message_count: what is left to read
        ahead = set(skip)
        # one pass in steps: a deferred message is deferred as it comes (any order); the
        # others are requeued after, in offset order. Sorting every pending message in
        # one step held a new leader's loop about 40 ms with 1,000,000 deferred.
        ready: list[tuple[int, int]] = []
        for i, p in enumerate(state.get("pending", [])):
            if i % RESTORE_STEP == RESTORE_STEP - 1:
                yield
            off, attempts, due = p
            if off < oldest or off >= self.cursor and off not in ahead:
                continue
            if due > wall_ns:
                # a tuple decoded (pybroker.jsonvalue.loads_steps) is kept as it is: a
                # new one each, and the decoded ones freed in the last step, held a
                # new leader's loop about 40 ms with 1,000,000 deferred
                self._defer(p if type(p) is tuple else (off, attempts, due),
                            now_ns + (due - wall_ns))
            else:
                ready.append((off, attempts))
        yield from self.deferred.freeze_steps(RESTORE_STEP)
        ready.sort()
        for i, (off, attempts) in enumerate(ready):
            if i % RESTORE_STEP == RESTORE_STEP - 1:
                yield
            self._requeue(off, attempts, 0)
        for i, (off, first_ms, last_ms) in enumerate(state.get("deliveries", [])):
            if i % RESTORE_STEP == RESTORE_STEP - 1:
                yield
            if off >= oldest and self.max_attempts:
                self.delivery_times[off] = (now_ns - (wall_ns - first_ms * 1_000_000),
                                            now_ns - (wall_ns - last_ms * 1_000_000))
