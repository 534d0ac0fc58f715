"""Hostile peers for the compression, TLS, AUTH and descriptor budgets, on raw sockets.

Shared by tests/integration/test_hostile_*.py and loadtest/bench_hostile.py, so the bench
measures exactly what the tests check. Independent of pybroker's code: the client side is
the stdlib (socket, ssl, zlib), python-snappy's framing and this project's test codec
(tests.support.wire).

- ``Probe``: a well-behaved client on its own connection and thread, PUBbing one small
  message and waiting for its OK again and again; ``worst_ms`` is the longest round trip
  it saw (what "the other clients" feel during an attack).
- ``CompressedConn``: a raw connection that negotiated snappy or deflate; it can send
  well-formed compressed commands or any raw bytes, and read the broker's frames.
- The attacks: ``deflate_bomb``, ``snappy_attack`` (a chunk header announcing 16 MiB, no
  stream identifier, garbage), ``TlsFlood``, ``stalled_tls_handshakes``.
"""
from __future__ import annotations

import json
import os
import socket
import ssl
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import snappy

from tests.support import wire
from tests.support.wire import ConnectionClosed, WireClient

SNAPPY_STREAM_ID = b"\xff\x06\x00\x00sNaPpY"


def open_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


# -- the well-behaved client -------------------------------------------------------------------
class Probe:
    """PUB + wait-for-OK round trips on one plain connection until stopped."""

    def __init__(self, address: tuple[str, int], topic: str, pause_s: float = 0.002,
                 auth_secret: str | None = None) -> None:
        self.address = address
        self.topic = topic
        self.pause_s = pause_s
        self.rtts: list[float] = []
        self.times: list[float] = []  # when each round trip started (time.monotonic)
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._client = WireClient.connect(address)
        if auth_secret is not None:
            self._client.identify(feature_negotiation=True)
            self._client.send(wire.command("AUTH", body=auth_secret.encode()))
            self._client.expect_response(None)
        self._client.pub(topic, b"warm-up")  # the topic exists before measuring

    def start(self) -> "Probe":
        self._thread = threading.Thread(target=self._run, name="probe", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        cmd = wire.pub(self.topic, b"probe")
        c = self._client
        while not self._stop.is_set():
            t0 = time.perf_counter()
            try:
                c.send(cmd)
                c.expect_response(b"OK", timeout=30.0)
            except Exception as e:  # reported by the measurement; the test asserts on it
                self.errors.append(repr(e))
                return
            self.rtts.append(time.perf_counter() - t0)
            self.times.append(time.monotonic() - (time.perf_counter() - t0))
            time.sleep(self.pause_s)

    def stop(self) -> "Probe":
        self._stop.set()
        if self._thread is not None:
            self._thread.join(35.0)
        self._client.close()
        return self

    @property
    def worst_ms(self) -> float:
        return max(self.rtts, default=0.0) * 1000

    def percentile_ms(self, q: float) -> float:
        if not self.rtts:
            return 0.0
        ordered = sorted(self.rtts)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000

    def summary(self) -> str:
        return (f"{len(self.rtts)} round trips, p50 {self.percentile_ms(0.5):.1f} ms, "
                f"p99 {self.percentile_ms(0.99):.1f} ms, worst {self.worst_ms:.1f} ms, "
                f"errors {self.errors}")


@contextmanager
def probing(address: tuple[str, int], topic: str,
            auth_secret: str | None = None) -> Iterator[Probe]:
    """A running Probe for the duration of the block (stopped and joined after it)."""
    p = Probe(address, topic, auth_secret=auth_secret).start()
    try:
        yield p
    finally:
        p.stop()


# -- compressed connections ---------------------------------------------------------------------
class CompressedConn:
    """A raw V2 connection that negotiated snappy or deflate (its ``OK`` read)."""

    def __init__(self, address: tuple[str, int], kind: str, level: int = 6,
                 tls: ssl.SSLContext | None = None) -> None:
        sock: Any = socket.create_connection(address, timeout=10)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        fields: dict[str, Any] = {"feature_negotiation": True, kind: True,
                                  "tls_v1": tls is not None}
        if kind == "deflate":
            fields["deflate_level"] = level
        sock.sendall(wire.MAGIC_V2 + wire.identify(**fields))
        ftype, data = wire.read_frame(sock, 10)
        assert ftype == wire.FRAME_RESPONSE and json.loads(data)[kind], data
        if tls is not None:
            sock = tls.wrap_socket(sock, server_hostname="localhost")
            assert wire.read_frame(sock, 10) == (wire.FRAME_RESPONSE, b"OK")
        self.sock = sock
        self.kind = kind
        self.plain = b""
        if kind == "deflate":
            self._zip: Any = zlib.compressobj(level, zlib.DEFLATED, -15)
            self._decode: Any = zlib.decompressobj(-15).decompress
        else:
            self._decode = snappy.StreamDecompressor().decompress
        assert self.frame(10) == (wire.FRAME_RESPONSE, b"OK")

    def compress(self, data: bytes) -> bytes:
        if self.kind == "deflate":
            return bytes(self._zip.compress(data) + self._zip.flush(zlib.Z_SYNC_FLUSH))
        return bytes(snappy.StreamCompressor().compress(data))

    def send(self, data: bytes) -> None:
        """Plaintext commands, compressed as a client library would."""
        self.sock.sendall(self.compress(data))

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def frame(self, timeout_s: float) -> tuple[int, bytes]:
        """The next frame; raises ConnectionClosed at EOF, TimeoutError past the time."""
        deadline = time.monotonic() + timeout_s
        while True:
            if len(self.plain) >= 4:
                size = struct.unpack(">i", self.plain[:4])[0]
                if len(self.plain) >= 4 + size:
                    ftype = struct.unpack(">i", self.plain[4:8])[0]
                    data, self.plain = self.plain[8:4 + size], self.plain[4 + size:]
                    return ftype, data
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no frame in time")
            self.sock.settimeout(left)
            try:
                raw = self.sock.recv(65536)
            except (ConnectionResetError, ConnectionAbortedError, ssl.SSLError) as e:
                raise ConnectionClosed(str(e)) from None
            if not raw:
                raise ConnectionClosed("EOF")
            self.plain += self._decode(raw)

    def answer(self, timeout_s: float) -> tuple[int, bytes]:
        """The next frame that is not a heartbeat (skipped, not answered: a raw stream
        such as a bomb's cannot take a NOP compressed apart from it). One comes when
        the wait outlasts the 30 s interval, on a slow machine under the suite's
        workers."""
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.frame(max(0.0, deadline - time.monotonic()))
            if got != (wire.FRAME_RESPONSE, wire.HEARTBEAT):
                return got

    def closing_frames(self, timeout_s: float = 10.0) -> tuple[bool, list[tuple[int, bytes]]]:
        """Frames until the broker closes: (closed within timeout_s, the frames). A frame
        the broker could not finish before closing is not returned."""
        frames: list[tuple[int, bytes]] = []
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                frames.append(self.frame(max(0.0, deadline - time.monotonic())))
            except ConnectionClosed:
                return True, frames
            except TimeoutError:
                return False, frames
            except Exception:  # a stream the client cannot decode any more: closed too
                return True, frames

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def deflate_bomb(address: tuple[str, int], topic: str, plain_size: int = 16 << 20,
                 timeout_s: float = 120.0) -> float:
    """16 MiB of ``NOP\\n`` deflated (16 KB on the wire), then a PUB, in one stream.
    Returns the seconds from the first byte until that PUB's OK arrived."""
    c = CompressedConn(address, "deflate")
    try:
        z = zlib.compressobj(9, zlib.DEFLATED, -15)
        nops = b"NOP\n" * (1 << 16)
        bomb = b"".join(z.compress(nops) for _ in range(plain_size // len(nops)))
        bomb += z.compress(wire.pub(topic, b"after the bomb")) + z.flush(zlib.Z_SYNC_FLUSH)
        t0 = time.perf_counter()
        c.send_raw(bomb)
        assert c.answer(timeout_s) == (wire.FRAME_RESPONSE, b"OK")
        return time.perf_counter() - t0
    finally:
        c.close()


def snappy_chunk(kind: int, payload: bytes) -> bytes:
    return bytes([kind]) + len(payload).to_bytes(3, "little") + payload


def snappy_attack(address: tuple[str, int], payload: bytes,
                  timeout_s: float = 10.0) -> tuple[bool, list[tuple[int, bytes]]]:
    """Negotiate snappy, send ``payload`` raw; (closed, frames before the close)."""
    c = CompressedConn(address, "snappy")
    try:
        try:
            c.send_raw(payload)
        except (BrokenPipeError, ConnectionResetError):
            pass
        return c.closing_frames(timeout_s)
    finally:
        c.close()


# -- TLS ----------------------------------------------------------------------------------------
def tls_upgrade(address: tuple[str, int], ctx: ssl.SSLContext) -> ssl.SSLSocket:
    """A connection upgraded to TLS as go-nsq does it (its OK read)."""
    sock = socket.create_connection(address, timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(wire.MAGIC_V2 + wire.identify(feature_negotiation=True, tls_v1=True))
    ftype, data = wire.read_frame(sock, 10)
    assert ftype == wire.FRAME_RESPONSE and json.loads(data)["tls_v1"], data
    tls = ctx.wrap_socket(sock, server_hostname="localhost")
    assert wire.read_frame(tls, 10) == (wire.FRAME_RESPONSE, b"OK")  # type: ignore[arg-type]
    return tls


class TlsFlood:
    """A TLS client writing PUBs as fast as it can and never reading its replies."""

    def __init__(self, address: tuple[str, int], ctx: ssl.SSLContext, topic: str) -> None:
        self.sock = tls_upgrade(address, ctx)
        self.topic = topic
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tls-flood", daemon=True)

    def start(self) -> "TlsFlood":
        self._thread.start()
        return self

    def _run(self) -> None:
        batch = wire.pub(self.topic, b"x" * 64) * 512
        self.sock.settimeout(0.5)
        while not self._stop.is_set():
            try:
                self.sock.sendall(batch)
            except (TimeoutError, ssl.SSLWantWriteError):
                continue  # the broker stopped reading us: the point of the attack
            except OSError:
                return
            self.sent += 512

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        try:
            self.sock.close()
        except OSError:
            pass


def stalled_tls_handshakes(address: tuple[str, int], n: int) -> list[socket.socket]:
    """n connections that ask for TLS in IDENTIFY, read the answer, send half a
    ClientHello and stop there."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    obj = ctx.wrap_bio(ssl.MemoryBIO(), out := ssl.MemoryBIO())
    try:
        obj.do_handshake()
    except ssl.SSLWantReadError:
        pass
    hello = out.read()
    socks = []
    for _ in range(n):
        s = socket.create_connection(address, timeout=10)
        s.sendall(wire.MAGIC_V2 + wire.identify(feature_negotiation=True, tls_v1=True))
        socks.append(s)
    for s in socks:
        ftype, data = wire.read_frame(s, 10)
        assert ftype == wire.FRAME_RESPONSE and json.loads(data)["tls_v1"], data
        s.sendall(hello[:len(hello) // 2])
    return socks


# -- a scripted auth server ------------------------------------------------------------------
def _grant(topic: str) -> dict[str, Any]:
    return {"ttl": 3600, "identity": "hostile", "authorizations": [
        {"topic": topic, "channels": [".*"], "permissions": ["publish", "subscribe"]}]}


class AuthServer:
    """nsqd's auth protocol on loopback, answering by secret:

    fast / slow (after ``slow_s``): a grant for any topic; trickle: headers, then one
    body byte a second; backtrack: topic pattern ``^([a-z0-9]+_?)*$``; t3z: ``^t3\\z``;
    huge: a 2 MiB answer. Requests are handled on threads, one each."""

    def __init__(self, slow_s: float = 1.5) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        import urllib.parse

        self.slow_s = slow_s
        self.slow_seen = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                q = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(self.path).query))
                secret = q.get("secret", "")
                if secret == "slow":
                    with owner._lock:
                        owner.slow_seen += 1
                    owner._stop.wait(owner.slow_s)
                body = {"fast": _grant(".*"), "slow": _grant(".*"), "trickle": _grant(".*"),
                        "backtrack": _grant("^([a-z0-9]+_?)*$"), "t3z": _grant(r"^t3\z"),
                        "huge": dict(_grant(".*"), pad="x" * (2 << 20))}.get(secret)
                if body is None:
                    self.send_response(403)
                    self.end_headers()
                    return
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if secret == "trickle":
                    for i in range(len(data)):
                        if owner._stop.wait(1.0):
                            return
                        try:
                            self.wfile.write(data[i:i + 1])
                            self.wfile.flush()
                        except OSError:
                            return
                    return
                try:
                    self.wfile.write(data)
                except OSError:
                    pass

        class Server(ThreadingHTTPServer):
            request_queue_size = 256
            daemon_threads = True

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="auth-server",
                                        daemon=True)

    def start(self) -> "AuthServer":
        self._thread.start()
        return self

    def wait_slow(self, n: int, timeout_s: float) -> bool:
        """Until n slow queries are being held (True), or the time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if self.slow_seen >= n:
                    self.slow_seen -= n
                    return True
            time.sleep(0.01)
        return False

    def stop(self) -> None:
        self._stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()
