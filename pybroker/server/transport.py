"""Transport: the byte pipe under one TCP client — plain, TLS, snappy, deflate.

Owned by the connection's loop. ``recv()`` returns plaintext (None: nothing yet) and
``send(buffers)`` takes plaintext frames and returns how many bytes still wait for the
socket. Layers stack as nsqd's negotiation does (client_v2.go UpgradeTLS, UpgradeSnappy,
UpgradeDeflate): TLS wraps the socket (``ssl.SSLObject`` over two MemoryBIOs, so the
handshake is driven by the loop and never blocks), then snappy framing or raw deflate
wraps TLS. Compression runs once per ``send`` (one flushed buffer, nsqd's per-write
flush), never per message. Imports no protocol code beyond the OK frame.

Theory of operation
-------------------
Output is encoded at once (compress, then encrypt) into ``_raw``, the bytes owed to the
socket, and written from there; so frames queued before a switch keep the layers they
were queued under (the IDENTIFY answer goes out in plaintext, nsqd's order). Input is
decrypted, then decompressed. During the handshake ``recv`` returns None; when it
completes, ``_on_ready`` queues the ``OK`` frames of the upgrade.
"""
from __future__ import annotations

import logging
import socket
import ssl
from typing import TYPE_CHECKING, Any, Callable

from pybroker.protocol.compression import CorruptStream, Deflate, Snappy
from pybroker.protocol.encoder import OK_FRAME, encode_error
from pybroker.server import tls as tlsinfo

if TYPE_CHECKING:
    from pybroker.server.connection import ClientConn

log = logging.getLogger("pybroker")
RECV_SIZE = 256 * 1024
HANDSHAKE_TIMEOUT_NS = 5_000_000_000  # matches nsqd's 5 s deadline in UpgradeTLS


class TransportError(OSError):
    """The pipe broke in a layer (bad TLS record, corrupt compressed stream)."""


class Transport:
    """See the module docstring. ``waiting`` is the byte count owed to the socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._raw = b""
        self.waiting = 0
        self.tls = False
        self.snappy = False
        self.deflate = False
        self.deflate_level = 0
        self.handshaking = False
        self._ssl: ssl.SSLObject | None = None
        self._bio_in: ssl.MemoryBIO | None = None
        self._bio_out: ssl.MemoryBIO | None = None
        self._codec: Snappy | Deflate | None = None
        self._on_ready: Callable[[], None] | None = None
        self._eof = False
        self.tls_stats: dict[str, Any] = {}
        self.common_name = ""

    @property
    def layered(self) -> bool:
        return self._ssl is not None or self.snappy or self.deflate

    # -- reading ------------------------------------------------------------------------
    def recv(self) -> bytes | None:
        """Plaintext that arrived: b"" at EOF, None when nothing is complete yet.

        Raises BlockingIOError (no bytes at all), OSError (the socket or a layer broke).
        """
        data = self.sock.recv(RECV_SIZE)
        if self._ssl is None:
            if not data or not (self.snappy or self.deflate):
                return data
            return self._decompress(data)
        assert self._bio_in is not None
        if not data:
            self._bio_in.write_eof()
        else:
            self._bio_in.write(data)
        if self.handshaking:
            if not self._handshake():
                return None
        plain = self._decrypt()
        self._pull_tls_output()  # post-handshake records (tickets, key updates)
        if not plain:
            return b"" if self._eof or not data else None
        return self._decompress(plain) if (self.snappy or self.deflate) else plain

    def _decrypt(self) -> bytes:
        assert self._ssl is not None
        parts = []
        while True:
            try:
                chunk = self._ssl.read(RECV_SIZE)
            except ssl.SSLWantReadError:
                break
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                self._eof = True  # close_notify, or a peer that just hung up
                break
            except ssl.SSLError as e:
                raise TransportError(f"tls: {e.reason or e}") from None
            if not chunk:
                self._eof = True
                break
            parts.append(chunk)
        return b"".join(parts)

    def _decompress(self, data: bytes) -> bytes | None:
        assert self._codec is not None
        try:
            return self._codec.decompress(data) or None
        except CorruptStream as e:
            raise TransportError(str(e)) from None

    # -- writing ------------------------------------------------------------------------
    def send(self, out: list[bytes]) -> int | None:
        """Encode ``out`` (plaintext frames, now owned here) and write what the socket
        takes. Returns the bytes still owed, or None when the connection broke."""
        if out:
            data = out[0] if len(out) == 1 else b"".join(out)
            if self.layered:
                data = self._encode(data)
            self._raw = self._raw + data if self._raw else data
        raw = self._raw
        if not raw:
            self.waiting = 0
            return 0
        try:
            sent = self.sock.send(raw)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            return None
        self._raw = raw[sent:] if sent < len(raw) else b""
        self.waiting = len(self._raw)
        return self.waiting

    def _encode(self, data: bytes) -> bytes:
        if self._codec is not None:
            # matches nsqd: one compressed write (deflate: one sync flush) per flush
            data = self._codec.compress(data)
        if self._ssl is None:
            return data
        view = memoryview(data)
        while view:
            n = self._ssl.write(view)
            view = view[n:]
        assert self._bio_out is not None
        return self._bio_out.read()

    def _pull_tls_output(self) -> None:
        if self._bio_out is not None and self._bio_out.pending:
            self._raw += self._bio_out.read()
            self.waiting = len(self._raw)

    def send_blocking(self, out: list[bytes], timeout_s: float) -> None:
        """Write ``out`` and everything owed, blocking up to timeout_s (shutdown path)."""
        if self.handshaking:
            out = []  # frames for a client that never finished its handshake are dropped
        self.send(out)
        if self._raw:
            self.sock.settimeout(timeout_s)
            self.sock.sendall(self._raw)
            self._raw = b""
            self.waiting = 0

    # -- upgrades (nsqd's IDENTIFY order: TLS, then snappy or deflate) ---------------------
    def start_tls(self, ctx: ssl.SSLContext, on_ready: Callable[[], None]) -> None:
        self._bio_in, self._bio_out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._ssl = ctx.wrap_bio(self._bio_in, self._bio_out, server_side=True)
        self.handshaking = True
        self._on_ready = on_ready

    def _handshake(self) -> bool:
        """Drive the handshake with what arrived; True once it is complete."""
        assert self._ssl is not None
        try:
            self._ssl.do_handshake()
        except ssl.SSLWantReadError:
            self._pull_tls_output()
            if self._bio_in is not None and self._bio_in.eof:
                raise TransportError("tls: EOF during handshake") from None
            return False
        except (ssl.SSLError, ssl.CertificateError) as e:
            self._pull_tls_output()  # the alert goes to the client before we close
            raise TransportError(f"tls: {getattr(e, 'reason', None) or e}") from None
        self.handshaking = False
        self.tls = True
        self.tls_stats = tlsinfo.describe(self._ssl)
        self.common_name = tlsinfo.peer_common_name(self._ssl)
        self._pull_tls_output()
        cb, self._on_ready = self._on_ready, None
        if cb is not None:
            cb()
        return True

    def start_snappy(self) -> None:
        self.snappy = True
        self._codec = Snappy()

    def start_deflate(self, level: int) -> None:
        self.deflate = True
        self.deflate_level = level
        self._codec = Deflate(level)


def upgrade(c: "ClientConn", ctx: ssl.SSLContext | None, snappy: bool, deflate_level: int) -> None:
    """Switch a client's transport after its IDENTIFY answer, as nsqd's IDENTIFY does.

    The answer already queued on ``c`` goes out in plaintext; then the TLS handshake (if
    ctx) and ``OK`` over TLS; then snappy or deflate (level > 0) and ``OK`` compressed.
    The client reads no further commands until every upgrade is in place.
    """
    t: Transport = c.transport
    t.send(c.out)
    c.out = []
    c.out_bytes = 0
    c.loop.to_flush[c] = None

    def finish() -> None:
        if ctx is not None:
            c.loop.cancel(timer)
            log.info("[%s] TLS handshake done (%s %s)", c, t.tls_stats.get("tls_version"),
                     t.tls_stats.get("tls_cipher_suite"))
            t.send([OK_FRAME])
            c.session.tls = True
        if snappy:
            log.info("PROTOCOL(V2): [%s] upgrading connection to snappy", c)
            t.start_snappy()
            t.send([OK_FRAME])
        elif deflate_level:
            log.info("PROTOCOL(V2): [%s] upgrading connection to deflate (level %d)", c,
                     deflate_level)
            t.start_deflate(deflate_level)
            t.send([OK_FRAME])
        c.session.release()
        c.loop.to_flush[c] = None
        if not c.closed:
            c.process()

    c.session.hold()
    if ctx is None:
        finish()
        return
    log.info("PROTOCOL(V2): [%s] upgrading connection to TLS", c)

    def stalled() -> None:
        if t.handshaking and not c.closed:
            try:
                local = "%s:%s" % c.sock.getsockname()[:2]
            except OSError:
                local = "?"
            handshake_failed(c, TransportError(f"read tcp {local}->{c.remote_address}: "
                                               "i/o timeout"))

    timer = c.loop.call_later(HANDSHAKE_TIMEOUT_NS, stalled)
    t.start_tls(ctx, finish)


# OpenSSL's reasons for common handshake failures, in the words of Go's crypto/tls
_GO_TLS_ERRORS = {
    "PEER_DID_NOT_RETURN_A_CERTIFICATE": "tls: client didn't provide a certificate",
    "CERTIFICATE_VERIFY_FAILED":
        "tls: failed to verify certificate: x509: certificate signed by unknown authority",
    "WRONG_VERSION_NUMBER": "tls: first record does not look like a TLS handshake",
    "HTTP_REQUEST": "tls: first record does not look like a TLS handshake",
    "UNSUPPORTED_PROTOCOL": "tls: client offered only unsupported versions",
}


def handshake_failed(c: "ClientConn", err: OSError) -> None:
    """nsqd answers a failed handshake with a plaintext E_IDENTIFY_FAILED, then closes."""
    t: Transport = c.transport
    text = str(err)
    reason = text[5:] if text.startswith("tls: ") else text
    text = _GO_TLS_ERRORS.get(reason, text)
    payload = f"E_IDENTIFY_FAILED IDENTIFY failed {text}".encode()
    log.error("[%s] - %s", c, payload.decode())
    t._ssl = None  # the frame goes out as nsqd's does: on the raw socket, after the alert
    t.handshaking = False
    t.send([encode_error(payload)])
    c.close("TLS handshake failed")
