"""A minimal blocking NSQ V2 client on a raw socket, built for load generation.

Owns command encoding and frame parsing for the bench and the Locust users; it uses the
standard library only (no pybroker.protocol, no pybroker.client), so a bug in the broker's
codec or in the client library cannot hide behind the instrument that measures it.
Everything here is synchronous and single-threaded: one ``NsqConn`` per process (or per
greenlet under Locust, whose monkey-patched sockets make the blocking calls cooperative).
"""
from __future__ import annotations

import json
import socket
import struct
import time
from collections.abc import Callable, Iterable
from typing import Self

MAGIC_V2 = b"  V2"
FRAME_RESPONSE, FRAME_ERROR, FRAME_MESSAGE = 0, 1, 2
HEARTBEAT = b"_heartbeat_"
OK = b"OK"
NOP = b"NOP\n"
# a message frame's data: ts(8) attempts(2) id(16) body; offsets from the frame start
MSG_ID_START, MSG_ID_END, MSG_BODY_START = 18, 34, 34
# one read, into a buffer the connection keeps (docs/io.md): a fresh object of
# this size per recv would be an mmap and a munmap each time, in the load generator
RECV_SIZE = 256 * 1024

_u32 = struct.Struct(">I")
_frame_head = struct.Struct(">ii")
_q = struct.Struct(">q")


class NsqError(Exception):
    """The broker answered with an error frame (``E_*``) or broke the protocol."""


# -- command encoding ------------------------------------------------------------------------

def identify_cmd(**fields: str | int | bool) -> bytes:
    body = json.dumps(fields).encode()
    return b"IDENTIFY\n" + _u32.pack(len(body)) + body


def sub_cmd(topic: str, channel: str) -> bytes:
    return b"SUB %s %s\n" % (topic.encode(), channel.encode())


def rdy_cmd(count: int) -> bytes:
    return b"RDY %d\n" % count


def pub_cmd(topic: str, body: bytes) -> bytes:
    return b"PUB %s\n" % topic.encode() + _u32.pack(len(body)) + body


def mpub_cmd(topic: str, bodies: Iterable[bytes]) -> bytes:
    parts = [_u32.pack(len(b)) + b for b in bodies]
    payload = _u32.pack(len(parts)) + b"".join(parts)
    return b"MPUB %s\n" % topic.encode() + _u32.pack(len(payload)) + payload


def publish_cmd(topic: str, bodies: list[bytes]) -> bytes:
    """PUB for one body, MPUB for several: what a batch of ``len(bodies)`` costs."""
    return pub_cmd(topic, bodies[0]) if len(bodies) == 1 else mpub_cmd(topic, bodies)


def fin_cmds(ids: list[bytes]) -> bytes:
    """FIN for every id, as one buffer (one send for a whole read's worth)."""
    if not ids:
        return b""
    return b"FIN " + b"\nFIN ".join(ids) + b"\n"


def stamped_body(size: int, now_ns: int) -> bytes:
    """A body of ``size`` bytes (at least 8) opening with ``now_ns`` (big-endian int64)."""
    return _q.pack(now_ns) + b"x" * max(0, size - 8)


def body_stamp(frame: bytes | bytearray | memoryview, frame_start: int) -> int:
    """The int64 that ``stamped_body`` put at the start of a message frame's body."""
    return int(_q.unpack_from(frame, frame_start + MSG_BODY_START)[0])


# -- the connection --------------------------------------------------------------------------

class NsqConn:
    """One blocking TCP connection to nsqd or pybroker.

    ``buf`` holds received bytes not yet parsed; ``read_frames`` and ``scan`` consume it.
    Heartbeats are answered with NOP wherever frames are read.
    """

    def __init__(self, address: str, timeout_s: float = 10.0,
                 client_id: str = "bench", **identify: str | int | bool) -> None:
        host, _, port = address.rpartition(":")
        self.sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._timeout: float | None = timeout_s
        self.buf = b""
        self._rbuf = memoryview(bytearray(RECV_SIZE))
        fields: dict[str, str | int | bool] = {
            "client_id": client_id, "hostname": client_id,
            "user_agent": "pybroker-bench/1.0", "feature_negotiation": False}
        fields.update(identify)
        self.sock.sendall(MAGIC_V2 + identify_cmd(**fields))
        self.expect_ok("IDENTIFY")

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reading -------------------------------------------------------------------------
    def _fill(self, flags: int = 0) -> None:
        """One read into the kept buffer; what arrived is appended to ``buf``."""
        n = self.sock.recv_into(self._rbuf, 0, flags)
        if not n:
            raise NsqError("connection closed by the broker")
        data = self._rbuf[:n]
        self.buf = self.buf + data if self.buf else bytes(data)

    def read_frame(self) -> tuple[int, bytes]:
        """The next frame that is not a heartbeat (answered with NOP), blocking."""
        while True:
            buf = self.buf
            if len(buf) >= 8:
                size, ftype = _frame_head.unpack_from(buf, 0)
                end = 4 + size
                if len(buf) >= end:
                    data = buf[8:end]
                    self.buf = buf[end:]
                    if ftype == FRAME_RESPONSE and data == HEARTBEAT:
                        self.sock.sendall(NOP)
                        continue
                    return ftype, data
            self._fill()

    def expect_ok(self, what: str) -> None:
        ftype, data = self.read_frame()
        if ftype != FRAME_RESPONSE or data != OK:
            raise NsqError(f"{what}: {data[:200]!r}")

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def request(self, cmd: bytes, what: str = "command") -> None:
        """Send a command that the broker answers with OK, and wait for the OK."""
        self.sock.sendall(cmd)
        self.expect_ok(what)

    def subscribe(self, topic: str, channel: str) -> None:
        self.request(sub_cmd(topic, channel), "SUB")

    def scan(self, on_message: Callable[[bytes, int], None] | None = None) -> tuple[list[bytes], int]:
        """Parse every complete frame in ``buf``.

        Returns the message ids seen and the count of OK responses. Heartbeats get a NOP;
        an error frame raises ``NsqError``. ``on_message(buf, frame_start)`` is called for
        each message frame, before ``buf`` is trimmed.
        """
        buf = self.buf
        n = len(buf)
        pos = 0
        ids: list[bytes] = []
        oks = 0
        unpack = _frame_head.unpack_from
        while n - pos >= 8:
            size, ftype = unpack(buf, pos)
            end = pos + 4 + size
            if end > n:
                break
            if ftype == FRAME_MESSAGE:
                ids.append(buf[pos + MSG_ID_START:pos + MSG_ID_END])
                if on_message is not None:
                    on_message(buf, pos)
            elif ftype == FRAME_RESPONSE:
                if buf[pos + 8:end] == HEARTBEAT:
                    self.sock.sendall(NOP)
                else:
                    oks += 1
            else:
                raise NsqError(buf[pos + 8:end][:200].decode("utf-8", "replace"))
            pos = end
        self.buf = buf[pos:] if pos < n else b""
        return ids, oks

    def set_timeout(self, timeout_s: float | None) -> None:
        """The socket's timeout (None: blocking), changed only when it differs."""
        if timeout_s != self._timeout:
            self.sock.settimeout(timeout_s)
            self._timeout = timeout_s

    def recv_some(self, timeout_s: float | None) -> bool:
        """Receive once into ``buf``; False on timeout. Raises NsqError on close."""
        self.set_timeout(timeout_s)
        try:
            self._fill()
        except TimeoutError:
            return False
        return True

    def recv_nowait(self) -> bool:
        """Receive whatever has arrived without blocking; False when nothing had."""
        # a socket with a timeout would wait for readiness first: use blocking mode plus
        # MSG_DONTWAIT, which leaves later sends blocking as well
        self.set_timeout(None)
        try:
            self._fill(socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return False
        return True


def wait_listening(address: str, timeout_s: float = 10.0) -> None:
    """Poll until ``address`` accepts a TCP connection (for brokers given by address)."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
