"""Helpers for the storage, crash and import tests: HTTP reads, a draining consumer,
publishers that record which messages were acknowledged, and segment-file surgery.

Everything here talks to a real broker over loopback sockets (tests/support/wire.py
encodes; nothing from pybroker.protocol) and never reads pybroker's own storage code:
segment offsets are found by parsing the documented on-disk format directly.
"""
from __future__ import annotations

import json
import os
import socket
import struct
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from tests.support.broker import BrokerProcess
from tests.support.wire import (
    FRAME_ERROR,
    FRAME_MESSAGE,
    FRAME_RESPONSE,
    HEARTBEAT,
    MAGIC_V2,
    ConnectionClosed,
    Message,
    WireClient,
    dpub,
    fin,
    identify,
    mpub,
    nop,
    parse_message,
    pub,
    rdy,
    read_frame,
    sub,
)

# -- HTTP -----------------------------------------------------------------------------------


def http(b: BrokerProcess, method: str, path: str, body: bytes | None = None,
         timeout_s: float = 5.0) -> tuple[int, bytes]:
    """(status, body) of one request to the broker's HTTP API."""
    req = urllib.request.Request(f"http://{b.http_hostport}{path}", data=body, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def ping(b: BrokerProcess) -> tuple[int, str]:
    status, body = http(b, "GET", "/ping")
    return status, body.decode("utf-8", "replace")


def stats(b: BrokerProcess, topic: str | None = None) -> dict[str, Any]:
    q = "/stats?format=json" + (f"&topic={urllib.parse.quote(topic)}" if topic else "")
    status, body = http(b, "GET", q)
    assert status == 200, body
    doc: dict[str, Any] = json.loads(body)
    return doc


def topic_stats(b: BrokerProcess, topic: str) -> dict[str, Any] | None:
    for t in stats(b, topic).get("topics") or []:
        if t["topic_name"] == topic:
            return t  # type: ignore[no-any-return]
    return None


def channel_stats(b: BrokerProcess, topic: str, channel: str) -> dict[str, Any] | None:
    t = topic_stats(b, topic)
    for c in (t or {}).get("channels") or []:
        if c["channel_name"] == channel:
            return c  # type: ignore[no-any-return]
    return None


def create_channel(b: BrokerProcess, topic: str, channel: str) -> None:
    """Create the topic and the channel over HTTP (as nsqadmin would)."""
    status, body = http(b, "POST", "/topic/create?" + urllib.parse.urlencode({"topic": topic}))
    assert status == 200, body
    q = urllib.parse.urlencode({"topic": topic, "channel": channel})
    status, body = http(b, "POST", f"/channel/create?{q}")
    assert status == 200, body


def http_pub(b: BrokerProcess, topic: str, body: bytes, defer_ms: int | None = None) -> None:
    q = {"topic": topic} | ({"defer": str(defer_ms)} if defer_ms is not None else {})
    status, text = http(b, "POST", "/pub?" + urllib.parse.urlencode(q), body)
    assert status == 200, text


# -- consuming ------------------------------------------------------------------------------


@dataclass
class Received:
    """One delivery as the consumer saw it, with its wall-clock arrival time."""
    msg: Message
    at_wall: float


def consume(b: BrokerProcess, topic: str, channel: str, *, expect: int | None = None,
            idle_s: float = 1.0, timeout_s: float = 20.0, finish: bool = True,
            rdy_count: int = 200) -> list[Received]:
    """Subscribe and collect deliveries (FINing each when ``finish``).

    Stops when ``expect`` deliveries arrived, or (without ``expect``) when nothing
    arrived for ``idle_s``; fails when ``timeout_s`` passes first with ``expect`` set.
    """
    got: list[Received] = []
    deadline = time.monotonic() + timeout_s
    with WireClient.connect(b.tcp_address) as c:  # type: ignore[arg-type]
        c.sub(topic, channel)
        c.rdy(rdy_count)
        while expect is None or len(got) < expect:
            left = deadline - time.monotonic()
            if left <= 0:
                if expect is None:
                    break
                raise AssertionError(f"got {len(got)} of {expect} messages from "
                                     f"{topic}/{channel} within {timeout_s}s")
            wait = left if expect is not None else min(left, idle_s)
            try:
                m = c.read_message(wait)
            except TimeoutError:
                if expect is None:
                    break
                continue
            got.append(Received(m, time.time()))
            if finish:
                c.fin(m.id)
        # a PUB round trip to a throwaway topic: every FIN above has been read
        c.assert_alive()
    return got


def bodies(got: list[Received]) -> list[bytes]:
    return [r.msg.body for r in got]


# -- publishers that record acknowledgements ------------------------------------------------


class _Worker:
    """start()/stop() for the load threads below (each defines ``_run`` and a name)."""

    _stop: threading.Event
    _thread: threading.Thread | None

    def _thread_name(self) -> str:
        return f"worker-{getattr(self, 'prefix', '')}"

    def start(self) -> Self:
        self._thread = threading.Thread(target=self._run, name=self._thread_name(),
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            assert not self._thread.is_alive(), f"{self._thread_name()} did not stop"

    def _run(self) -> None:
        raise NotImplementedError


@dataclass
class Publisher(_Worker):
    """A thread publishing unique bodies on its own raw socket until stopped or until the
    connection breaks; ``acked`` holds every body whose command was answered OK.

    Commands rotate PUB, MPUB of ``batch`` and (when ``defer_ms``) DPUB, one outstanding
    at a time, so an OK acknowledges exactly the bodies of that command.
    """
    address: tuple[str, int]
    topic: str
    prefix: str
    batch: int = 5
    defer_ms: int = 0
    acked: set[bytes] = field(default_factory=set)
    sent: int = 0
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _n: int = 0

    def _thread_name(self) -> str:
        return f"pub-{self.prefix}"

    def _body(self) -> bytes:
        self._n += 1
        return f"{self.prefix}-{self._n:07d}".encode()

    def _run(self) -> None:
        try:
            sock = socket.create_connection(self.address, timeout=5.0)
        except OSError as e:
            self.errors.append(f"connect: {e}")
            return
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        i = 0
        try:
            sock.sendall(MAGIC_V2)
            while not self._stop.is_set():
                kind = i % (3 if self.defer_ms else 2)
                i += 1
                if kind == 0:
                    msgs = [self._body()]
                    data = pub(self.topic, msgs[0])
                elif kind == 1:
                    msgs = [self._body() for _ in range(self.batch)]
                    data = mpub(self.topic, msgs)
                else:
                    msgs = [self._body()]
                    data = dpub(self.topic, self.defer_ms, msgs[0])
                sock.sendall(data)
                self.sent += len(msgs)
                while True:
                    ftype, payload = read_frame(sock, 10.0)
                    if ftype == FRAME_RESPONSE and payload == HEARTBEAT:
                        sock.sendall(nop())
                        continue
                    break
                if ftype == FRAME_RESPONSE and payload == b"OK":
                    self.acked.update(msgs)
                else:
                    self.errors.append(f"{ftype}: {payload[:100]!r}")
                    return
        except (OSError, ConnectionClosed, TimeoutError) as e:
            self.errors.append(f"{type(e).__name__}: {e}")
        finally:
            sock.close()


@dataclass
class HttpPublisher(_Worker):
    """Like Publisher, over HTTP keep-alive: POST /pub and /mpub, one at a time."""
    address: tuple[str, int]
    topic: str
    prefix: str
    batch: int = 5
    acked: set[bytes] = field(default_factory=set)
    sent: int = 0
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _thread_name(self) -> str:
        return f"http-{self.prefix}"

    def _run(self) -> None:
        import http.client

        conn = http.client.HTTPConnection(*self.address, timeout=10)
        q = urllib.parse.quote(self.topic)
        n = 0
        try:
            while not self._stop.is_set():
                count = 1 if n % 2 == 0 else self.batch
                msgs = [f"{self.prefix}-{n + i:07d}".encode() for i in range(count)]
                n += count
                path = f"/pub?topic={q}" if count == 1 else f"/mpub?topic={q}"
                conn.request("POST", path, body=b"\n".join(msgs))
                self.sent += count
                resp = conn.getresponse()
                text = resp.read()
                if resp.status != 200:
                    self.errors.append(f"{resp.status}: {text[:100]!r}")
                    return
                self.acked.update(msgs)
        except (OSError, http.client.HTTPException) as e:
            self.errors.append(f"{type(e).__name__}: {e}")
        finally:
            conn.close()


@dataclass
class FinningConsumer(_Worker):
    """A thread that subscribes and FINs every ``fin_every``-th delivery, leaving the
    others in flight (they come back after msg_timeout or a restart). ``seen`` counts
    every delivered body; it stops when the connection breaks or when stopped."""
    address: tuple[str, int]
    topic: str
    channel: str
    fin_every: int = 2
    rdy_count: int = 50
    seen: dict[bytes, int] = field(default_factory=dict)
    finished: set[bytes] = field(default_factory=set)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    errors: list[str] = field(default_factory=list)

    def _thread_name(self) -> str:
        return "consumer"

    def _run(self) -> None:
        try:
            sock = socket.create_connection(self.address, timeout=5.0)
        except OSError as e:
            self.errors.append(f"connect: {e}")
            return
        frames = FrameBuffer(sock)
        try:
            sock.sendall(MAGIC_V2 + identify(msg_timeout=2000))
            _expect_ok(sock)
            sock.sendall(sub(self.topic, self.channel))
            _expect_ok(sock)
            sock.sendall(rdy(self.rdy_count))
            n = 0
            while not self._stop.is_set():
                for ftype, payload in frames.read(0.2):
                    if ftype == FRAME_RESPONSE and payload == HEARTBEAT:
                        sock.sendall(nop())
                    elif ftype == FRAME_MESSAGE:
                        m = parse_message(payload)
                        self.seen[m.body] = self.seen.get(m.body, 0) + 1
                        n += 1
                        if n % self.fin_every == 0:
                            sock.sendall(fin(m.id))
                            self.finished.add(m.body)
                    elif ftype == FRAME_ERROR:
                        self.errors.append(payload[:100].decode("utf-8", "replace"))
        except (OSError, ConnectionClosed) as e:
            self.errors.append(f"{type(e).__name__}: {e}")
        finally:
            sock.close()


class FrameBuffer:
    """Buffered frame reading that never loses its place when a wait times out."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()

    def read(self, wait_s: float) -> list[tuple[int, bytes]]:
        """Every complete frame available within wait_s (maybe none).

        Raises ConnectionClosed on EOF or reset.
        """
        self.sock.settimeout(wait_s)
        try:
            data = self.sock.recv(1 << 16)
        except TimeoutError:
            data = None
        except (ConnectionResetError, ConnectionAbortedError) as e:
            raise ConnectionClosed(str(e)) from e
        if data is not None:
            if not data:
                raise ConnectionClosed("EOF")
            self.buf += data
        out = []
        while len(self.buf) >= 8:
            size, ftype = struct.unpack_from(">ii", self.buf)
            if len(self.buf) < 4 + size:
                break
            out.append((ftype, bytes(self.buf[8:4 + size])))
            del self.buf[:4 + size]
        return out


def _expect_ok(sock: socket.socket) -> None:
    ftype, payload = read_frame(sock, 5.0)
    assert (ftype, payload) == (FRAME_RESPONSE, b"OK"), (ftype, payload)


# -- segment files (pybroker's documented on-disk format, parsed independently) --------------

SEG_HEADER_LEN = 16      # "PBTLOG", u16 version, u64 base offset
REC_HEADER = struct.Struct(">IIQ")  # crc32, length, log offset


def log_dir(data_path: str | Path, topic: str) -> Path:
    """topics/<topic>: the topic's log segments (``%020d.log``, by base offset)."""
    return Path(data_path) / "topics" / urllib.parse.quote(topic, safe="")


# a record's payload: [int64 deliver_at][int64 ts_ns][uint16 attempts][16-byte id][body]
MSG_RECORD_HEADER = 34


@dataclass(frozen=True)
class SegmentRecord:
    offset: int     # of the record header in the file
    length: int     # header + payload
    seq: int        # the record's log offset
    body: bytes     # the message body inside the payload


def segment_records(path: Path) -> list[SegmentRecord]:
    """Every well-formed record of a segment file, up to the first bad one."""
    raw = path.read_bytes()
    out = []
    off = SEG_HEADER_LEN
    while off + REC_HEADER.size <= len(raw):
        crc, length, seq = REC_HEADER.unpack_from(raw, off)
        end = off + REC_HEADER.size + length
        if end > len(raw) or zlib.crc32(raw[off + 4:end]) != crc:
            break
        body = raw[off + REC_HEADER.size + MSG_RECORD_HEADER:end]
        out.append(SegmentRecord(off, end - off, seq, body))
        off = end
    return out


def flip_bytes(path: Path, offset: int, n: int = 4) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        data = bytearray(f.read(n))
        f.seek(offset)
        f.write(bytes(x ^ 0xFF for x in data))
        f.flush()
        os.fsync(f.fileno())
