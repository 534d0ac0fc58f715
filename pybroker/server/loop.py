"""EventLoop: one thread, one selector (epoll), its connections, channels and timers.

Theory of operation
-------------------
Each loop thread owns: its selector; the client connections registered with it; the
channels whose names hash to it (``Broker.pick_owner``) and so every consumer of those
channels; and a TimeoutWheel of timers. Nothing else touches them. Other threads reach
a loop only through ``call_soon_threadsafe(fn, *args)``: a deque plus one byte written to
a wake-up socketpair (written only when the loop may be asleep).

One turn: compute the timeout from the next timer; ``select()``; run readers and
writers; fire due timers; drain cross-thread calls; dispatch every channel marked dirty
(hand queued messages to ready consumers); flush every connection marked for flush;
post messages published here for channels owned by other loops, one call per target
loop per turn. Producers may be on any loop; a connection that SUBscribes is moved to
the loop that owns its channel (``adopt``).
"""
from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from pybroker.core.channel import Channel
from pybroker.core.message import Message
from pybroker.core.timeouts import TimeoutWheel
from pybroker.core.topic import Deliveries
from pybroker.errors import ClientError
from pybroker.server.waker import CallQueue
from pybroker.storage import StorageError

if TYPE_CHECKING:
    from pybroker.server.connection import ClientConn

log = logging.getLogger("pybroker")
monotonic_ns = time.monotonic_ns
INBOX_HIGH = 20_000  # messages posted to a loop before its publishers wait
INBOX_LOW = 5_000
INBOX_WAIT_S = 0.02


class EventLoop:
    def __init__(self, index: int, runtime: Any) -> None:
        self.index = index
        self.name = f"loop-{index}"
        self.runtime = runtime
        self.options = runtime.options
        self.selector = selectors.DefaultSelector()
        self._calls = CallQueue(self.selector)
        self.timers: TimeoutWheel[tuple[Callable[..., Any], tuple[Any, ...]]] = TimeoutWheel()
        self.connections: set[ClientConn] = set()
        self.dirty: dict[Channel, None] = {}
        self.to_flush: dict[ClientConn, None] = {}
        self._outbox: dict[EventLoop, list[tuple[Channel, list[Message]]]] = {}
        # durable publishes waiting for this turn's fsyncs: (connection, error if it fails)
        self._commits: list[tuple[ClientConn, ClientError]] = []
        self._to_sync: dict[Any, None] = {}
        # messages other loops posted here and this loop has not queued yet (approximate)
        self.inbox = 0
        self.inbox_room = threading.Event()
        self.inbox_room.set()
        self._running = False
        self.thread: threading.Thread | None = None
        self.stopped = threading.Event()

    def __repr__(self) -> str:
        return f"EventLoop({self.name})"

    # -- cross-thread entry points ----------------------------------------------------
    def call_soon_threadsafe(self, fn: Callable[..., Any], *args: Any) -> None:
        self._calls.call_soon_threadsafe(fn, *args)

    def call_later(self, delay_ns: int, fn: Callable[..., Any], *args: Any) -> tuple[int, int]:
        """Run fn(*args) on this loop after delay_ns (owner thread only)."""
        return self.timers.add(monotonic_ns() + delay_ns, (fn, args))

    def cancel(self, handle: tuple[int, int] | None) -> None:
        if handle is not None:
            self.timers.remove(handle)

    # -- message routing ------------------------------------------------------------
    def route(self, deliveries: Deliveries) -> None:
        """Send published messages to their channels (owner thread of this loop)."""
        for ch, msgs in deliveries:
            owner = ch.owner
            if owner is self:
                if not ch.deleted:
                    self._put(ch, msgs, monotonic_ns())
            else:
                box = self._outbox.get(owner)
                if box is None:
                    self._outbox[owner] = [(ch, msgs)]
                else:
                    box.append((ch, msgs))

    def receive_remote(self, batch: list[tuple[Channel, list[Message]]], n: int = 0) -> None:
        now = monotonic_ns()
        for ch, msgs in batch:
            if not ch.deleted:
                self._put(ch, msgs, now)
        self.inbox -= n
        if self.inbox <= INBOX_LOW:
            self.inbox_room.set()

    def _post(self, owner: "EventLoop", batch: list[tuple[Channel, list[Message]]]) -> None:
        """Hand messages to another loop, counting them against its inbox."""
        n = sum(len(msgs) for _, msgs in batch)
        owner.inbox += n
        if owner.inbox > INBOX_HIGH:
            owner.inbox_room.clear()
        owner.call_soon_threadsafe(owner.receive_remote, batch, n)

    def _put(self, ch: Channel, msgs: list[Message], now_ns: int) -> None:
        try:
            ch.put(msgs, now_ns)
        except StorageError as e:  # the messages stay in memory; /ping says why
            self.runtime.storage_failed(e)
        self.dirty[ch] = None

    def on_expired(self, ch: Channel, timed_out: list[Message], due: list[Message]) -> None:
        """Queue-scanner results for a channel this loop owns."""
        ch.requeue_expired(timed_out, due)
        if not ch.deleted:
            self.dirty[ch] = None

    def commit_later(self, conn: "ClientConn", backends: list[Any], err: ClientError) -> None:
        """Answer a durable publish once its backends are synced, at the end of this
        turn: every publish of the turn shares one fsync per queue (group commit). The
        connection reads no further commands until then, so replies stay in order."""
        for b in backends:
            self._to_sync[b] = None
        self._commits.append((conn, err))
        conn.awaiting_commit += 1

    def _group_commit(self) -> None:
        to_sync, commits = self._to_sync, self._commits
        self._to_sync, self._commits = {}, []
        failure: Exception | None = None
        for b in to_sync:
            try:
                b.sync()
            except Exception as e:  # StorageError: answer E_PUB_FAILED, keep serving
                failure = e
        if failure is not None:
            self.runtime.storage_failed(failure)
        for conn, err in commits:
            conn.awaiting_commit -= 1
            if conn.closed:
                continue
            if failure is None:
                conn.send_ok()
            else:
                conn.fail(err)
            if not conn.awaiting_commit:
                conn.process()

    def mark_dirty(self, ch: Channel) -> None:
        self.dirty[ch] = None

    def close_channel(self, ch: Channel) -> None:
        """A deleted channel: close its consumers (matches nsqd) and drop its messages."""
        for c in list(ch.consumers):
            c.close("channel deleted")  # type: ignore[attr-defined]
        ch.empty()
        self.dirty.pop(ch, None)
        if ch.backend is not None:
            self.runtime.storage.forget(f"{ch.topic_name}:{ch.name}")
            ch.backend.delete()

    # -- connections --------------------------------------------------------------------
    def add_connection(self, sock: socket.socket, addr: Any) -> None:
        from pybroker.server.connection import ClientConn

        conn = ClientConn(self, sock, addr)
        self.connections.add(conn)
        self.selector.register(sock, selectors.EVENT_READ, conn)
        conn.start()

    def adopt(self, conn: "ClientConn", ch: Channel) -> None:
        """Take over a connection that SUBscribed to a channel this loop owns."""
        conn.loop = self
        self.connections.add(conn)
        self.selector.register(conn.sock, selectors.EVENT_READ, conn)
        conn.finish_subscribe(ch)

    def release(self, conn: "ClientConn") -> None:
        """Forget a connection that moves to another loop (owner thread)."""
        self.connections.discard(conn)
        self.to_flush.pop(conn, None)
        try:
            self.selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass

    def want_write(self, conn: "ClientConn", on: bool) -> None:
        events = selectors.EVENT_READ | selectors.EVENT_WRITE if on else selectors.EVENT_READ
        try:
            self.selector.modify(conn.sock, events, conn)
        except (KeyError, ValueError):
            pass

    # -- the loop -----------------------------------------------------------------------
    def start(self) -> None:
        self.thread = threading.Thread(target=self.run, name=self.name, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Ask the loop to close its connections and exit (any thread)."""
        self.call_soon_threadsafe(self._stop)

    def _stop(self) -> None:
        for conn in list(self.connections):
            conn.close("broker exiting", flush=True)
        self._running = False

    def run(self) -> None:
        self._running = True
        share_gil = len(self.runtime.loops) > 1
        try:
            while self._running:
                self._turn()
                if share_gil:
                    time.sleep(0)  # hand the GIL to a waiting loop between turns
            self._flush_all()
        except Exception:  # a bug: log it loudly, but let the runtime shut down cleanly
            log.exception("%s: event loop crashed", self.name)
            self.runtime.request_stop()
        finally:
            self.stopped.set()

    def _turn(self) -> None:
        if self._calls or self.dirty or self.to_flush or self._commits:
            timeout: float | None = 0
        else:
            nxt = self.timers.next_deadline()
            timeout = None if nxt is None else max(0.0, (nxt - monotonic_ns()) / 1e9)
        for key, mask in self.selector.select(timeout):
            conn = key.data
            if conn is None:
                self._calls.drain_wakeups()
                continue
            try:
                if mask & selectors.EVENT_READ:
                    conn.on_readable()
                if mask & selectors.EVENT_WRITE and not conn.closed:
                    conn.flush()
            except Exception:
                log.exception("[%s] unexpected error; closing the connection", conn)
                conn.close("internal error")
        self._fire_timers()
        self._calls.run(self.name)
        self._flush_all()

    def _fire_timers(self) -> None:
        due = self.timers.pop_expired(monotonic_ns())
        for fn, args in due:
            try:
                fn(*args)
            except Exception:
                log.exception("%s: error in timer %r", self.name, fn)

    def _flush_all(self) -> None:
        """Group-commit durable publishes, dispatch dirty channels, post remote
        deliveries, flush connections."""
        if self._commits:
            self._group_commit()
        if self.dirty:
            now = monotonic_ns()
            wall = time.time_ns()
            dirty = self.dirty
            self.dirty = {}
            for ch in dirty:
                if not ch.deleted:
                    ch.dispatch(now, wall)
        if self._outbox:
            outbox = self._outbox
            self._outbox = {}
            for owner, batch in outbox.items():
                self._post(owner, batch)
            for owner in outbox:
                if owner.inbox > INBOX_HIGH:
                    # Backpressure: publishers here must not outrun the loop that owns
                    # the channels (with the GIL, a busy publishing thread would
                    # otherwise starve that loop's consumers). Pausing this loop briefly
                    # lets the owner catch up; a timeout keeps two loops that publish
                    # to each other from waiting on each other for long.
                    owner.inbox_room.wait(INBOX_WAIT_S)
        if self.to_flush:
            conns = self.to_flush
            self.to_flush = {}
            for conn in conns:
                if not conn.closed:
                    conn.flush()

    def close(self) -> None:
        """Release the selector and wake-up pair once the thread has exited."""
        self.selector.close()
        self._calls.close()
