"""Conn: one TCP connection to an nsqd, shared by a Consumer or Producer and its IOLoop.

The handshake (magic, IDENTIFY, AUTH, SUB) runs blocking in the caller's thread so
errors surface there; ``start()`` then hands the socket to the IOLoop, which alone reads
it. ``send()`` may be called from any thread: it writes directly while the socket drains
and otherwise leaves the rest in a buffer that the loop flushes.
Flow-control numbers (``rdy_count``, ``in_flight``...) live here for introspection but
belong to the Consumer, which changes them under its own lock.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Protocol

from pybroker.client import protocol as P
from pybroker.client.config import Config
from pybroker.client.errors import AuthError, IdentifyError, NotConnectedError, ProtocolError
from pybroker.client.loop import IOLoop
from pybroker.client.message import Message
from pybroker.client.protocol import IdentifyResponse
from pybroker.client.transport import TlsSocket, tls_context
from pybroker.protocol.compression import CorruptStream, Deflate, Snappy

log = logging.getLogger("pybroker.client")

# one read, into a buffer the connection keeps (docs/io.md): no object of this size
# is allocated per read (a fresh 256 KiB one is an mmap and a munmap each time)
_RECV_SIZE = 256 * 1024
_WRITE_CHUNK = 256 * 1024
_MAX_PENDING_WRITE = 16 << 20


class ConnDelegate(Protocol):
    """Receives a connection's events, on the IOLoop thread (go-nsq's ConnDelegate)."""

    def on_response(self, conn: "Conn", data: bytes) -> None: ...
    def on_error(self, conn: "Conn", data: bytes) -> None: ...
    def on_message(self, conn: "Conn", message: Message) -> None: ...
    def on_heartbeat(self, conn: "Conn") -> None: ...
    def on_close(self, conn: "Conn") -> None: ...
    def on_message_finished(self, conn: "Conn", message: Message) -> None: ...
    def on_message_requeued(self, conn: "Conn", message: Message, backoff: bool) -> None: ...


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"invalid address {address!r} (want host:port)")
    return host.strip("[]") or "127.0.0.1", int(port)


class Conn:
    """A connection to one nsqd. Its socket is read only by its IOLoop once started."""

    def __init__(self, address: str, config: Config, delegate: ConnDelegate,
                 loop: IOLoop) -> None:
        self.address = address
        self.config = config
        self.delegate = delegate
        self.loop = loop
        self.identify_response = IdentifyResponse()
        # flow control (owned by the Consumer)
        self.max_rdy_count = 2500
        self.rdy_count = 0          # the RDY the server was last told (a cap on in-flight)
        self.rdy_remaining = 0      # rdy_count minus messages received since it was sent
        self.in_flight = 0          # received, not yet FIN'd or REQ'd
        self.queued = 0             # of those, still waiting for a handler thread
        self.last_rdy_ts = 0.0
        self.last_message_ts = time.monotonic()
        self.closing = False        # CLS sent: drain, then close
        self.close_wait = False     # the server answered CLS with CLOSE_WAIT
        self._responding = 0        # FIN/REQ being sent right now
        self.messages_received = 0
        self.heartbeats = 0
        # writers wait while this much output is pending (producers); 0: never wait
        # (consumers, which write RDY/FIN with their flow-control lock held)
        self.max_pending_write = _MAX_PENDING_WRITE
        self._sock: socket.socket | TlsSocket | None = None  # TlsSocket once TLS is on
        self._codec: Snappy | Deflate | None = None  # snappy or deflate, once negotiated
        self._reader = P.FrameReader()
        self._rbuf: memoryview | None = None   # the kept receive buffer (first read)
        self._wlock = threading.Condition(threading.Lock())
        self._wbuf = bytearray()
        self._started = False
        self._closed = False
        self._close_lock = threading.Lock()
        self._last_read = time.monotonic()

    def __repr__(self) -> str:
        return f"Conn({self.address})"

    def __str__(self) -> str:
        return self.address

    # -- handshake (caller's thread) --------------------------------------------------
    def connect(self) -> IdentifyResponse:
        """Dial, send the magic and IDENTIFY (and AUTH when required); blocking.

        Raises:
            OSError: dial failure. IdentifyError, AuthError: refused handshake.
        """
        host, port = split_address(self.address)
        try:
            sock = socket.create_connection((host, port), timeout=self.config.dial_timeout)
        except OSError as e:     # the same error, saying which address failed
            why = f"cannot connect to {self.address}: {e.strerror or e}"
            raise (type(e)(e.errno, why) if e.errno is not None else type(e)(why)) from e
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(self.config.read_timeout)
        self._sock = sock
        try:
            sock.sendall(P.MAGIC_V2)
            resp = self._identify()
            self._upgrade(resp, host)
            if resp.auth_required:
                self._auth()
        except BaseException:
            self._close_socket()
            raise
        self.identify_response = resp
        self.max_rdy_count = resp.max_rdy_count
        return resp

    def _identify(self) -> IdentifyResponse:
        try:
            self._sock_send(P.identify(self.config.identify_fields()))
            ftype, payload = self._read_frame_blocking()
        except OSError as e:
            raise IdentifyError(f"IDENTIFY failed: {e}") from e
        if ftype == P.FrameType.ERROR:
            raise IdentifyError(payload.decode("utf-8", "replace"))
        try:
            return P.parse_identify_response(payload)
        except ValueError as e:
            raise IdentifyError(f"bad IDENTIFY response: {payload[:64]!r}") from e

    def _upgrade(self, resp: IdentifyResponse, host: str) -> None:
        """What the server granted, in nsqd's order: TLS, then snappy or deflate, each
        confirmed by an OK read through the new layer (go-nsq's upgrade sequence)."""
        if resp.tls_v1:
            assert isinstance(self._sock, socket.socket)   # TLS comes first, once
            try:
                ssl_sock = tls_context(self.config).wrap_socket(self._sock,
                                                                server_hostname=host)
            except OSError as e:
                raise IdentifyError(f"TLS handshake failed: {e}") from e
            self._sock = TlsSocket(ssl_sock)
            self._expect_ok("TLS")
        if resp.snappy or resp.deflate:
            codec = Snappy() if resp.snappy else Deflate(resp.deflate_level)
            early = self._reader.take_buffered()  # already compressed (the OK)
            self._codec = codec
            if early:
                self._reader.feed(codec.decompress(early))
            self._expect_ok(codec.name)

    def _expect_ok(self, what: str) -> None:
        try:
            ftype, payload = self._read_frame_blocking()
        except (OSError, CorruptStream) as e:
            raise IdentifyError(f"{what} upgrade failed: {e}") from e
        if ftype != P.FrameType.RESPONSE or payload != b"OK":
            raise IdentifyError(f"{what} upgrade failed: {payload[:64]!r}")

    def _auth(self) -> None:
        if not self.config.auth_secret:
            raise AuthError("the server requires AUTH and no auth_secret is configured")
        self._sock_send(P.auth(self.config.auth_secret))
        ftype, payload = self._read_frame_blocking()
        if ftype == P.FrameType.ERROR:
            raise AuthError(payload.decode("utf-8", "replace"))

    def subscribe(self, topic: str, channel: str) -> None:
        """Send SUB and wait for its OK; blocking, before ``start()``.

        Raises:
            ProtocolError: the server refused (E_BAD_TOPIC, E_SUB_FAILED, ...).
        """
        self._sock_send(P.sub(topic, channel))
        ftype, payload = self._read_frame_blocking()
        if ftype == P.FrameType.ERROR:
            self._close_socket()
            raise ProtocolError(payload)

    def _sock_send(self, data: bytes) -> None:
        if self._sock is None:
            raise NotConnectedError(f"{self.address}: not connected")
        self._sock.sendall(self._codec.compress(data) if self._codec is not None else data)

    def _read_frame_blocking(self) -> tuple[P.FrameType, bytes]:
        """Next non-heartbeat frame, answering heartbeats; only before ``start()``."""
        assert self._sock is not None
        while True:
            frame = self._reader.next_frame()
            if frame is not None:
                if frame[0] == P.FrameType.RESPONSE and frame[1] == P.HEARTBEAT:
                    self._sock_send(P.nop())
                    continue
                return frame
            data = self._recv()
            if not data:
                raise NotConnectedError(f"{self.address}: connection closed by peer")
            self._reader.feed(self._codec.decompress(bytes(data)) if self._codec is not None
                              else data)

    def _recv(self) -> memoryview:
        """One socket read into the connection's kept buffer: a view of what arrived
        (empty at EOF, and once the socket is closed), valid until the next read.
        Raises what the socket raises."""
        sock, buf = self._sock, self._rbuf
        if sock is None:
            return memoryview(b"")
        if buf is None:
            buf = self._rbuf = memoryview(bytearray(_RECV_SIZE))
        return buf[:sock.recv_into(buf)]

    # -- running (IOLoop thread reads) --------------------------------------------------
    def start(self) -> None:
        """Hand the socket to the IOLoop; it reads from now on."""
        assert self._sock is not None
        self._sock.setblocking(False)
        self._started = True
        self._last_read = time.monotonic()
        self.loop.call_soon_threadsafe(self._register)

    def _register(self) -> None:
        if self._closed or self._sock is None:
            return
        with self._wlock:
            pending = bool(self._wbuf)
        self.loop.register(self, write=pending)
        self._schedule_read_check()
        if self._reader.pending():
            self._dispatch()

    def fileno(self) -> int:
        return self._sock.fileno() if self._sock is not None else -1

    def _schedule_read_check(self) -> None:
        if self.config.read_timeout > 0:
            self.loop.call_later(min(self.config.read_timeout, 5.0), self._check_read_timeout)

    def _check_read_timeout(self) -> None:
        if self._closed:
            return
        idle = time.monotonic() - self._last_read
        if idle > self.config.read_timeout:
            self.close(f"no data for {idle:.1f}s (read_timeout)")
            return
        self._schedule_read_check()

    def on_readable(self) -> None:
        if self._closed or self._sock is None:
            return
        pending = getattr(self._sock, "pending", None)   # TLS: records decrypted already
        while True:
            try:
                data = self._recv()
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:
                self.close(f"read error: {e}")
                return
            if not data:
                self.close("connection closed by peer")
                return
            self._last_read = time.monotonic()
            if self._codec is not None:
                try:
                    self._reader.feed(self._codec.decompress(bytes(data)))
                except CorruptStream as e:
                    self.close(f"protocol error: {e}")
                    return
            else:
                self._reader.feed(data)     # copied into the frame reader's buffer
            # a full buffer may leave decrypted TLS plaintext the selector cannot see
            if len(data) < _RECV_SIZE or pending is None or not pending():
                break
        self._dispatch()

    def _dispatch(self) -> None:
        while not self._closed:
            try:
                frame = self._reader.next_frame()
            except P.FrameError as e:
                self.close(f"protocol error: {e}")
                return
            if frame is None:
                return
            ftype, data = frame
            if ftype == P.FrameType.RESPONSE:
                if data == P.HEARTBEAT:
                    self.heartbeats += 1
                    self.delegate.on_heartbeat(self)
                    self.send_quietly(P.nop())
                else:
                    self.delegate.on_response(self, data)
            elif ftype == P.FrameType.ERROR:
                log.error("(%s) protocol error - %s", self.address,
                          data.decode("utf-8", "replace"))
                self.delegate.on_error(self, data)
            else:
                try:
                    raw = P.decode_message(data)
                except P.FrameError as e:
                    self.close(f"protocol error: {e}")
                    return
                msg = Message(raw.id, raw.body, raw.timestamp, raw.attempts,
                              self.address, self)
                self.last_message_ts = time.monotonic()
                self.messages_received += 1
                self.delegate.on_message(self, msg)

    # -- writing (any thread) --------------------------------------------------------
    def send(self, data: bytes) -> None:
        """Queue bytes for the server, writing at once when the socket allows.

        Raises:
            NotConnectedError: the connection is closed.
        """
        if not self._started:
            try:
                self._sock_send(data)
            except OSError as e:
                raise NotConnectedError(f"{self.address}: {e}") from e
            return
        error: str | None = None
        with self._wlock:
            while (0 < self.max_pending_write < len(self._wbuf) and not self._closed
                   and not self.loop.in_loop_thread()):
                self._wlock.wait(1.0)
            if self._closed or self._sock is None:
                raise NotConnectedError(f"{self.address}: connection closed")
            if self._codec is not None:  # in write order, under the write lock
                data = self._codec.compress(data)
            if self._wbuf:
                self._wbuf += data
                return
            try:
                n = self._sock.send(data)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError as e:
                n, error = 0, f"write error: {e}"
            if error is None and n < len(data):
                self._wbuf += data[n:]
                self.loop.call_soon_threadsafe(self._want_write)
        if error is not None:
            self.close(error)
            raise NotConnectedError(f"{self.address}: {error}")

    def send_quietly(self, data: bytes) -> bool:
        """send(), logging instead of raising; True if the bytes were queued."""
        try:
            self.send(data)
            return True
        except NotConnectedError as e:
            log.warning("(%s) could not send %r: %s", self.address, data[:20], e)
            return False

    def _want_write(self) -> None:
        with self._wlock:
            pending = bool(self._wbuf)
        if pending and not self._closed:
            self.loop.modify(self, write=True)

    def on_writable(self) -> None:
        if self._closed or self._sock is None:
            return
        error: str | None = None
        with self._wlock:
            try:
                n = self._sock.send(self._wbuf[:_WRITE_CHUNK])
                del self._wbuf[:n]
            except (BlockingIOError, InterruptedError):
                pass
            except OSError as e:
                error = f"write error: {e}"
            if not self._wbuf:
                self.loop.modify(self, write=False)
            self._wlock.notify_all()
        if error is not None:
            self.close(error)

    def pending_write_bytes(self) -> int:
        with self._wlock:
            return len(self._wbuf)

    # -- message responses (handler threads) -------------------------------------------
    def on_finish(self, message: Message) -> None:
        self._respond(message, P.fin(message.id), None, False)

    def on_requeue(self, message: Message, delay_s: float | None, backoff: bool) -> None:
        if delay_s is None:
            delay_s = min(self.config.default_requeue_delay * message.attempts,
                          self.config.max_requeue_delay)
        cmd = P.req(message.id, int(max(0.0, delay_s) * 1000))
        self._respond(message, cmd, delay_s, backoff)

    def _respond(self, message: Message, cmd: bytes, delay_s: float | None,
                 backoff: bool) -> None:
        # matches go-nsq: count and signal (e.g. RDY 0 for backoff) before the FIN/REQ
        # leaves, so the server never sees a free slot we did not mean to give it
        with self._close_lock:
            self._responding += 1
        try:
            if delay_s is None:
                self.delegate.on_message_finished(self, message)
            else:
                self.delegate.on_message_requeued(self, message, backoff)
            self.send_quietly(cmd)
        finally:
            with self._close_lock:
                self._responding -= 1
        self.maybe_close_drained()

    def maybe_close_drained(self) -> None:
        """After CLOSE_WAIT, close once nothing is in flight or being answered."""
        with self._close_lock:
            ready = self.close_wait and self.in_flight == 0 and self._responding == 0
        if ready:
            self.close("drained after CLOSE_WAIT")

    def on_touch(self, message: Message) -> None:
        self.send_quietly(P.touch(message.id))

    # -- closing ---------------------------------------------------------------------
    @property
    def is_closed(self) -> bool:
        return self._closed

    def close(self, reason: str = "closed") -> None:
        """Close now (pending output is flushed best-effort); idempotent, any thread."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        log.info("(%s) closing: %s", self.address, reason)
        if not self._started:
            self._close_socket()
            return
        if self.loop.in_loop_thread():
            self._finish_close()
        else:
            self.loop.call_soon_threadsafe(self._finish_close)

    def _finish_close(self) -> None:
        if self._sock is not None:
            self.loop.unregister(self._sock.fileno())
            with self._wlock:
                if self._wbuf:
                    try:
                        self._sock.setblocking(True)
                        self._sock.settimeout(self.config.write_timeout)
                        self._sock.sendall(self._wbuf)
                    except OSError:
                        pass
                    self._wbuf.clear()
                self._wlock.notify_all()
        self._close_socket()
        self.delegate.on_close(self)

    def _close_socket(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass
