"""Client-side TLS, snappy and deflate for raw-socket tests, independent of pybroker.

``CompressedSocket`` wraps a socket (or an SSLSocket) the way go-nsq wraps its
connection after negotiation: raw DEFLATE (zlib, wbits -15, a sync flush per write) or
snappy framing (python-snappy). It offers what WireClient uses: sendall, recv,
settimeout, close.
"""
from __future__ import annotations

import socket
import ssl
import zlib
from typing import Any

import snappy

from tests.support.certs import CertSet
from tests.support.wire import WireClient


class CompressedSocket:
    def __init__(self, sock: Any, kind: str, level: int = 6) -> None:
        self.sock = sock
        self.kind = kind
        if kind == "deflate":
            self._zip = zlib.compressobj(level, zlib.DEFLATED, -15)
            self._unzip = zlib.decompressobj(-15)
        else:
            self._snap_in = snappy.StreamDecompressor()
        self._ready = b""

    def settimeout(self, t: float | None) -> None:
        self.sock.settimeout(t)

    def close(self) -> None:
        self.sock.close()

    def sendall(self, data: bytes) -> None:
        if self.kind == "deflate":
            out = self._zip.compress(data) + self._zip.flush(zlib.Z_SYNC_FLUSH)
        else:
            out = snappy.StreamCompressor().compress(data)
        self.sock.sendall(out)

    def recv(self, n: int) -> bytes:
        while not self._ready:
            raw = self.sock.recv(65536)
            if not raw:
                return b""
            if self.kind == "deflate":
                self._ready = self._unzip.decompress(raw)
            else:
                self._ready = self._snap_in.decompress(raw)
        out, self._ready = self._ready[:n], self._ready[n:]
        return out


def client_context(certs: CertSet, cert: str | None = None, key: str | None = None
                   ) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=certs.ca)
    if cert:
        ctx.load_cert_chain(cert, key)
    return ctx


def negotiate(c: WireClient, certs: CertSet | None, tls: bool = False, snappy: bool = False,
              deflate: bool = False, deflate_level: int = 0,
              cert: str | None = None, key: str | None = None) -> dict[str, Any]:
    """IDENTIFY with feature negotiation and switch c's socket the way go-nsq does:
    JSON in plaintext, then TLS and its OK, then snappy/deflate and their OK."""
    fields: dict[str, Any] = {"feature_negotiation": True, "tls_v1": tls, "snappy": snappy,
                              "deflate": deflate}
    if deflate_level:
        fields["deflate_level"] = deflate_level
    answer = c.identify(**fields)
    assert answer is not None
    if answer["tls_v1"]:
        assert certs is not None
        c.sock = client_context(certs, cert, key).wrap_socket(c.sock, server_hostname="localhost")
        c.expect_response(b"OK")
    if answer["snappy"]:
        c.sock = CompressedSocket(c.sock, "snappy")  # type: ignore[assignment]
        c.expect_response(b"OK")
    elif answer["deflate"]:
        c.sock = CompressedSocket(c.sock, "deflate",  # type: ignore[assignment]
                                  answer["deflate_level"])
        c.expect_response(b"OK")
    return answer


def raw_handshake(sock: socket.socket, ctx: ssl.SSLContext, timeout_s: float = 5.0
                  ) -> tuple[bool, bytes]:
    """Client handshake over MemoryBIOs; then read every raw byte until EOF.

    Returns (handshake completed, every byte received after the last one the TLS
    layer consumed): what a server writes outside TLS after a failed handshake.
    """
    bio_in, bio_out = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(bio_in, bio_out, server_hostname="localhost")
    sock.settimeout(timeout_s)
    done = False
    raw = b""
    while True:
        try:
            obj.do_handshake()
            done = True
        except ssl.SSLWantReadError:
            pass
        except ssl.SSLError:
            break
        if bio_out.pending:
            sock.sendall(bio_out.read())
        if done:
            try:  # TLS 1.3: a refused client certificate shows on the first read
                obj.read(1)
            except (ssl.SSLWantReadError, ssl.SSLError):
                pass
        try:
            data = sock.recv(65536)
        except (ConnectionResetError, TimeoutError):
            break
        if not data:
            break
        raw += data
        bio_in.write(data)
    return done, raw
