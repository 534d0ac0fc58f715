"""EventLoop: one thread, one selector (epoll), its connections, channels and timers.

Theory of operation
-------------------
Each loop thread owns: its selector; the client connections registered with it; the
channels whose names hash to it (``Broker.pick_owner``) and so every consumer of those
channels; and a TimeoutWheel of timers. Nothing else touches them. Other threads reach
a loop only through ``call_soon_threadsafe(fn, *args)``: a deque plus one byte written to
a wake-up socketpair (written only when the loop may be asleep).

One turn: compute the timeout from the next timer; ``select()``; run readers and
writers; fire due timers; drain cross-thread calls; write every topic published to
this turn (one write each: the publishes of the turn share it) and settle those
publishes' replies; dispatch every channel marked dirty (read records at its cursor and
hand them to ready consumers); tell other loops, once per turn each, that channels they
own have new records; flush every connection marked for flush. Producers may be on any
loop; a connection that SUBscribes is moved to the loop that owns its channel
(``adopt``). Channels pull records from their topic's log: no message is ever pushed
from one loop to another.
"""
from __future__ import annotations

import logging
import selectors
import socket
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable

from pybroker.core.channel import Channel
from pybroker.core.timeouts import TimeoutWheel
from pybroker.core.topic import Topic
from pybroker.errors import ClientError, Exiting
from pybroker.evloop import SelectorLoop
from pybroker.protocol.encoder import encode_error
from pybroker.storage import StorageError

if TYPE_CHECKING:
    from pybroker.server.services import LoopServices
    from pybroker.server.connection import ClientConn

log = logging.getLogger("pybroker")
monotonic_ns = time.monotonic_ns
# messages of a big MPUB appended per loop turn (a few milliseconds of work)
SLICE = 20_000


class _SliceJob:
    """A big MPUB being appended slice by slice."""

    __slots__ = ("conn", "name", "parts", "ts_ns", "failed", "verb", "done", "topic")

    def __init__(self, conn: "ClientConn", name: str, parts: tuple[bytes, Any, Any],
                 ts_ns: int, failed: type[ClientError], verb: str) -> None:
        self.conn = conn
        self.name = name
        self.parts = parts
        self.ts_ns = ts_ns
        self.failed = failed
        self.verb = verb
        self.done = 0
        self.topic: Topic | None = None


class EventLoop(SelectorLoop):
    """The SelectorLoop (pybroker.evloop) of a loop thread, with the broker's work at the
    end of each turn; timers in a TimeoutWheel (timers are re-armed at message rates)."""

    def __init__(self, index: int, runtime: LoopServices) -> None:
        super().__init__(f"loop-{index}",
                         TimeoutWheel[tuple[Callable[..., Any], tuple[Any, ...]]]())
        self.index = index
        self.runtime = runtime
        self.options = runtime.options
        self.connections: set[ClientConn] = set()
        self.dirty: dict[Channel, None] = {}
        self.to_flush: dict[ClientConn, None] = {}
        self.durable = self.options.durability == "fsync"
        # topics published to this turn, written at its end (one write each)
        self.to_write: dict[Topic, None] = {}
        # memory mode: OKs queued, not yet flushable: (conn, index in conn.out, topic,
        # the error class and verb for the answer should the write fail)
        self._unconfirmed: list[tuple[ClientConn, int, Topic, type[ClientError], str]] = []
        # fsync mode: publishes waiting for this turn's write and the storage thread's sync
        self._durable: list[tuple[ClientConn, Topic, type[ClientError], str]] = []
        # MPUBs appended in slices (publish_slices), and connections to resume after
        self._slices: deque[_SliceJob] = deque()
        self._resume: list[ClientConn] = []
        # connections that SUBscribed to another loop's channel: handed over at the end
        # of this turn
        self._handover: list[tuple[ClientConn, EventLoop, Channel]] = []
        # channels of other loops with new records: told once per turn
        self._wake_remote: dict[EventLoop, dict[Channel, None]] = {}

    def __repr__(self) -> str:
        return f"EventLoop({self.name})"

    # -- publishing ---------------------------------------------------------------
    def published(self, conn: "ClientConn", topic: Topic, failed: type[ClientError],
                  verb: str) -> None:
        """A publish of conn's appended records to topic: write the topic at the end of
        this turn (one write per topic however many publishes), then answer. In memory
        mode the OK is queued now and flushed only after the write (a failed write turns
        it into err); in fsync mode conn reads no further commands until the storage
        thread has synced the topic (group commit), so replies stay in order."""
        self.to_write[topic] = None
        if self.durable:
            self._durable.append((conn, topic, failed, verb))
            conn.awaiting_commit += 1
        else:
            conn.send_ok()
            self._unconfirmed.append((conn, len(conn.out) - 1, topic, failed, verb))
            conn.unconfirmed += 1

    def publish_slices(self, conn: "ClientConn", name: str, parts: tuple[bytes, Any, Any],
                       failed: type[ClientError], verb: str) -> None:
        """An MPUB of more than SLICE messages: appended SLICE messages per loop turn
        (so no turn holds the loop for long), answered after the last slice's write.
        The connection reads no further commands meanwhile."""
        conn.awaiting_commit += 1
        self._slices.append(_SliceJob(conn, name, parts, time.time_ns(), failed, verb))

    def _run_slice(self) -> None:
        job = self._slices[0]
        body, offs, lens = job.parts
        i = job.done
        j = min(i + SLICE, len(lens))
        conn = job.conn
        try:
            topic = self.runtime.broker.get_topic(job.name)
            topic.publish_parts(body, offs[i:j], lens[i:j], job.ts_ns)
        except Exiting as e:
            self._slices.popleft()
            self._settle(conn, job.failed(f"{job.verb} failed {e}"))
            return
        job.topic = topic
        job.done = j
        self.to_write[topic] = None
        if j == len(lens):
            self._slices.popleft()
            conn.awaiting_commit -= 1
            self.published(conn, topic, job.failed, job.verb)
            self._resume.append(conn)

    def _write_topics(self) -> None:
        """End of turn: one write per topic published to, then wake its channels and
        settle the publishes' replies."""
        to_write, self.to_write = self.to_write, {}
        failed: dict[Topic, Exception] = {}
        for t in to_write:
            try:
                chans = t.write()
            except StorageError as e:
                failed[t] = e
                self.runtime.storage_failed(e, t)
                continue
            except Exception as e:   # a bug: fail these publishes, keep the loop alive
                log.exception("%s: writing %r failed", self.name, t)
                failed[t] = e
                continue
            if self.runtime.health is not None:
                self.runtime.storage.write_ok(t)
            if chans:
                self.wake(chans)
        if self._unconfirmed:
            unconfirmed, self._unconfirmed = self._unconfirmed, []
            for conn, idx, t, cls, verb in unconfirmed:
                conn.unconfirmed -= 1
                if t in failed and not conn.closed:
                    err = cls(f"{verb} failed {failed[t]}")
                    conn.out[idx] = encode_error(err.payload())
                    log.error("[%s] - %s", conn, err.payload().decode("utf-8", "replace"))
                    conn.close_after_flush()
        if failed and self._slices:
            for job in list(self._slices):
                why = failed.get(job.topic) if job.topic is not None else None
                if why is not None:
                    self._slices.remove(job)
                    self._settle(job.conn, job.failed(f"{job.verb} failed {why}"))
        if self._durable:
            durable, self._durable = self._durable, []
            ok = [entry for entry in durable if entry[1] not in failed]
            for conn, t, cls, verb in durable:
                if t in failed:
                    self._settle(conn, cls(f"{verb} failed {failed[t]}"))
            if ok:
                topics = list({entry[1]: None for entry in ok})
                self.runtime.storage.sync_topics(
                    topics, lambda error: self.call_soon_threadsafe(self._synced, ok, error))

    def _synced(self, commits: list[tuple["ClientConn", Topic, type[ClientError], str]],
                error: Exception | None) -> None:
        """The storage thread synced the topics of these durable publishes."""
        for conn, _, cls, verb in commits:
            self._settle(conn, None if error is None else cls(f"{verb} failed {error}"))

    def _settle(self, conn: "ClientConn", err: ClientError | None) -> None:
        conn.awaiting_commit -= 1
        if conn.closed:
            return
        if err is None:
            conn.send_ok()
        else:
            conn.fail(err)
        if not conn.awaiting_commit:
            conn.process()

    def wake(self, chans: list[Channel]) -> None:
        """New records for these channels: dispatch ours this turn, tell other owners
        once per turn."""
        for ch in chans:
            owner = ch.owner
            if owner is self:
                self.dirty[ch] = None
            else:
                box = self._wake_remote.get(owner)
                if box is None:
                    self._wake_remote[owner] = {ch: None}
                else:
                    box[ch] = None

    def mark_dirty_many(self, chans: list[Channel]) -> None:
        for ch in chans:
            self.dirty[ch] = None

    def on_expired(self, ch: Channel, timed_out: list[Any], due: list[Any]) -> None:
        """Queue-scanner results for a channel this loop owns."""
        ch.requeue_expired(timed_out, due)
        if not ch.deleted:
            self.dirty[ch] = None

    def mark_dirty(self, ch: Channel) -> None:
        self.dirty[ch] = None

    def dead_letter(self, ch: Channel, target: str, offsets: list[int],
                    bodies: list[bytes]) -> None:
        """Publish a channel's dead letters (server/deadletter.py)."""
        from pybroker.server.deadletter import publish_dead_letters

        publish_dead_letters(self, ch, target, offsets, bodies)

    def close_channel(self, ch: Channel) -> None:
        """A deleted channel: close its consumers (matches nsqd) and drop its state."""
        for c in list(ch.consumers):
            c.close("channel deleted")  # type: ignore[attr-defined]
        ch.empty()
        self.dirty.pop(ch, None)

    # -- connections --------------------------------------------------------------------
    def add_connection(self, sock: socket.socket,
                       addr: tuple[str, int] | tuple[str, int, int, int] | str) -> None:
        from pybroker.server.connection import ClientConn

        conn = ClientConn(self, sock, addr)
        self.connections.add(conn)
        self.selector.register(sock, selectors.EVENT_READ, conn)
        conn.start()

    def hand_over(self, conn: "ClientConn", target: "EventLoop", ch: Channel) -> None:
        """conn SUBscribed to a channel ``target`` owns: give it away at the end of this
        turn (owner thread). It runs no command meanwhile (``conn.moving``)."""
        self._handover.append((conn, target, ch))

    def _hand_over_all(self) -> None:
        """End of turn: this turn's publishes are answered (their OKs are in conn.out,
        confirmed); write what the socket takes, forget the connection, and queue it to
        its new owner. From here until ``adopt`` runs there, no loop touches it; its
        unrun bytes stay in its decoder and its unsent bytes in its output, in order."""
        handover, self._handover = self._handover, []
        for conn, target, ch in handover:
            if conn.closed or conn.closing_after_flush:
                continue   # a failed publish before the SUB: it closes here
            self.cancel(conn.hb_timer)
            self.cancel(conn.flush_timer)
            conn.hb_timer = conn.flush_timer = None
            if conn.out or conn.pending:
                conn.flush()
                if conn.closed:
                    continue
            self.release(conn)
            conn.loop = target
            target.call_soon_threadsafe(target.adopt, conn, ch)

    def adopt(self, conn: "ClientConn", ch: Channel) -> None:
        """Take over a connection that SUBscribed to a channel this loop owns."""
        conn.loop = self
        self.connections.add(conn)
        self._set_events(conn, conn.reading, conn.writing)
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
        self._set_events(conn, conn.reading, on)

    def set_reading(self, conn: "ClientConn", on: bool) -> None:
        """Stop or resume reading a client (its unread replies are over the cap)."""
        self._set_events(conn, on, conn.writing)

    def _set_events(self, conn: "ClientConn", read: bool, write: bool) -> None:
        events = (selectors.EVENT_READ if read else 0) | (selectors.EVENT_WRITE if write else 0)
        try:
            if events:
                self.selector.modify(conn.sock, events, conn)
            else:
                self.selector.unregister(conn.sock)
        except (KeyError, ValueError):
            if events:
                try:
                    self.selector.register(conn.sock, events, conn)
                except (KeyError, ValueError):
                    pass

    # -- the loop (SelectorLoop hooks) ---------------------------------------------------
    def _stop(self) -> None:
        for conn in list(self.connections):
            conn.close("broker exiting", flush=True)
        self._running = False

    def run(self) -> None:
        self.yield_gil = len(self.runtime.loops) > 1
        super().run()

    def busy(self) -> bool:
        return bool(self.dirty or self.to_flush or self.to_write or self._slices
                    or self._handover)

    def on_error(self, obj: Any) -> None:
        log.exception("[%s] unexpected error; closing the connection", obj)
        obj.close("internal error")

    def on_exit(self) -> None:
        self._flush_all()

    def on_crash(self) -> None:
        self.runtime.request_stop()

    def end_of_turn(self) -> None:
        self._flush_all()

    def _flush_all(self) -> None:
        """Write topics published to (then answer their publishes), dispatch dirty
        channels, wake other loops' channels, flush connections."""
        if self._slices:
            self._run_slice()
        if self.to_write:
            self._write_topics()
        if self._resume:
            resume, self._resume = self._resume, []
            for conn in resume:
                if not conn.closed and not conn.awaiting_commit:
                    conn.process()
        if self.dirty:
            now = monotonic_ns()
            wall = time.time_ns()
            dirty = self.dirty
            self.dirty = {}
            for ch in dirty:
                if not ch.deleted:
                    ch.dispatch(now, wall)
        if self._wake_remote:
            remote, self._wake_remote = self._wake_remote, {}
            for owner, chans in remote.items():
                owner.call_soon_threadsafe(owner.mark_dirty_many, list(chans))
        if self.to_flush:
            conns = self.to_flush
            self.to_flush = {}
            for conn in conns:
                if not conn.closed:
                    conn.flush()
        if self._handover:
            self._hand_over_all()
