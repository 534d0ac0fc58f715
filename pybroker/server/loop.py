"""EventLoop: one thread, one selector (epoll), its connections, channels and timers.

Theory of operation
-------------------
Each loop thread owns: its selector; the client connections registered with it; the
channels whose names hash to it (``Broker.pick_owner``) and so every consumer of those
channels; and a TimeoutWheel of timers. Nothing else touches them. Other threads reach
a loop only through ``call_soon_threadsafe(fn, *args)``: a deque plus one byte written to
a wake-up socketpair (written only when the loop may be asleep).

Each loop also owns the topics whose names hash to it: its ``publisher``
(pybroker.server.publish) is the only one that appends to and writes them, and holds
the publish policy (write epochs, group commit, hand-offs between loops).

One turn: compute the timeout from the next timer; ``select()``; run readers and
writers; fire due timers; drain cross-thread calls; let the Publisher write every topic
published to this turn (one write each: the publishes of the turn share it), settle
those publishes and hand publishes and answers to other loops (one call per loop);
dispatch every channel marked dirty (read records at its cursor and hand them to ready
consumers); tell other loops, once per turn each, that channels they own have new
records; flush every connection marked for flush. Producers may be on any loop; a
connection that SUBscribes is moved to the loop that owns its channel (``adopt``).
Channels pull records from their topic's log: no message is ever pushed from one loop
to another.
"""
from __future__ import annotations

import logging
import selectors
import socket
import time
from typing import TYPE_CHECKING, Protocol, cast, runtime_checkable

from pybroker._native.batchio import C_FROM, SENDER_SPIN_NS, BatchIO, Sender
from pybroker.core.channel import Channel
from pybroker.core.lifecycle import freeing
from pybroker.core.timeouts import TimeoutWheel
from pybroker.evloop import Call, SelectorLoop
from pybroker.protocol.encoder import ok_frames
from pybroker.server.connection import ClientConn
from pybroker.server.iostate import CLOSED, DRAINING
from pybroker.server.lane import Lane
from pybroker.server.ports import owner_loop
from pybroker.server.publish import Publisher
from pybroker.server.sendchoice import SendChoice

if TYPE_CHECKING:
    from collections.abc import Generator

    from pybroker.core.flight import Consumer, Deferred, Flight
    from pybroker.core.seams import Owner
    from pybroker.server.ports import Conn, Loop, LoopServices

log = logging.getLogger("pybroker")
monotonic_ns = time.monotonic_ns
# bytes joined for one batched write at the end of a turn (EventLoop._write_all): the
# copy made for the C call stays bounded however many connections a turn flushes
WRITE_BATCH = 1024 * 1024
# while a job is posted to the sender the loop sleeps in poll at most this long: the
# first turn after its own that finds it done settles it if no pass has
JOB_NAP_S = 0.001
# the sender takes a pass's writes only when they carry fewer messages than this per
# connection on average (consumers at RDY 1 or 2): a send per message is what it moves
# off the loop; with several messages per send the hand-over and its spin cost more
# than they save (RDY 8: 277-287k msg/s with the sender against 299k and more without)
SENDER_MSGS = 2
# messages a turn requeues from a queue scan's results (timed out, or deferred and
# due): 250,000 timing out at once took the loop 43 ms in one turn; this many about 3
EXPIRE_TURN = 16_384


@runtime_checkable
class _Closable(Protocol):
    def close(self, reason: str) -> None: ...


def _queue_first(conn: Conn, frame: bytes) -> None:
    """Queue frame ahead of what conn has queued (an answer owed from before it)."""
    conn.out.insert(0, frame)
    conn.out_bytes += len(frame)


class EventLoop(SelectorLoop):
    """The SelectorLoop (pybroker.evloop) of a loop thread, with the broker's work at the
    end of each turn; timers in a TimeoutWheel (timers are re-armed at message rates)."""

    def __init__(self, index: int, runtime: LoopServices) -> None:
        super().__init__(f"loop-{index}",
                         TimeoutWheel[Call](), runtime.options.loop_spin)
        self.index = index
        self.runtime = runtime
        self.options = runtime.options
        self.connections: set[Conn] = set()
        self.dirty: dict[Channel, None] = {}
        self.to_flush: dict[Conn, None] = {}
        self.handshake_ns = 0   # TLS handshake work this turn (ClientConn.on_readable)
        self.durable = self.options.durability == "fsync"
        # every publish to the topics this loop owns, and this loop's publishes to others'
        self.publisher = Publisher(self)
        # plain publishers read and published together at the end of the turn
        self.lane = Lane(self)
        self.batch_io = BatchIO()   # the turn's batched writes (_write_all)
        # a dispatch pass's writes on a thread of their own (deliver); the job posted:
        # (its connections, their bytes, their lengths), until settle_sends. It spins
        # between jobs only when the loop does (loop_spin)
        self.sender = Sender(SENDER_SPIN_NS if self.spin_ns else 0)
        # whether the sender or this loop writes such a pass (loop_sender; measured
        # both ways on "auto")
        self.send_choice = SendChoice(runtime.options.loop_sender)
        self._job: tuple[list[Conn], bytes | bytearray, list[int]] | None = None
        self._turn = 0           # _flush_all's count: a job lives into one turn at most
        self._job_turn = 0       # the turn the job was posted in
        self.lane_on = False    # set each turn (Lane.enabled)
        # connections that SUBscribed to another loop's channel: handed over at the end
        # of this turn
        self._handover: list[tuple[Conn, Loop, Channel]] = []
        # OKs of the publish lane's connections whose topic write worked this turn
        # (Publisher._settle): (connection, commands, messages), written with the turn's
        # batched writes, before anything queued for them since
        self.direct: list[tuple[Conn, int, int]] = []
        # channels of other loops with new records: told once per turn
        self._wake_remote: dict[Owner[Channel], dict[Channel, None]] = {}
        # connections whose commands a turn's budget left (Connection._run): run last
        # in the next turn, after every other connection's answers are written
        self._leftover: dict[Conn, None] = {}
        # consumers that left a channel this loop owns, this turn: what they held in
        # flight is requeued at the end of the turn, one pass per channel for all of
        # them (consumer_leaving)
        self._leaving: dict[Channel, list[Consumer]] = {}
        self._requeuing: set[Channel] = set()     # their steps under way (run_steps)

    def __repr__(self) -> str:
        return f"EventLoop({self.name})"

    # -- channels -----------------------------------------------------------------------
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

    def on_expired(self, ch: Channel, timed_out: list[Flight], due: list[Deferred]) -> None:
        """Queue-scanner results for a channel this loop owns: about EXPIRE_TURN
        messages requeued a turn, the rest in the turns after (``run_steps``)."""
        self.run_steps(self._expire_steps(ch, timed_out, due))

    def _expire_steps(self, ch: Channel, timed_out: list[Flight],
                      due: list[Deferred]) -> Generator[None, None, None]:
        i = j = 0
        while True:
            n, start = 0, i
            while i < len(timed_out) and (n < EXPIRE_TURN or i == start):
                n += timed_out[i].n
                i += 1
            k = min(len(due), j + max(0, EXPIRE_TURN - n)) if i == len(timed_out) else j
            ch.requeue_expired(timed_out[start:i], due[j:k])
            j = k
            if not ch.deleted:
                self.dirty[ch] = None
            if i == len(timed_out) and j == len(due):
                return
            yield

    def mark_dirty(self, ch: Channel) -> None:
        self.dirty[ch] = None

    def consumer_leaving(self, ch: Channel, c: Consumer) -> None:
        """c was detached from ch (a channel this loop owns): what it holds in flight is
        requeued from the end of this turn on, with what the others that leave ch in
        this turn hold (``_requeue_leavers``)."""
        if c.in_flight_count > 0:
            self._leaving.setdefault(ch, []).append(c)

    def _requeue_leavers(self) -> None:
        """What the consumers that left hold in flight, requeued: their flights looked
        for in one pass a channel for all that left in a turn, the pass and the
        requeues a step a turn (``Lifecycle.requeue_step``: a few ms at most)."""
        for ch, cs in self._leaving.items():
            # (a channel whose steps run already: they take these too)
            if not ch.deleted and ch.leave(cs) and ch not in self._requeuing:
                self._requeuing.add(ch)
                self.run_steps(self._requeue_steps(ch))
        self._leaving = {}

    def _requeue_steps(self, ch: Channel) -> Generator[None, None, None]:
        try:
            while True:
                requeued, more = ch.requeue_step()
                if requeued and not ch.deleted:
                    self.dirty[ch] = None
                if not more:
                    return
                yield
        finally:
            self._requeuing.discard(ch)

    def deliver(self, sends: list[tuple[Consumer, int, int]], out: bytes | bytearray) -> None:
        """A dispatch pass's message frames (the layout: ``Owner.deliver``). Those of
        connections that may take them now (``takes_frames_now``: plain, nothing queued
        or owed, flushing anyway) are written at once (``_write_batch``), straight from
        ``out`` when they lie back to back in it; the others are queued as
        ``send_frames`` does. From C_FROM connections on, when they take under
        SENDER_MSGS messages each on average, the write runs on the sender's thread
        while this loop goes on (``settle_sends`` takes its result
        before anything else is written to those connections, or they close)."""
        if self._job is not None:
            self.settle_sends()     # one job at a time
        conns: list[Conn] = []
        starts: list[int] = []
        lens: list[int] = []
        joined = 0                 # out[0:joined] is the written ones' frames, in order
        at = 0
        msgs = 0                   # the written ones' messages
        # this loop's consumers are its connections
        for c, n, end in cast("list[tuple[Conn, int, int]]", sends):
            if c.takes_frames_now(end - at):
                c.message_count += n
                msgs += n
                conns.append(c)
                starts.append(at)
                lens.append(end - at)
                if joined == at:
                    joined = end
            else:
                c.send_frames(out if end - at == len(out) else bytes(memoryview(out)[at:end]),
                              n)
            at = end
        if not conns:
            return
        if joined == starts[-1] + lens[-1]:
            data: bytes | bytearray = out
        else:
            view = memoryview(out)
            data = b"".join([view[s:s + ln] for s, ln in zip(starts, lens)])
        if len(conns) >= C_FROM and msgs < SENDER_MSGS * len(conns):
            choice = self.send_choice
            choice.passed(msgs)
            if not (choice.use_sender and self.sender.available()):
                self._write_batch(conns, data, lens)
                return
            for c in conns:
                c.sending = True
            self.sender.post([c.fd for c in conns], data, lens)
            self._job = (conns, data, lens)
            self._job_turn = self._turn
            # the next turn comes soon even with nothing to do, and settles it
            self.nap_cap = JOB_NAP_S
            return
        self._write_batch(conns, data, lens)

    def settle_sends(self) -> None:
        """Wait for the sender's job, if one is posted, and settle its connections as a
        write of their own would have been (what a socket did not take is owed; a failed
        write closes it). Called before anything else is written to one of them, before
        one closes or moves to another loop, and at the loop's exit."""
        job = self._job
        if job is None:
            return
        self._job = None
        self.nap_cap = None
        t0 = monotonic_ns()
        sent = self.sender.wait()
        self.send_choice.waited(monotonic_ns() - t0)
        conns, data, lens = job
        for c in conns:
            c.sending = False
        self._settle(conns, data, lens, sent)

    def dead_letter(self, ch: Channel, target: str, offsets: list[int],
                    bodies: list[bytes]) -> None:
        """Publish a channel's dead letters (server/deadletter.py: the Publisher)."""
        from pybroker.server.deadletter import publish_dead_letters

        publish_dead_letters(self, ch, target, offsets, bodies)

    def close_channel(self, ch: Channel) -> None:
        """A deleted channel: drop its state, then close its consumers (matches nsqd).
        In that order: a consumer closed first has its messages in flight requeued,
        one consumer after another (62 ms for 100 consumers holding 250,000 in flights
        of 2,500, 497 ms as flights of one), only for them to be dropped."""
        self.run_steps(freeing(ch.empty()))    # what it held, freed a step a turn
        for c in list(ch.consumers):
            c.close("channel deleted")  # type: ignore[attr-defined]
        self.dirty.pop(ch, None)

    # -- connections --------------------------------------------------------------------
    def add_connection(self, sock: socket.socket,
                       addr: tuple[str, int] | tuple[str, int, int, int] | str) -> None:
        conn = ClientConn(self, sock, addr)
        self.connections.add(conn)
        self.selector.register(sock, selectors.EVENT_READ, conn)
        conn.start()

    def hand_over(self, conn: Conn, ch: Channel) -> None:
        """conn SUBscribed to a channel another loop owns: give it to that loop at the
        end of this turn (owner thread). It runs no command meanwhile (``conn.io`` is MOVING)."""
        self._handover.append((conn, owner_loop(ch.owner), ch))

    def answer_direct(self, items: list[tuple[Conn, int, int]]) -> None:
        """The publish lane's answers to send at the end of this turn (see direct)."""
        self.direct.extend(items)

    def _direct_to_out(self) -> None:
        """Queue the direct answers as frames (the loop stops before its writes)."""
        direct, self.direct = self.direct, []
        for conn, cmds, _ in direct:
            if conn.io is not CLOSED:
                _queue_first(conn, ok_frames(cmds))

    def _write_all(self, conns: dict[Conn, None],
                   direct: list[tuple[Conn, int, int]] | None = None) -> None:
        """Flush several connections: the plain ones' replies in one C call per
        WRITE_BATCH bytes (``BatchIO.send_many``; each connection brings at most
        BATCH_BYTES), each other one on its own (``Conn.take_output``). ``direct``:
        OKs of the publish lane (``answer_direct``), sent in the same calls, or put
        before what a connection has queued since."""
        out: list[tuple[Conn, bytes | bytearray]] = []
        for conn, cmds, _ in direct or ():
            if conn.sending:
                self.settle_sends()
            if conn.io is CLOSED:
                continue
            if conn.out or conn.pending or conn.writing or conn.transport.waiting \
                    or conn in conns:
                _queue_first(conn, ok_frames(cmds))   # queued after its publish: after its OK
                conns[conn] = None
            else:
                out.append((conn, ok_frames(cmds)))
        for conn in conns:
            if conn.io is not CLOSED:
                data = conn.take_output()
                if data is not None:
                    out.append((conn, data))
        batch: list[Conn] = []
        datas: list[bytes | bytearray] = []
        size = 0
        for conn, data in out:
            batch.append(conn)
            datas.append(data)
            size += len(data)
            if size >= WRITE_BATCH:
                self._send_batch(batch, datas)
                batch, datas, size = [], [], 0
        if batch:
            self._send_batch(batch, datas)

    def _send_batch(self, batch: list[Conn], datas: list[bytes | bytearray]) -> None:
        self._write_batch(batch, b"".join(datas), [len(d) for d in datas])

    def _write_batch(self, conns: list[Conn], data: bytes | bytearray,
                     lens: list[int]) -> None:
        """One send each, one C call for all (``BatchIO.send_many``): connection i its
        ``lens[i]`` bytes of ``data``, back to back; each then settled as its own write
        would be (``Conn.wrote``)."""
        self._settle(conns, data, lens, self.batch_io.send_many(
            [c.sock for c in conns], [c.fd for c in conns], data, lens))

    @staticmethod
    def _settle(conns: list[Conn], data: bytes | bytearray, lens: list[int],
                sent: list[int]) -> None:
        """After a batched write: connection i took ``sent[i]`` of its ``lens[i]``
        bytes of ``data`` (``Conn.wrote``); one closed meanwhile is past settling."""
        view = memoryview(data)
        at = 0
        for c, ln, took in zip(conns, lens, sent):
            if c.io is not CLOSED:
                c.wrote(view, at, ln, took)
            at += ln

    def _hand_over_all(self) -> None:
        """End of turn: this turn's publishes are answered (their OKs are in conn.out,
        confirmed); write what the socket takes, forget the connection, and queue it to
        its new owner. From here until ``adopt`` runs there, no loop touches it; its
        unrun bytes stay in its decoder and its unsent bytes in its output, in order."""
        handover, self._handover = self._handover, []
        for conn, target, ch in handover:
            if conn.io is CLOSED or conn.io is DRAINING:
                continue   # a failed publish before the SUB: it closes here
            if conn.unconfirmed:
                # a replicated topic's publish still waits for its replicas (its OK is
                # in conn.out): the connection moves once it is answered
                self._handover.append((conn, target, ch))
                continue
            self.cancel(conn.hb_timer)
            self.cancel(conn.flush_timer)
            conn.hb_timer = conn.flush_timer = None
            if conn.out or conn.pending:
                conn.flush()
                if conn.io is CLOSED:
                    continue
            self.release(conn)
            conn.loop = target
            target.call_soon_threadsafe(target.adopt, conn, ch)

    def adopt(self, conn: Conn, ch: Channel) -> None:
        """Take over a connection that SUBscribed to a channel this loop owns."""
        conn.loop = self
        self.connections.add(conn)
        self._set_events(conn, conn.reading, conn.writing)
        conn.finish_subscribe(ch)

    def release(self, conn: Conn) -> None:
        """Forget a connection that moves to another loop (owner thread)."""
        if conn.sending:
            self.settle_sends()
        self.connections.discard(conn)
        self.to_flush.pop(conn, None)
        try:
            self.selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass

    def want_write(self, conn: Conn, on: bool) -> None:
        self._set_events(conn, conn.reading, on)

    def set_reading(self, conn: Conn, on: bool) -> None:
        """Stop or resume reading a client (its unread replies are over the cap)."""
        self._set_events(conn, on, conn.writing)

    def _set_events(self, conn: Conn, read: bool, write: bool) -> None:
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
        # this turn's publishes are written first: an OK queued for one is sent only
        # once its write worked (a failed one is sent as its error)
        if self.publisher.busy():
            self.publisher.end_of_turn()
        self._direct_to_out()
        for conn in list(self.connections):
            conn.close("broker exiting", flush=True)
        self._running = False

    def run(self) -> None:
        self.yield_gil = len(self.runtime.loops) > 1
        self.lane_on = self.lane.enabled()
        super().run()

    def busy(self) -> bool:
        return bool(self.dirty or self.to_flush or self.publisher.busy() or self._handover
                    or self.lane.taken or self.direct or self._leftover
                    or self._leaving)

    def run_later(self, conn: Conn) -> None:
        """Run conn's commands left by its budget last in the next turn
        (``Connection.run_leftover``): a client that floods commands is served after
        the others' answers are written, not before them."""
        self._leftover[conn] = None

    def on_error(self, obj: object) -> None:
        log.exception("[%s] unexpected error; closing the connection", obj)
        if isinstance(obj, _Closable):   # a connection, or the listener
            obj.close("internal error")

    def on_exit(self) -> None:
        self._flush_all()
        self.settle_sends()
        self.sender.close()

    def close(self) -> None:
        self.sender.close()     # (after a crash: on_exit did not run)
        super().close()

    def on_crash(self) -> None:
        self.runtime.request_stop()

    def end_of_turn(self) -> None:
        self.handshake_ns = 0
        self._flush_all()

    def _flush_all(self) -> None:
        """Write topics published to (then answer their publishes, hand publishes and
        answers to other loops), dispatch dirty channels, wake other loops' channels,
        flush connections."""
        self._turn += 1
        if self._leaving:
            self._requeue_leavers()
        if self.lane.taken:
            self.lane.run()
        self.lane_on = self.lane.enabled()
        publisher = self.publisher
        if publisher.busy():
            publisher.end_of_turn()
        lane = self.lane
        if self.direct and (self.dirty or lane.fins):
            # the publish lane's OKs (their writes are done) go out before this turn's
            # FINs are read and its deliveries made: a producer waiting for its OK sends
            # its next publish meanwhile (the writer and reader at once flow: +9 %)
            direct, self.direct = self.direct, []
            self._write_all({}, direct)
        if lane.fins:
            lane.run_fins()
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
        if self.to_flush or self.direct:
            conns = self.to_flush
            self.to_flush = {}
            direct = self.direct
            if direct:
                self.direct = []
            if len(conns) == 1 and not direct:
                for conn in conns:
                    if conn.io is not CLOSED:
                        conn.flush()
            else:
                self._write_all(conns, direct)
        if self._handover:
            self._hand_over_all()
        if (self._job is not None and self._job_turn != self._turn
                and not self.sender.busy()):
            # posted turns ago, no pass since, and done: settled now (never waited for
            # here), so that what a socket did not take is owed (and watched for), and
            # a failed write closes its consumer; until then the loop naps at most
            # JOB_NAP_S
            self.settle_sends()
        if self._leftover:
            # last: their answers (if any) go out with the next turn's
            left, self._leftover = self._leftover, {}
            for conn in left:
                try:
                    conn.run_leftover()
                except Exception:    # a bug: never into the rest of the turn
                    log.exception("%s: running %s's commands failed", self.name, conn)
