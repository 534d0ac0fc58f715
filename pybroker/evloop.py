"""SelectorLoop: the one event-loop mechanism (a thread, a selector, timers, a call queue).

Theory of operation
-------------------
A SelectorLoop runs on one thread and owns its selector, every object registered with
it and its timers; nothing else touches them. Other threads reach it only through
``call_soon_threadsafe(fn, *args)``: a deque plus one byte written to a wake-up
socketpair registered with the selector (the ``CallQueue``).

One turn (``run_once``): compute the timeout (0 when calls are queued or the subclass
says it has work, ``busy()``; else until the next timer); ``select()``; for each ready
object call ``on_readable()`` and/or ``on_writable()`` (an exception closes that object
through ``on_error`` and never the loop); fire due timers; run queued calls; then the
subclass's ``end_of_turn()``. ``stop()`` (any thread) ends the loop after the current
turn; ``on_exit()`` runs on the loop's thread after the last turn. A loop made with
``spin_ns`` (the broker's, ``loop_spin``) that would sleep after a turn with events
looks again without sleeping for up to that long first (``_spin``; docs/io.md).

Work that is best done once for many events (a replication leader's answer to a
follower, which then carries every write made meanwhile) is deferred to the loop's next
idle moment: ``when_idle(key, fn, *args)`` (owner thread only; one call per key, the
last one given). The calls run in a turn of their own once a look without sleeping
(``_look``, up to IDLE_LOOK_NS, at most the spin) finds no event, or at the end of a
turn IDLE_MAX_NS after the first was deferred, whichever comes first: a loop that is
never idle still runs them that often.

A reply known to be coming soon (a replication leader's follower acknowledging the
records just sent, a follower's leader answering a fetch while records flow) is worth a
longer look than the spin: ``spin_for(ns)`` (owner thread only) makes the next sleep
look without sleeping for up to ns first. Such looks that find nothing SPIN_MISSES times
in a row stop them (one in SPIN_PROBE tries again), as for the spin; a loop made
without a spin ignores them.

Input the selector cannot see: an object that stopped reading with bytes already in
hand (its per-turn budget ran out: a decompressed stream, TLS records in a BIO, the
rest of a large read) asks ``read_again(obj)``; its ``on_readable()`` then runs once in
the next turn, after the selector's events, as if its socket were readable (and the
turn does not sleep in ``select``). Owner thread only; ``forget_again(obj)`` drops the
request (an object handed to another loop).

Used by the broker's event loops (pybroker.server.loop), the HTTP server
(pybroker.http.server) and the client library's IOLoop (pybroker.client.loop). Imports
only the standard library: any layer may use it.

Timers: ``call_later(delay_ns, fn, *args)`` returns a handle for ``cancel(handle)``
(owner thread only). The structure holding them is pluggable (``Timers``): a heap by
default; the broker's loops pass pybroker.core.timeouts.TimeoutWheel, whose add and
remove are dict operations at high rates.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import os
import socket
import threading
import time
from _thread import get_ident
from collections import deque
from collections.abc import Generator
from typing import Any, Callable, Protocol, TypeVar, TypeVarTuple, Unpack

from pybroker.poller import EVENT_READ, EVENT_WRITE, Poller

log = logging.getLogger("pybroker")
# timers run per turn at most: 500 handshakes reaching their deadline together (each
# logs and closes) would otherwise hold one turn ~75 ms; the rest run next turn
TIMERS_PER_TURN = 64
monotonic_ns = time.monotonic_ns
Call = tuple[Callable[..., object], tuple[object, ...]]   # fn and its arguments
Ts = TypeVarTuple("Ts")
R = TypeVar("R")


class Pollable(Protocol):
    """What a SelectorLoop needs from an object it watches."""

    def on_readable(self) -> None: ...
    def on_writable(self) -> None: ...


class Timers(Protocol):
    """A deadline-ordered store of timer entries (owner thread only). Each store has
    its own handle type (the heap's entry, the wheel's (bucket, seq)); the loop hands
    back to ``remove`` what ``add`` returned, so the Protocol leaves handles untyped."""

    def add(self, deadline_ns: int, item: Call) -> Any: ...
    def remove(self, handle: Any) -> bool: ...
    def pop_expired(self, now_ns: int, limit: int = 0) -> list[Call]: ...
    def next_deadline(self) -> int | None: ...


# (deadline_ns, seq, [call, or None once removed]): seq is unique, so entries compare by
# the two integers only
HeapEntry = tuple[int, int, list[Call | None]]


class HeapTimers:
    """Timers in a heap; a removed entry is marked dead and skipped when it comes up."""

    __slots__ = ("_heap", "_seq")

    def __init__(self) -> None:
        self._heap: list[HeapEntry] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, deadline_ns: int, item: Call) -> HeapEntry:
        entry: HeapEntry = (deadline_ns, next(self._seq), [item])
        heapq.heappush(self._heap, entry)
        return entry

    def remove(self, handle: HeapEntry) -> bool:
        cell = handle[2]
        alive = cell[0] is not None
        cell[0] = None
        return alive

    def pop_expired(self, now_ns: int, limit: int = 0) -> list[Call]:
        heap = self._heap
        out: list[Call] = []
        while heap and heap[0][0] <= now_ns and not (limit and len(out) >= limit):
            item = heapq.heappop(heap)[2][0]
            if item is not None:
                out.append(item)
        return out

    def next_deadline(self) -> int | None:
        heap = self._heap
        while heap and heap[0][2][0] is None:
            heapq.heappop(heap)
        return heap[0][0] if heap else None


# a turn runs queued cross-thread calls for about this long at most (CallQueue.run)
CALLS_BUDGET_NS = 5_000_000
CALLS_LOOK = 32       # calls between looks at the clock
# a turn's ready objects: past this, the rest are read next turn (their reads only; a
# burst of thousands of connections' first commands held a turn 30-50 ms), the clock
# looked at every EVENTS_LOOK of them
EVENTS_BUDGET_NS = 6_000_000
EVENTS_LOOK = 64


class CallQueue:
    """How other threads hand work to a selector loop's thread.

    A deque of calls plus one byte written to a socketpair registered with the loop's
    selector; the byte is written only when the loop may be asleep (``_pending`` is
    clear). The owner drains the socket first and clears the flag after: a call queued
    while the flag was still set sent no byte, but it is run by the drain of the calls
    that follows in the same turn (clearing first could swallow a fresh byte: a lost
    wake-up).
    """

    def __init__(self, selector: "Poller[Pollable | None]", token: None = None) -> None:
        self._calls: deque[Call] = deque()
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)
        self._w.setblocking(False)
        self._pending = False
        selector.register(self._r, EVENT_READ, token)

    def __bool__(self) -> bool:
        return bool(self._calls)

    def call_soon_threadsafe(self, fn: Callable[[Unpack[Ts]], object],
                             *args: Unpack[Ts]) -> None:
        """Queue fn(*args) for the owner's thread (any thread)."""
        self._calls.append((fn, args))
        if not self._pending:
            self._pending = True
            try:
                self._w.send(b"\0")
            except OSError:
                pass  # already full of wake-ups, or closing

    def drain_wakeups(self) -> None:
        """The socket was readable (owner thread)."""
        try:
            while self._r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            pass   # closed under us at shutdown
        self._pending = False

    def run(self, owner: str, budget_ns: int | None = None) -> None:
        """Run the queued calls (owner thread); an error is logged, never raised. With
        ``budget_ns``, stop once about that long has passed (looked at every
        CALLS_LOOK calls): the rest run in the turns after, which do not sleep while
        calls wait (a burst of 10,000 at once, a topic's deletion closing each of its
        channels, held a loop 70 ms in one turn)."""
        calls = self._calls
        end = 0 if budget_ns is None else monotonic_ns() + budget_ns
        n = 0
        while calls:
            fn, args = calls.popleft()
            try:
                fn(*args)
            except Exception:
                log.exception("%s: error in a cross-thread call %r", owner, fn)
            n += 1
            if end and n % CALLS_LOOK == 0 and monotonic_ns() >= end:
                return

    def close(self) -> None:
        self._r.close()
        self._w.close()


# (Unix; elsewhere a spin just looks again)
sched_yield: Callable[[], None] = getattr(os, "sched_yield", lambda: None)
# when_idle: its calls run once a look finds no event for this long (at most the
# spin), or this long after the first was deferred, whichever comes first. 4
# producers at depth 1 on a replicated topic: a leader's answer to its follower carries
# 3.6 publishes (not 2.0) and the three nodes' CPU a message falls 30 %
# (docs/replication.md, "Answers when the loop is idle")
IDLE_LOOK_NS = 10_000
IDLE_MAX_NS = 300_000
# spin_for's usual length: a replication round's reply (a follower's acknowledgement,
# a leader's answer while records flow) comes within it under load. PUB 4 x 1 on a
# replicated topic, both sides looking: 1.2x the rate, for the member follower's CPU
# spent looking (docs/replication.md, "Looking for a reply that is coming")
REPLY_SPIN_NS = 1_000_000
SPIN_MISSES = 4     # spins in a row that found nothing: stop spinning
SPIN_PROBE = 64     # then one in this many sleeps spins again, to notice a fast client
# how long turns took (their work, from the events on: not the sleep or the spin
# before), counted in these buckets (upper bounds, ns; /metrics'
# pybroker_loop_turn_seconds): a turn's budget is 20 ms
TURN_BUCKETS_NS = (1_000_000, 5_000_000, 10_000_000, 20_000_000, 50_000_000,
                   100_000_000, 500_000_000)
SLOW_TURN_NS = 100_000_000      # a turn this long is logged (a warning), at most
SLOW_LOG_EVERY_NS = 10_000_000_000    # once this often per loop


class _Looks:
    """Whether looks of one kind (the spin, or spin_for's) are worth making: SPIN_MISSES
    misses in a row stop them; then one sleep in SPIN_PROBE looks again."""

    __slots__ = ("misses", "sleeps")

    def __init__(self) -> None:
        self.misses = 0           # looks in a row that found nothing
        self.sleeps = 0           # sleeps since they stopped (for the probe)

    def worth(self) -> bool:
        if self.misses < SPIN_MISSES:
            return True
        self.sleeps += 1
        return self.sleeps % SPIN_PROBE == 0

    def found(self, events: object) -> None:
        if events:
            self.misses = self.sleeps = 0
        else:
            self.misses += 1


class TurnTimes:
    """How long a loop's turns took: how many, their total, and how many fell in each
    of TURN_BUCKETS_NS past the first (and past the last), the longest; the loop's
    thread writes it, and /metrics reads it there too. Two clock reads a turn."""

    __slots__ = ("turns", "total_ns", "over", "longest_ns", "_logged_ns")

    def __init__(self) -> None:
        self.turns = 0
        self.total_ns = 0
        # over[i]: turns longer than TURN_BUCKETS_NS[i] and at most the next bound
        # (the last: longer than the last bound)
        self.over = [0] * len(TURN_BUCKETS_NS)
        self.longest_ns = 0
        self._logged_ns = -SLOW_LOG_EVERY_NS

    def copy(self) -> TurnTimes:
        c = TurnTimes()
        c.turns, c.total_ns, c.over = self.turns, self.total_ns, list(self.over)
        c.longest_ns = self.longest_ns
        return c

    def took(self, name: str, start_ns: int, end_ns: int) -> None:
        dt = end_ns - start_ns
        self.turns += 1
        self.total_ns += dt
        if dt <= TURN_BUCKETS_NS[0]:
            return
        if dt > self.longest_ns:
            self.longest_ns = dt
        i = 1
        while i < len(TURN_BUCKETS_NS) and dt > TURN_BUCKETS_NS[i]:
            i += 1
        self.over[i - 1] += 1
        if dt > SLOW_TURN_NS and end_ns - self._logged_ns >= SLOW_LOG_EVERY_NS:
            self._logged_ns = end_ns
            log.warning("%s: a turn took %.0f ms (a turn's budget is 20 ms; turns over "
                        "100 ms are logged at most every 10 s)", name, dt / 1e6)


class SelectorLoop:
    """One thread, one selector; subclasses add their state and the hooks below.

    ``spin_ns``: after a turn that had events, when the next would sleep in the
    selector, look again (without sleeping) for up to this long first. A thread woken
    from epoll costs a wake-up (on this 2-core VM tens of microseconds of scheduler
    work and latency), and a client that answers at once (a producer's next PUB after
    its OK, a consumer's FIN) answers within that: 1.45x the round trips of one
    synchronous producer at the same CPU per message (docs/io.md). 0: sleep at once.
    Between its looks a spin yields the core (``sched_yield``) to any thread waiting
    for one.
    Spins that find nothing SPIN_MISSES times in a row (clients slower than the spin)
    stop it; one in SPIN_PROBE sleeps tries again."""

    # hand the GIL to another loop between turns (several loops in one process)
    yield_gil = False

    def __init__(self, name: str, timers: Timers | None = None, spin_ns: int = 0) -> None:
        self.name = name
        self.spin_ns = spin_ns
        self._active = False      # the last turn had events (a spin may follow it)
        self._spins = _Looks()    # the spin's
        self._idle: dict[object, Call] = {}   # key -> call (when_idle)
        self._idle_since = 0      # when the first of them was deferred
        self._reply_ns = 0        # spin_for: the next sleep looks this long first
        self._reply_looks = _Looks()
        # the longest a turn may sleep in poll now (seconds; None: no cap), for work a
        # subclass must come back to soon though no event or timer may call it
        self.nap_cap: float | None = None
        self.selector: Poller[Pollable | None] = Poller()
        self._calls = CallQueue(self.selector)
        self.timers: Timers = timers if timers is not None else HeapTimers()
        self._again: dict[Pollable, None] = {}  # objects to read next turn (read_again)
        self._running = False
        self.thread: threading.Thread | None = None
        self._ident: int | None = None     # self.thread's, while it runs (in_loop_thread)
        self.stopped = threading.Event()
        self.turn_times = TurnTimes()

    # -- any thread ---------------------------------------------------------------------
    def call_soon_threadsafe(self, fn: Callable[[Unpack[Ts]], object],
                             *args: Unpack[Ts]) -> None:
        """Run fn(*args) on the loop's thread, soon (any thread)."""
        self._calls.call_soon_threadsafe(fn, *args)

    def start(self) -> None:
        self.thread = threading.Thread(target=self.run, name=self.name, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Ask the loop to end after its current turn (any thread)."""
        self.call_soon_threadsafe(self._stop)

    def in_loop_thread(self) -> bool:
        # (the thread's ident while it runs this loop: a C call, not a Python one)
        return get_ident() == self._ident

    # -- owner thread -------------------------------------------------------------------
    def call_later(self, delay_ns: int, fn: Callable[[Unpack[Ts]], object],
                   *args: Unpack[Ts]) -> Any:
        """Run fn(*args) on this loop after delay_ns; returns a handle for cancel()."""
        return self.timers.add(monotonic_ns() + delay_ns, (fn, args))

    def cancel(self, handle: Any) -> None:
        if handle is not None:
            self.timers.remove(handle)

    def run_steps(self, steps: Generator[None, None, R],
                  done: Callable[[R], object] | None = None,
                  failed: Callable[[BaseException], object] | None = None) -> None:
        """Work too long for one turn, as a generator that yields between steps (each
        bounded by its own budget): its first step now, then one a turn (a timer of 0:
        in the next turn, after what is waiting), then ``done(its return value)``. A
        step that raises ends it: ``failed(the error)``, else the error logged. The one
        driver of the loops' step-a-turn work (a checkpoint's snapshots, a /stats job, a
        queue scan's requeues, a replica's channel states and takeover)."""
        try:
            next(steps)
        except StopIteration as end:
            if done is not None:
                done(end.value)
            return
        except Exception as e:    # the loop goes on
            if failed is not None:
                failed(e)
            else:
                log.exception("%s: a step of %r failed", self.name, steps)
            return
        self.timers.add(monotonic_ns(), (self.run_steps, (steps, done, failed)))

    def read_again(self, obj: Pollable) -> None:
        """Call obj.on_readable() next turn even if its socket is not readable."""
        self._again[obj] = None

    def forget_again(self, obj: Pollable) -> None:
        self._again.pop(obj, None)

    def spin_for(self, ns: int) -> None:
        """A reply is expected within about ns (owner thread only): the next time the
        loop would sleep it looks for up to ns first, unless such looks keep finding
        nothing or the loop was made without a spin."""
        if self.spin_ns and ns > self._reply_ns:
            self._reply_ns = ns

    def when_idle(self, key: object, fn: Callable[[Unpack[Ts]], object],
                  *args: Unpack[Ts]) -> None:
        """Run fn(*args) at the loop's next idle moment (owner thread only): once a
        look finds no event, at most IDLE_MAX_NS from the first call deferred. One call
        per key: a later one for the same key replaces it."""
        if not self._idle:
            self._idle_since = monotonic_ns()
        self._idle[key] = (fn, args)

    def _stop(self) -> None:
        self._running = False

    def run(self) -> None:
        self._running = True
        if threading.current_thread() is self.thread:
            self._ident = get_ident()
        try:
            while self._running:
                self.run_once()
                if self.yield_gil:
                    time.sleep(0)
            self._calls.run(self.name)    # what a budget left in the last turn
            self.on_exit()
        except Exception:  # a bug: log it loudly, let the owner shut down cleanly
            log.exception("%s: event loop crashed", self.name)
            self.on_crash()
        finally:
            self._ident = None       # (an ident is reused once its thread ends)
            self.stopped.set()

    def run_once(self) -> None:
        # what asked to be read this turn; what asks from now on (read_again, or past
        # the turn's budget) goes into a new dict, read next turn (an empty one is kept:
        # nothing is read from it this turn)
        again: dict[Pollable, None] | None = self._again
        if again:
            self._again = {}
        else:
            again = None
        if self._calls or again or self.busy():
            timeout: float | None = 0
        else:
            nxt = self.timers.next_deadline()
            timeout = None if nxt is None else max(0.0, (nxt - monotonic_ns()) / 1e9)
            cap = self.nap_cap
            if cap is not None and (timeout is None or timeout > cap):
                timeout = cap
        if timeout != 0 and self._idle:
            events = self._look()
            if not events:
                self._idle_turn()
                return
        elif timeout != 0 and self._reply_ns and self._reply_looks.worth():
            ns, self._reply_ns = self._reply_ns, 0
            events = self._look_then_sleep(timeout, ns, self._reply_looks)
        elif timeout == 0:
            events = self.selector.poll(0)
        else:
            self._reply_ns = 0         # (none, or not worth looking for: forgotten)
            if self._active and self.spin_ns and self._spins.worth():
                events = self._spin_or_sleep(timeout)
            else:
                events = self.selector.poll(timeout)
        start = monotonic_ns()
        self._active = bool(events)
        late = False
        for i, (obj, mask) in enumerate(events):
            if obj is None:
                self._calls.drain_wakeups()
                continue
            if not late and i % EVENTS_LOOK == EVENTS_LOOK - 1:
                late = monotonic_ns() - start > EVENTS_BUDGET_NS
            try:
                if mask & EVENT_READ:
                    if again:
                        again.pop(obj, None)  # one read per turn
                    if late:
                        self._again[obj] = None     # read next turn (it stays readable)
                    else:
                        obj.on_readable()
                if mask & EVENT_WRITE:
                    obj.on_writable()
            except Exception:
                self.on_error(obj)
        for i, obj in enumerate(again or ()):
            if not late and i % EVENTS_LOOK == EVENTS_LOOK - 1:
                late = monotonic_ns() - start > EVENTS_BUDGET_NS
            if late:
                self._again[obj] = None
                continue
            try:
                obj.on_readable()
            except Exception:
                self.on_error(obj)
        due = self.timers.pop_expired(monotonic_ns(), TIMERS_PER_TURN)
        for fn, args in due:
            try:
                fn(*args)
            except Exception:
                log.exception("%s: error in timer %r", self.name, fn)
        self._calls.run(self.name, CALLS_BUDGET_NS)
        self.end_of_turn()
        if self._idle and monotonic_ns() - self._idle_since >= IDLE_MAX_NS:
            self._run_idle()       # a loop that is never idle runs them this often
            self.end_of_turn()
        self.turn_times.took(self.name, start, monotonic_ns())

    def _look(self) -> list[tuple[Pollable | None, int]]:
        """Events, looked for without sleeping for up to IDLE_LOOK_NS (at most the
        spin; once without one), yielding the core between looks."""
        poll = self.selector.poll
        end = monotonic_ns() + min(IDLE_LOOK_NS, self.spin_ns)
        while True:
            events = poll(0)
            if events or monotonic_ns() >= end:
                return events
            sched_yield()

    def _idle_turn(self) -> None:
        """A turn of the calls deferred to an idle moment (and what they leave for the
        end of a turn); a spin may follow it (an answer they sent is answered soon)."""
        start = monotonic_ns()
        self._run_idle()
        self.end_of_turn()
        self._active = True
        self.turn_times.took(self.name, start, monotonic_ns())

    def _run_idle(self) -> None:
        calls, self._idle = self._idle, {}
        for fn, args in calls.values():
            try:
                fn(*args)
            except Exception:
                log.exception("%s: error in an idle call %r", self.name, fn)

    def _spin_or_sleep(self, timeout: float | None) -> list[tuple[Pollable | None, int]]:
        """poll(timeout), but first look without sleeping until something is ready or
        spin_ns (at most the timeout) has passed."""
        return self._look_then_sleep(timeout, self.spin_ns, self._spins)

    def _look_then_sleep(self, timeout: float | None, ns: int,
                         looks: _Looks) -> list[tuple[Pollable | None, int]]:
        events = self._spin(timeout, ns)
        looks.found(events)
        if events:
            return events
        return self.selector.poll(None if timeout is None else max(0.0, timeout - ns / 1e9))

    def _spin(self, timeout: float | None, ns: int) -> list[tuple[Pollable | None, int]]:
        """Events, looked for without sleeping for up to ns (at most the timeout); each
        look releases the GIL."""
        poll = self.selector.poll
        spin = ns if timeout is None else min(ns, int(timeout * 1e9))
        end = monotonic_ns() + spin
        while True:
            events = poll(0)
            if events:
                break
            # a look that found nothing hands the core to a thread waiting for it, if
            # any (the other processes of a machine where they outnumber its cores:
            # a replicated topic's followers, its publishers), and returns at once
            # if none: the spin costs others less and still never sleeps
            sched_yield()
            if monotonic_ns() >= end:
                # (the time is read after the yield: a core given away for longer
                # than the spin is a miss, whatever came meanwhile)
                break
        return events

    def close(self) -> None:
        """Release the selector and the wake-up pair once the thread has exited."""
        self.selector.close()
        self._calls.close()

    # -- hooks ----------------------------------------------------------------------------
    def busy(self) -> bool:
        """Work is waiting for end_of_turn: do not sleep in select()."""
        return False

    def end_of_turn(self) -> None:
        """After the events, timers and calls of a turn."""

    def on_error(self, obj: object) -> None:
        """An object's handler raised (a bug): log it; subclasses close the object."""
        log.exception("%s: unexpected error in %r", self.name, obj)

    def on_exit(self) -> None:
        """On the loop's thread after its last turn."""

    def on_crash(self) -> None:
        """The loop died of an exception (already logged)."""
