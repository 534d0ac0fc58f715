"""ClientConn: one TCP client — socket I/O, output buffering, heartbeats, client state.

Owned by the loop it is registered with (``self.loop``); a consumer moves once, at SUB,
to the loop that owns its channel. This is the only place where socket I/O and the
protocol meet: recv -> CommandDecoder -> handlers -> output buffer -> send.

Output: responses and errors are flushed at the end of the current loop turn; message
frames wait in ``pending`` until the output buffer fills, the client stops being ready,
or its output_buffer_timeout passes (nsqd's bufio.Writer + flush ticker). Frames are
encoded in one C call per flush.
"""
from __future__ import annotations

import itertools
import logging
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from pybroker._native.batchio import EAGAIN
from pybroker.core.channel import Channel
from pybroker.errors import ClientError, SubFailed, TooManyConsumers
from pybroker.protocol.decoder import CommandDecoder
from pybroker.protocol.encoder import HEARTBEAT_FRAME, OK_FRAME, encode_error
from pybroker.protocol.session import INIT, SUBSCRIBED, Session
from pybroker.protocol.wire import MAGIC_V2, ClientState
from pybroker.server import verbs
from pybroker.server.ports import LANE_FIN, LANE_NONE, LANE_PUB
from pybroker.server.iostate import (AWAIT_MAGIC, CLOSED, DRAINING, HELD, MOVING, OPEN, Io,
                                     move)
from pybroker.server.transport import CorruptInput, Transport, TransportError
from pybroker.server.upgrade import handshake_failed, release_slot

if TYPE_CHECKING:
    from pybroker.protocol.decoder import Command
    from pybroker.server.authstate import AuthState
    from pybroker.server.ports import Loop, Timer

log = logging.getLogger("pybroker")
monotonic_ns = time.monotonic_ns
# one connection's reading per loop turn: pieces of input (transport.PIECE) are decoded
# and run until this much time has gone, then the rest waits for the next turn
# (EventLoop.read_again), so one flooding client delays the others by about this much;
# the commands of one piece are run within it too (``Connection._run``: 64 KB of NOPs
# are 16,384 commands, and ran 25-38 ms in one turn)
TURN_BUDGET_NS = 2_000_000
RUN_CHECK = 64           # commands run between two looks at the clock
# TLS handshake steps one loop runs per turn (each server flight costs a signature,
# ~1-2 ms): past this, handshaking clients wait for the next turn, so 64 starting at once
# cannot hold the loop ~100 ms (docs/hostile-peers.md)
HANDSHAKE_TURN_NS = 4_000_000
# a consumer whose socket is this far behind gets no more messages until it catches up
HIGH_WATER = 4 * 1024 * 1024
# a client whose unread replies pass this is not read until they drain below OUT_LOW
# (nsqd stops reading a client whose writes block; redis caps output buffers)
OUT_CAP = 1024 * 1024
OUT_LOW = 256 * 1024
# replies up to this size go out in the loop's batched write (copied once into it);
# larger ones are written on their own (the copy would cost more than the call saves)
BATCH_BYTES = 64 * 1024
LOG_BURST = 20   # non-fatal error lines logged per client per second
_ids = itertools.count(1)   # next() is atomic under the GIL: any loop may take one


class ClientConn:
    def __init__(self, loop: Loop, sock: socket.socket,
                 addr: tuple[str, int] | tuple[str, int, int, int] | str) -> None:
        self.id = next(_ids)
        self.loop = loop
        self.sock = sock
        self.fd = sock.fileno()           # for batched reads and writes (while not CLOSED)
        self.transport = Transport(sock)  # plain until IDENTIFY negotiates TLS/compression
        self.auth_secret = ""
        self.auth_state: AuthState | None = None  # once AUTH succeeded
        # the rest of a body command whose line step ran before its body arrived
        # (verbs.dispatch)
        self.held: Callable[[Command], None] | None = None
        host = str(addr[0]) if isinstance(addr, tuple) else ""
        self.remote_address = f"{host}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
        opts = loop.options
        self.opts = opts
        self.decoder = CommandDecoder(opts.max_msg_size, opts.max_body_size)
        self.magic_buf = b""
        # the I/O life (server.iostate: one state, moved only through its table)
        self.io: Io = AWAIT_MAGIC
        # the protocol state, and which command may run in it (protocol.session)
        self.session = Session(bool(opts.tls_required))
        self.awaiting_commit = 0  # durable publishes not yet answered (see loop.published)
        self.unconfirmed = 0      # OKs in self.out whose topic write has not yet happened
        # identity and negotiated settings (IDENTIFY); matches nsqd: client_id and hostname
        # are the remote host until IDENTIFY sets them
        self.client_id = host
        self.hostname = host
        self.user_agent = ""
        self.heartbeat_interval_ns = 30 * 1_000_000_000
        self.msg_timeout_ns = opts.msg_timeout
        self.output_buffer_size = opts.output_buffer_size
        self.output_buffer_timeout_ns = opts.output_buffer_timeout
        self.sample_rate = 0
        # consumer state
        self.channel: Channel | None = None
        self.rdy = 0
        self.in_flight_count = 0
        self.message_count = 0
        self.finish_count = 0
        self.requeue_count = 0
        self.pub_counts: dict[str, int] = {}
        self.connect_ts = int(time.time())
        # output
        self.out: list[bytes | bytearray] = []
        self.out_bytes = 0
        self.pending: list[bytes | bytearray] = []     # message frames, not yet in out
        self.pending_bytes = 0
        self.writing = False
        self.sending = False      # in the loop's sender job (EventLoop.deliver)
        # back-pressure: False while its unread replies are over OUT_CAP (or while HELD)
        self.reading = True
        # commands parsed and left for the next turn by _run's budget: run before more
        # is read
        self.run_left = False
        self._log_window_ns = 0
        self._log_count = 0
        self._log_dropped = 0
        self.flush_timer: Timer | None = None
        # liveness
        self.last_read_ns = monotonic_ns()
        self.hb_timer: Timer | None = None

    def __repr__(self) -> str:
        return f"{self.remote_address}"

    @property
    def state(self) -> ClientState:
        """The session's state (for /stats)."""
        return self.session.state

    @property
    def closed(self) -> bool:
        return self.io is CLOSED

    def _move(self, dst: Io) -> None:
        self.io = move(self.io, dst)

    # -- start and timers -------------------------------------------------------------
    def start(self) -> None:
        self.sock.setblocking(False)
        try:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        log.info("TCP: new client(%s)", self.remote_address)
        self.schedule_heartbeat()

    def schedule_heartbeat(self) -> None:
        """(Re)arm the heartbeat / read-deadline timer on the current loop."""
        self.loop.cancel(self.hb_timer)
        self.hb_timer = None
        if self.io is CLOSED:
            return
        if self.io is AWAIT_MAGIC:
            # a connection that never sends the magic is closed after client_timeout
            self.hb_timer = self.loop.call_later(self.opts.client_timeout, self._magic_timeout)
            return
        if self.heartbeat_interval_ns > 0:
            self.hb_timer = self.loop.call_later(self.heartbeat_interval_ns, self._on_heartbeat)

    def _magic_timeout(self) -> None:
        self.hb_timer = None
        if self.io is AWAIT_MAGIC:
            self.close("no protocol magic received")

    def _on_heartbeat(self) -> None:
        self.hb_timer = None
        if self.io is CLOSED or self.io is MOVING:
            return
        interval = self.heartbeat_interval_ns
        now = monotonic_ns()
        deadline = self.last_read_ns + 2 * interval
        if now >= deadline and self.reading and self.transport.input_ready():
            # the loop was late (a stall) and the peer's bytes wait unread: read them
            # before judging it silent (nsqd's deadline is on its own read call)
            self.read_now()
            if self.io is CLOSED or self.io is MOVING:
                return
            now = monotonic_ns()
            deadline = max(deadline, self.last_read_ns + 2 * interval)
        if now >= deadline:
            # matches nsqd: the read deadline is two heartbeat intervals
            log.info("[%s] closing: no data for two heartbeat intervals", self)
            self.close("heartbeat timeout")
            return
        self.send_frame(HEARTBEAT_FRAME)
        self.hb_timer = self.loop.call_later(min(interval, deadline - now), self._on_heartbeat)

    # -- reading ------------------------------------------------------------------------
    def on_readable(self) -> None:
        """Read and run pieces of input until none is left in hand or this turn's budget
        (TURN_BUDGET_NS) is spent; then the rest waits for the next turn. A TLS
        handshake step waits for the next turn once the loop's handshakes have used
        HANDSHAKE_TURN_NS in this one."""
        if self.loop.lane_on:
            self.loop.lane.taken.append(self)   # read at the end of the turn (server/lane)
            return
        self.read_now()

    def read_now(self) -> None:
        """on_readable without the publish lane: read and run now."""
        if not self.transport.handshaking:
            self._read_input()
            return
        loop = self.loop
        if loop.handshake_ns >= HANDSHAKE_TURN_NS:
            loop.read_again(self)
            return
        t0 = monotonic_ns()
        try:
            self._read_input()
        finally:
            loop.handshake_ns += monotonic_ns() - t0

    def _read_input(self) -> None:
        if not self.reading or self.io is CLOSED or self.io is MOVING:
            return
        if self.run_left:
            return      # read no more before what is parsed has run (run_leftover)
        t = self.transport
        deadline = monotonic_ns() + TURN_BUDGET_NS
        while True:
            try:
                data = t.recv()
            except (BlockingIOError, InterruptedError):
                return
            except CorruptInput as e:
                self._stream_failed(e)
                return
            except TransportError as e:
                if t.handshaking:
                    handshake_failed(self, e)
                else:
                    self.close(f"read error: {e}")
                return
            except OSError as e:
                self.close(f"read error: {e.strerror}")
                return
            if data is None:  # a partial TLS record or compressed chunk, or the handshake
                self.last_read_ns = monotonic_ns()
                if t.waiting:
                    self.loop.to_flush[self] = None
                return
            if not data:
                self._at_eof()
                return
            now = self.last_read_ns = monotonic_ns()
            if self.io is DRAINING:
                return
            if self.io is AWAIT_MAGIC:
                data = self._read_magic(data)
            if data:
                self.decoder.receive(data)
                self._run()
                if self.run_left:
                    return          # the budget is spent: the rest next turn
            if not t.backlog or not self._may_read():
                return
            if now >= deadline:
                self.loop.read_again(self)
                return

    def lane_kind(self) -> int:
        """Which lane reads this connection this turn (server/lane.py): LANE_PUB (plain,
        not subscribed: its publishes), LANE_FIN (plain, subscribed: its FINs), or
        LANE_NONE (read now, the general way). Plain: nothing held, half-parsed or
        waiting, no TLS or compression."""
        s = self.session
        if not (self.io is OPEN and self.reading and not self.awaiting_commit
                and self.held is None and not s.upgrading
                and (s.tls or not s.tls_required) and self.out_bytes < OUT_CAP
                and self.transport.plain_idle()
                and self.decoder.idle()):
            return LANE_NONE
        state = s.state
        if state is INIT:
            return LANE_PUB
        if state is SUBSCRIBED and self.channel is not None:
            return LANE_FIN
        return LANE_NONE

    def take_input(self, data: bytes) -> None:
        """Bytes the publish lane read for this connection and did not publish itself:
        the general path runs them (b"": the peer closed)."""
        if not data:
            self._at_eof()
            return
        self.last_read_ns = monotonic_ns()
        if self.io is DRAINING:
            return
        self.decoder.receive(data)
        self._run()

    def _may_read(self) -> bool:
        """Commands may run and more input may be decoded now (the decoder is drained)."""
        return (self.reading and (self.io is OPEN or self.io is AWAIT_MAGIC)
                and not self.awaiting_commit and self.out_bytes < OUT_CAP
                and not self.session.upgrading)

    def _stream_failed(self, e: OSError) -> None:
        """A corrupt compressed stream: nsqd closes the connection and logs "failed to
        read command - <Go's error>"; the client also gets that as an E_INVALID frame."""
        payload = f"E_INVALID failed to read command - {e}".encode()
        log.error("[%s] - %s", self, payload.decode("utf-8", "replace"))
        self.send_frame(encode_error(payload))
        self.close_after_flush()

    def on_writable(self) -> None:
        if self.io is not CLOSED:
            self.flush()

    def _at_eof(self) -> None:
        """The client closed its side. A command cut short in its body gets nsqd's
        short-read error first (the client may still be reading)."""
        err = None
        if (self.io is OPEN and not self.session.upgrading
                and not self.awaiting_commit):
            err = self.decoder.at_eof()
        if err is None:
            self.close("peer closed")
            return
        log.error("[%s] - %s", self, err.payload().decode("utf-8", "replace"))
        self.send_frame(encode_error(err.payload()))
        self.close_after_flush()

    def _read_magic(self, data: bytes) -> bytes:
        buf = self.magic_buf + data
        if len(buf) < 4:
            self.magic_buf = buf
            return b""
        magic, rest = buf[:4], buf[4:]
        self.magic_buf = b""
        if magic != MAGIC_V2:
            log.error("client(%s) bad protocol magic '%s'", self, magic.decode("latin-1"))
            # matches nsqd: the frame says only "E_BAD_PROTOCOL", then a close
            self.send_frame(encode_error(b"E_BAD_PROTOCOL"))
            self.close_after_flush()
            return b""
        self._move(OPEN)
        log.info("CLIENT(%s): desired protocol magic '%s'", self, magic.decode("latin-1"))
        self.schedule_heartbeat()
        return rest

    def run_leftover(self) -> None:
        """Last in a turn (EventLoop.run_later): the commands the last turn's budget
        left; once they have all run, read again (input may be waiting)."""
        if not self.run_left or self.io is CLOSED:
            return
        self._run()
        if not self.run_left and self._may_read():
            self.loop.read_again(self)

    def process(self) -> None:
        """Run every parsed command; then, if input is in hand (a backlog the selector
        cannot see), read it next turn."""
        self._run()
        if self.transport.backlog and self._may_read():
            self.loop.read_again(self)

    def _run(self) -> None:
        """Run the parsed commands; stop at a fatal error, when moving loops, or once
        TURN_BUDGET_NS has gone: the rest run next turn, before anything more is read
        (``run_left``)."""
        self.run_left = False
        deadline = monotonic_ns() + TURN_BUDGET_NS
        n = 0
        try:
            while (self.io is OPEN and not self.awaiting_commit
                   and self.out_bytes < OUT_CAP and not self.session.upgrading):
                n += 1
                if n > RUN_CHECK:
                    n = 0
                    if monotonic_ns() >= deadline and self.decoder.ready():
                        self.run_left = True
                        self.loop.run_later(self)
                        break
                cmd = self.decoder.next_command()
                if cmd is None:
                    break
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("PROTOCOL(V2): [%s] %s", self, cmd.describe())
                try:
                    verbs.dispatch(self, cmd)
                except ClientError as err:
                    if err.fatal:
                        raise
                    self.log_nonfatal(err)
                    self.send_frame(encode_error(err.payload()))
        except ClientError as err:
            log.error("[%s] - %s", self, err.payload().decode("utf-8", "replace"))
            self.send_frame(encode_error(err.payload()))
            self.close_after_flush()
        if self.io is CLOSED:
            return
        if self.reading:
            if self.out_bytes >= OUT_CAP or (self.awaiting_commit and self.decoder.ready()):
                self._pause_reading()
        elif (self.out_bytes < OUT_LOW and not self._input_waits()
              and (self.io is OPEN or self.io is AWAIT_MAGIC)):
            self._resume_reading()

    def _input_waits(self) -> bool:
        """Input must wait: its reading is held (a TLS handshake slot), or commands are
        parsed that cannot run until a publish is answered (read no more meanwhile: what
        a connection holds unprocessed stays within one read)."""
        return self.io is HELD or (bool(self.awaiting_commit) and self.decoder.ready() > 0)

    def log_nonfatal(self, err: ClientError) -> None:
        """Log an E_FIN/REQ/TOUCH_FAILED, at most LOG_BURST a second per client (a client
        streaming bad FINs must not make the loop wait on a slow log pipe)."""
        now = monotonic_ns()
        if now - self._log_window_ns >= 1_000_000_000:
            if self._log_dropped:
                log.info("[%s] %d more errors not logged", self, self._log_dropped)
            self._log_window_ns, self._log_count, self._log_dropped = now, 0, 0
        if self._log_count < LOG_BURST:
            self._log_count += 1
            log.info("[%s] %s", self, err.payload().decode("utf-8", "replace"))
        else:
            self._log_dropped += 1

    def fail(self, err: ClientError) -> None:
        """Answer a fatal error outside command processing (a failed group commit)."""
        log.error("[%s] - %s", self, err.payload().decode("utf-8", "replace"))
        self.send_frame(encode_error(err.payload()))
        self.close_after_flush()

    # -- writing ------------------------------------------------------------------------
    def send_frame(self, frame: bytes) -> None:
        """Queue a response or error frame; flushed (with any messages) this turn."""
        if self.io is CLOSED:
            return
        if self.pending:
            self._encode_pending()
        self.out.append(frame)
        self.out_bytes += len(frame)
        self.loop.to_flush[self] = None

    def send_ok(self) -> None:
        self.send_frame(OK_FRAME)

    def ready_room(self) -> int:
        """Consumer protocol: how many more messages this client may take now."""
        if self.session.state is not SUBSCRIBED or self.out_bytes > HIGH_WATER:
            return 0
        return self.rdy - self.in_flight_count

    def send_frames(self, frames: bytes | bytearray, n: int) -> None:
        """Consumer protocol: n message frames for in-flight messages (owner loop)."""
        self.pending.append(frames)
        self.message_count += n
        self.pending_bytes += len(frames)
        if self._flushes_now(self.pending_bytes):
            self.loop.to_flush[self] = None
        elif self.flush_timer is None:
            self.flush_timer = self.loop.call_later(self.output_buffer_timeout_ns,
                                                    self._on_flush_timer)

    def _flushes_now(self, nbytes: int) -> bool:
        """Are ``nbytes`` of message frames waiting to be written this turn? Matches
        nsqd: flush when output buffering is off, the buffer is full, or the client is
        no longer ready; otherwise they wait for output_buffer_timeout."""
        return (self.output_buffer_timeout_ns <= 0 or nbytes >= self.output_buffer_size
                or self.in_flight_count >= self.rdy)

    def takes_frames_now(self, nbytes: int) -> bool:
        """Consumer protocol, the loop's batched delivery (``EventLoop.deliver``): may
        ``nbytes`` of message frames (already counted in flight) be written to the
        socket at once, in a batch with other connections', instead of queued? Yes for
        a plain connection that owes and queues nothing, when ``send_frames`` would
        flush them this turn anyway (nsqd: the buffer full or the client no longer
        ready)."""
        t = self.transport
        return (self.io is OPEN and not (self.out or self.pending or self.writing
                                         or self.unconfirmed or t.waiting or t.layered)
                and nbytes <= BATCH_BYTES and self._flushes_now(nbytes))

    def _on_flush_timer(self) -> None:
        self.flush_timer = None
        if self.io is not CLOSED and self.io is not MOVING:
            self.flush()

    def _encode_pending(self) -> None:
        self.out.extend(self.pending)
        self.out_bytes += self.pending_bytes
        self.pending = []
        self.pending_bytes = 0

    def flush(self) -> None:
        """Encode waiting message frames and write as much as the socket takes."""
        if self.sending:
            self.loop.settle_sends()    # its frames on the sender's thread go first
        if self.io is CLOSED or self.unconfirmed:
            return   # an OK may not go before its topic is written (end of this turn)
        if self.pending:
            self._encode_pending()
        if self.flush_timer is not None:
            self.loop.cancel(self.flush_timer)
            self.flush_timer = None
        if self.out or self.transport.waiting:
            rest = self.transport.send(self.out)
            self.out = []
            self._wrote(rest)
        else:
            self._flushed()

    def take_output(self) -> bytes | bytearray | None:
        """flush's first half for a write batched with other connections' (the loop's
        end of turn, one C call): the bytes to send now, when this is a plain
        connection owing nothing else and with at most BATCH_BYTES to send (``wrote``
        must follow); otherwise it flushes itself here and returns None."""
        if self.sending:
            self.loop.settle_sends()
        if self.io is CLOSED or self.unconfirmed:
            return None
        t = self.transport
        if (t.waiting or t.layered or not (self.out or self.pending)
                or self.out_bytes + self.pending_bytes > BATCH_BYTES):
            self.flush()
            return None
        if self.pending:
            self._encode_pending()
        if self.flush_timer is not None:
            self.loop.cancel(self.flush_timer)
            self.flush_timer = None
        out = self.out
        self.out = []
        return out[0] if len(out) == 1 else b"".join(out)

    def wrote(self, data: memoryview, at: int, n: int, sent: int) -> None:
        """flush's second half: a batched write of ``data[at:at + n]`` took ``sent``
        bytes (-errno: it failed; -EAGAIN: the socket took none now)."""
        if sent == n and self.out_bytes <= HIGH_WATER:
            self.out_bytes = 0      # all taken (the common case): nothing owed
            if self.reading and not self.writing and self.io is not DRAINING:
                return
            self._flushed()
        elif sent < 0 and sent != -EAGAIN:
            self._wrote(None)
        else:
            self._wrote(self.transport.owe(data[at:at + n], max(sent, 0)))

    def _wrote(self, rest: int | None) -> None:
        """After a write: ``rest`` bytes still owed (None: the connection broke)."""
        if rest is None:
            self.close("write error")
            return
        if rest:
            self.out_bytes = rest
            if not self.reading and self.out_bytes < OUT_LOW and not self._input_waits():
                self._resume_reading()
            if not self.writing:
                self.writing = True
                self.loop.want_write(self, True)
            return
        was_full = self.out_bytes > HIGH_WATER
        self.out_bytes = 0
        if was_full and self.channel is not None:
            self.loop.mark_dirty(self.channel)
        self._flushed()

    def _flushed(self) -> None:
        """Nothing owed any more: read again if paused, stop watching for writability."""
        if not self.reading and self.out_bytes < OUT_LOW and not self._input_waits():
            self._resume_reading()
        if self.writing:
            self.writing = False
            self.loop.want_write(self, False)
        if self.io is DRAINING:
            self.close("closed after error")

    def _pause_reading(self) -> None:
        """Unread replies over OUT_CAP: read nothing more until they drain (the client
        waits; others are unaffected, and memory stays bounded)."""
        self.reading = False
        self.loop.set_reading(self, False)
        self.loop.to_flush[self] = None

    def hold_input(self) -> None:
        """Read nothing from the socket until release_input (bytes stay in the kernel)."""
        self._move(HELD)
        self.reading = False
        self.loop.set_reading(self, False)

    def release_input(self) -> None:
        if self.io is HELD:
            self._move(OPEN)
        if self.out_bytes < OUT_CAP:
            self._resume_reading()

    def _resume_reading(self) -> None:
        self.reading = True
        self.loop.set_reading(self, True)
        self.loop.call_soon_threadsafe(self._resume_commands, self.loop)

    def _resume_commands(self, loop: Loop) -> None:
        # queued on the loop that owned the connection then: it may have moved since
        if (loop is self.loop and self.io is not MOVING and self.io is not CLOSED
                and self.reading):
            self.process()

    def close_after_flush(self) -> None:
        """Stop reading; close once queued frames are written (fatal errors). Asked
        again while draining, or once closed, it does nothing."""
        if self.io is DRAINING or self.io is CLOSED:
            return
        self._move(DRAINING)
        self.loop.to_flush[self] = None

    def close(self, reason: str, flush: bool = False) -> None:
        if self.sending:
            self.loop.settle_sends()    # (which may close it: a failed write)
        if self.io is CLOSED:
            return
        if flush and (self.out or self.pending or self.transport.waiting):
            try:
                if self.pending:
                    self._encode_pending()
                self.transport.send_blocking(self.out, 1.0)
            except OSError:
                pass
        self._move(CLOSED)
        log.info("PROTOCOL(V2): [%s] exiting ioloop (%s)", self, reason)
        if self.transport.slot is not None:
            release_slot(self)
        self.loop.cancel(self.hb_timer)
        self.loop.cancel(self.flush_timer)
        self.hb_timer = self.flush_timer = None
        self.loop.release(self)
        self.out = []
        self.pending = []
        ch = self.channel
        if ch is not None:
            self.channel = None
            if ch.detach(self):
                self.loop.consumer_leaving(ch, self)
            self.loop.runtime.consumer_left(ch)
        try:
            self.sock.close()
        except OSError:
            pass

    # -- subscribing ----------------------------------------------------------------------
    def begin_subscribe(self, ch: Channel) -> None:
        """SUB accepted: join ch here, or move to the loop that owns it. No further
        command runs here (``MOVING``); the move itself happens at the end of this loop's
        turn, once this turn's publishes are answered (``EventLoop.hand_over``), and the
        bytes not yet run travel with the connection, in its decoder."""
        if ch.owner is self.loop:
            self.finish_subscribe(ch)
            return
        self._move(MOVING)
        self.loop.forget_again(self)  # input in hand is read by the new owner
        self.loop.hand_over(self, ch)

    def finish_subscribe(self, ch: Channel) -> None:
        """On the channel's owner loop: join the channel, answer OK, resume reading."""
        if self.io is MOVING:
            self._move(OPEN)
        if ch.deleted:
            self.send_frame(encode_error(b"E_SUB_FAILED SUB failed to deleted topic/channel"))
            self.close_after_flush()
            return
        try:
            ch.add_consumer(self, self.opts.max_channel_consumers)
        except TooManyConsumers as e:
            err = SubFailed("SUB failed " + str(e))
            self.send_frame(encode_error(err.payload()))
            self.close_after_flush()
            return
        self.session.move("subscribed")
        self.channel = ch
        self.send_ok()
        self.schedule_heartbeat()
        if self.out:
            self.flush()
        self.process()
