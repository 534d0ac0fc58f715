"""Transport: the byte pipe under one TCP client — plain, TLS, snappy, deflate.

Owned by the connection's loop. ``recv()`` returns plaintext (None: nothing yet) and
``send(buffers)`` takes plaintext frames and returns how many bytes still wait for the
socket. Layers stack as nsqd's negotiation does (client_v2.go UpgradeTLS, UpgradeSnappy,
UpgradeDeflate): TLS wraps the socket (``ssl.SSLObject`` over two MemoryBIOs, so the
handshake is driven by the loop and never blocks), then snappy framing or raw deflate
wraps TLS. Compression runs once per ``send`` (one flushed buffer, nsqd's per-write
flush), never per message. Imports no protocol code but the codecs, and those (with
``ssl``) only when the first client asks for them: a broker whose clients use neither
TLS nor compression never loads them. The switch itself (IDENTIFY's upgrades, the
handshake's deadline and slots) is server.upgrade.

Theory of operation
-------------------
Output is encoded at once (compress, then encrypt) into ``_raw``, the bytes owed to the
socket, and written from there; so frames queued before a switch keep the layers they
were queued under (the IDENTIFY answer goes out in plaintext, nsqd's order). Input is
decrypted, then decompressed. During the handshake ``recv`` returns None; when it
completes, ``_on_ready`` queues the ``OK`` frames of the upgrade.

Input budget: bytes in, bounded bytes out. One socket read takes at most ``RECV_SIZE``
bytes, and TLS decrypts at most ``RECV_SIZE`` of plaintext per read (records beyond wait
in the BIO). ``recv`` hands out at most ``PIECE`` bytes of plaintext at a time;
what is left of a read (plaintext, compressed input, TLS records) is the ``backlog``,
and the socket is not read again until the backlog is gone. So a connection holds at
most one read plus the codec's bound (protocol.compression) beyond what its command
decoder holds, and its reader (ClientConn.on_readable) decides how many pieces one loop
turn takes: a deflate bomb inflates ``PIECE`` bytes at a time, only as fast as the
connection's commands run, and not at all while its reading is paused.

Receiving allocates only what arrived: the socket is read with ``recv_into`` a buffer
of RECV_SIZE that each loop thread keeps (``sockio.scratch``; a connection only ever reads
on its owner loop's thread), TLS decrypts into that buffer too, and only the bytes
received are copied out as the bytes object the decoder keeps. A fresh RECV_SIZE
object per read (``sock.recv(RECV_SIZE)``) is above glibc's mmap threshold: an mmap,
an mremap and a munmap per call, ~12 us more per small read than ``recv_into``
(docs/io.md has the measurement).
"""
from __future__ import annotations

import select
import socket
from collections import deque
from typing import TYPE_CHECKING, Callable, Protocol, cast

from pybroker.server.sockio import scratch

if TYPE_CHECKING:
    import ssl

    from pybroker.protocol.compression import Deflate, Snappy

RECV_SIZE = 256 * 1024   # bytes of one socket read (and of plaintext per TLS read)
PIECE = 8 * 1024         # plaintext handed to the command decoder at a time


class TransportError(OSError):
    """The pipe broke in a layer (bad TLS record, corrupt compressed stream)."""


class CorruptInput(TransportError):
    """The client's compressed stream is corrupt (its output direction still works)."""


class SlotWaiter(Protocol):
    """A client waiting for a TLS handshake slot (server.upgrade): its connection."""

    transport: Transport

    @property
    def closed(self) -> bool: ...
    def release_input(self) -> None: ...


class HandshakeSlots:
    """The TLS handshakes one loop runs (at most server.upgrade.MAX_HANDSHAKES) and the
    clients waiting for one of them, oldest first. Owned by that loop's thread."""

    def __init__(self) -> None:
        self.running = 0
        self.waiting: deque[tuple[SlotWaiter, Callable[[], None]]] = deque()


class Transport:
    """See the module docstring. ``waiting`` is the byte count owed to the socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._raw = bytearray()
        self.waiting = 0
        self.tls = False
        self.snappy = False
        self.deflate = False
        # TLS, snappy or deflate on: bytes are encoded on their way out (set by start_*)
        self.layered = False
        self.deflate_level = 0
        self.handshaking = False
        self._ssl: ssl.SSLObject | None = None
        self._bio_in: ssl.MemoryBIO | None = None
        self._bio_out: ssl.MemoryBIO | None = None
        self._codec: Snappy | Deflate | None = None
        self._on_ready: Callable[[], None] | None = None
        self._eof = False
        self._tls_more = False   # the last TLS read filled RECV_SIZE: records may wait
        self._plain = b""        # plaintext read but not handed out, from _plain_pos
        self._plain_pos = 0
        self.slot: HandshakeSlots | None = None  # the loop's handshake slot it holds
        self.tls_queued = False  # TLS was negotiated; waiting for a handshake slot
        self.handshake_deadline_ns = 0
        self.tls_stats: dict[str, object] = {}
        self.common_name = ""

    def plain_idle(self) -> bool:
        """Plain bytes straight from the socket (no TLS, no compression, none coming),
        and nothing read but not handed out: the publish lane may read it (server/lane)."""
        return not (self.layered or self.tls_queued or self._plain)

    @property
    def backlog(self) -> bool:
        """Input already read that ``recv`` has not handed out yet: more plaintext is
        there without reading the socket (the selector cannot see it)."""
        return (self._plain_pos < len(self._plain) or self._tls_more
                or (self._codec is not None and self._codec.backlog))

    def buffered(self) -> int:
        """Bytes of input held here (plaintext, compressed, decoded)."""
        n = len(self._plain) - self._plain_pos
        if self._codec is not None:
            n += self._codec.buffered()
        return n

    # -- reading ------------------------------------------------------------------------
    def recv(self) -> bytes | None:
        """At most PIECE bytes of plaintext: b"" at EOF, None when nothing is complete.

        Reads the socket only when the backlog is empty. Raises BlockingIOError (no
        bytes at all), OSError (the socket or a layer broke).
        """
        if self._plain_pos < len(self._plain):
            return self._take_plain()
        codec = self._codec
        if codec is not None and codec.backlog:
            return self._inflate(codec)
        data = self._read_lower()
        if not data:
            return data
        codec = self._codec  # a handshake that just finished may have switched it on
        if codec is not None:
            codec.feed(data)
            return self._inflate(codec)
        if len(data) <= PIECE:
            return data
        self._plain, self._plain_pos = data, 0
        return self._take_plain()

    def _take_plain(self) -> bytes:
        pos = self._plain_pos
        end = pos + PIECE
        piece = self._plain[pos:end]
        if end >= len(self._plain):
            self._plain, self._plain_pos = b"", 0
        else:
            self._plain_pos = end
        return piece

    def _inflate(self, codec: Snappy | Deflate) -> bytes | None:
        from pybroker.protocol.compression import CorruptStream, Deflate  # loaded already

        try:
            out = codec.read(PIECE)
        except CorruptStream as e:
            raise CorruptInput(str(e)) from None
        if out:
            return out
        return b"" if isinstance(codec, Deflate) and codec.eof else None

    def input_ready(self) -> bool:
        """Bytes wait to be read (already decrypted or decoded, or in the socket): asked
        only at a read deadline, so a peer is never judged silent on input not yet read."""
        if self._tls_more or len(self._plain) > self._plain_pos:
            return True
        poller = select.poll()
        poller.register(self.sock.fileno(), select.POLLIN)
        try:
            return bool(poller.poll(0))
        except OSError:
            return False

    def _read_lower(self) -> bytes | None:
        """Bytes from the socket, through TLS when it is on (b"" at EOF, None: a partial
        record or the handshake)."""
        buf = scratch(RECV_SIZE)
        if self._ssl is None:
            n = self.sock.recv_into(buf)
            return bytes(buf[:n]) if n else b""
        assert self._bio_in is not None
        eof = False
        if not self._tls_more:
            n = self.sock.recv_into(buf)
            if not n:
                eof = True
                self._bio_in.write_eof()
            else:
                self._bio_in.write(buf[:n])
            if self.handshaking:
                if not self._handshake():
                    return None
        got = self._decrypt(buf)
        self._pull_tls_output()  # post-handshake records (tickets, key updates)
        if not got:
            return b"" if self._eof or eof else None
        return bytes(buf[:got])

    def _decrypt(self, buf: memoryview) -> int:
        """Decrypt at most len(buf) bytes of plaintext into buf; returns how many."""
        import ssl  # imported by start_tls already: a dict lookup

        assert self._ssl is not None
        limit = len(buf)
        got = 0
        self._tls_more = False
        while got < limit:
            try:
                # read into a buffer returns a count (typeshed says bytes)
                n = cast(int, self._ssl.read(limit - got, cast(bytearray, buf[got:])))
            except ssl.SSLWantReadError:
                break
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                self._eof = True  # close_notify, or a peer that just hung up
                break
            except ssl.SSLError as e:
                raise TransportError(f"tls: {e.reason or e}") from None
            if not n:
                self._eof = True
                break
            got += n
        else:
            self._tls_more = True
        return got

    # -- writing ------------------------------------------------------------------------
    def owe(self, data: bytes | bytearray | memoryview, sent: int) -> int:
        """A write made for this transport elsewhere (a batch; nothing was owed and it
        is plain) took ``sent`` bytes of ``data``: keep the rest. Returns bytes owed."""
        if sent < len(data):
            self._raw += memoryview(data)[sent:]
        self.waiting = len(self._raw)
        return self.waiting

    def send(self, out: list[bytes | bytearray]) -> int | None:
        """Encode ``out`` (plaintext frames, now owned here) and write what the socket
        takes. Returns the bytes still owed, or None when the connection broke."""
        if out:
            data = out[0] if len(out) == 1 else b"".join(out)
            if self.layered:
                data = self._encode(data)
            if self._raw:
                self._raw += data
            else:
                # nothing owed: write the frames as they are (the common case)
                try:
                    sent = self.sock.send(data)
                except (BlockingIOError, InterruptedError):
                    sent = 0
                except OSError:
                    return None
                if sent < len(data):
                    self._raw += memoryview(data)[sent:]
                self.waiting = len(self._raw)
                return self.waiting
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
        del raw[:sent]  # O(1) at the front of a bytearray: no re-join of what is owed
        self.waiting = len(raw)
        return self.waiting

    def _encode(self, data: bytes | bytearray) -> bytes | bytearray:
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

    def send_blocking(self, out: list[bytes | bytearray], timeout_s: float) -> None:
        """Write ``out`` and everything owed, blocking up to timeout_s (shutdown path)."""
        if self.handshaking:
            out = []  # frames for a client that never finished its handshake are dropped
        self.send(out)
        if self._raw:
            self.sock.settimeout(timeout_s)
            self.sock.sendall(self._raw)
            self._raw = bytearray()
            self.waiting = 0

    # -- upgrades (nsqd's IDENTIFY order: TLS, then snappy or deflate) ---------------------
    def start_tls(self, ctx: ssl.SSLContext, on_ready: Callable[[], None]) -> None:
        import ssl

        self._bio_in, self._bio_out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._ssl = ctx.wrap_bio(self._bio_in, self._bio_out, server_side=True)
        self.layered = True
        self.handshaking = True
        self._on_ready = on_ready
        if self._plain_pos < len(self._plain):
            # bytes read after the IDENTIFY but not handed out belong to the handshake
            self._bio_in.write(self._plain[self._plain_pos:])
            self._plain, self._plain_pos = b"", 0

    def _handshake(self) -> bool:
        """Drive the handshake with what arrived; True once it is complete."""
        import ssl

        from pybroker.server import tls as tlsinfo

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
        from pybroker.protocol.compression import Snappy

        self.snappy = self.layered = True
        self._start_codec(Snappy())

    def start_deflate(self, level: int) -> None:
        from pybroker.protocol.compression import Deflate

        self.deflate = self.layered = True
        self.deflate_level = level
        self._start_codec(Deflate(level))

    def _start_codec(self, codec: Snappy | Deflate) -> None:
        self._codec = codec
        if self._plain_pos < len(self._plain):
            # bytes read after the upgrade point but not handed out are compressed
            codec.feed(self._plain[self._plain_pos:])
            self._plain, self._plain_pos = b"", 0
