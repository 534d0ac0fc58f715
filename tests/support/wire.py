"""Independent mini codec for NSQ TCP protocol V2, for integration tests.

Written from the protocol spec alone: it never imports pybroker.protocol or
pybroker._native, so a codec bug in the server cannot cancel itself out here.
Owns: command encoding, frame reading with a deadline, message parsing and a tiny
blocking ``WireClient`` that checks responses, error codes and fatality.
"""
from __future__ import annotations

import json
import socket
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Self

MAGIC_V2 = b"  V2"
FRAME_RESPONSE = 0
FRAME_ERROR = 1
FRAME_MESSAGE = 2
HEARTBEAT = b"_heartbeat_"
MSG_HEADER_LEN = 26  # int64 ts_ns + uint16 attempts + 16-byte id

# As in nsqd: only these three leave the connection open.
NON_FATAL_CODES = frozenset({b"E_FIN_FAILED", b"E_REQ_FAILED", b"E_TOUCH_FAILED"})
# A throwaway topic for "is the connection still usable" round trips; ephemeral so
# nothing is persisted, and it never gets a channel.
PROBE_TOPIC = "wire_probe#ephemeral"


class ConnectionClosed(Exception):
    """The peer closed (EOF or reset) while a frame was expected."""


# -- encoding ----------------------------------------------------------------------------
def _b(x: bytes | str | int) -> bytes:
    if isinstance(x, bytes):
        return x
    return str(x).encode()


def sized(body: bytes) -> bytes:
    """A body as it follows IDENTIFY/PUB/DPUB/MPUB: int32 BE size, then the bytes."""
    return struct.pack(">i", len(body)) + body


def command(name: bytes | str, *params: bytes | str | int, body: bytes | None = None,
            eol: bytes = b"\n") -> bytes:
    """One command line (params joined by single spaces), plus a sized body if given."""
    line = b" ".join([_b(name), *(_b(p) for p in params)]) + eol
    return line if body is None else line + sized(body)


def identify(**fields: Any) -> bytes:
    return command("IDENTIFY", body=json.dumps(fields).encode())


def sub(topic: str, channel: str) -> bytes:
    return command("SUB", topic, channel)


def pub(topic: str, body: bytes) -> bytes:
    return command("PUB", topic, body=body)


def mpub_body(bodies: Iterable[bytes]) -> bytes:
    parts = list(bodies)
    return struct.pack(">i", len(parts)) + b"".join(sized(p) for p in parts)


def mpub(topic: str, bodies: Iterable[bytes]) -> bytes:
    return command("MPUB", topic, body=mpub_body(bodies))


def dpub(topic: str, delay_ms: int, body: bytes) -> bytes:
    return command("DPUB", topic, delay_ms, body=body)


def rdy(count: int | None = None) -> bytes:
    return command("RDY") if count is None else command("RDY", count)


def fin(msg_id: bytes) -> bytes:
    return command("FIN", msg_id)


def req(msg_id: bytes, timeout_ms: int = 0) -> bytes:
    return command("REQ", msg_id, timeout_ms)


def touch(msg_id: bytes) -> bytes:
    return command("TOUCH", msg_id)


def cls() -> bytes:
    return command("CLS")


def nop() -> bytes:
    return command("NOP")


def encode_frame(frame_type: int, data: bytes) -> bytes:
    """A server frame: int32 size (= len(data) + 4), int32 type, data."""
    return struct.pack(">ii", len(data) + 4, frame_type) + data


# -- decoding ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Message:
    ts_ns: int
    attempts: int
    id: bytes
    body: bytes


def parse_message(data: bytes) -> Message:
    if len(data) < MSG_HEADER_LEN:
        raise ValueError(f"message frame too short: {len(data)} bytes")
    ts_ns, attempts = struct.unpack(">qH", data[:10])
    return Message(ts_ns, attempts, bytes(data[10:26]), bytes(data[26:]))


def _recv_exact(sock: socket.socket, n: int, deadline: float, some: bool = False) -> bytes:
    """n bytes by deadline (``some``: at least one, at most n)."""
    chunks: list[bytes] = []
    while n > 0 and not (some and chunks):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed while reading a frame")
        sock.settimeout(left)
        try:
            chunk = sock.recv(n)
        except TimeoutError as exc:
            raise TimeoutError("deadline passed while reading a frame") from exc
        except (ConnectionResetError, ConnectionAbortedError) as exc:
            raise ConnectionClosed(str(exc)) from exc
        if not chunk:
            raise ConnectionClosed("EOF")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def read_frame(sock: socket.socket, timeout: float = 5.0) -> tuple[int, bytes]:
    """Read one frame within ``timeout`` seconds.

    Raises TimeoutError when none arrives in time (the stream is then unusable if a
    frame was half read) and ConnectionClosed on EOF or reset.
    """
    deadline = time.monotonic() + timeout
    size, = struct.unpack(">i", _recv_exact(sock, 4, deadline))
    assert size >= 4, f"frame size {size} < 4"
    payload = _recv_exact(sock, size, deadline)
    frame_type, = struct.unpack(">i", payload[:4])
    return frame_type, payload[4:]


def wait_closed(sock: socket.socket, timeout: float = 5.0) -> None:
    """Assert the peer closes within ``timeout`` without sending any further bytes."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"connection still open after {timeout}s")
        sock.settimeout(left)
        try:
            data = sock.recv(65536)
        except TimeoutError:
            continue
        except (ConnectionResetError, ConnectionAbortedError):
            return
        if not data:
            return
        raise AssertionError(f"expected close, got bytes {data[:200]!r}")


# -- blocking client ---------------------------------------------------------------------
@dataclass
class WireClient:
    """A blocking V2 connection for tests. Not thread-safe; one per thread.

    Heartbeat frames are never returned as responses: they are counted (with their
    arrival times) and, when ``answer_heartbeats`` is true, answered with NOP.
    Message frames that arrive while a response is awaited are kept in ``pending``
    and handed out first by read_message().
    """

    sock: socket.socket
    answer_heartbeats: bool = True
    timeout: float = 5.0
    heartbeats: list[float] = field(default_factory=list)
    pending: list[Message] = field(default_factory=list)
    # the bytes of a frame read so far: a read that times out halfway keeps them for
    # the next (a timeout between two chunks of one frame does not lose the stream)
    partial: bytearray = field(default_factory=bytearray)

    @classmethod
    def connect(cls, address: tuple[str, int], magic: bool = True,
                **kw: Any) -> WireClient:
        sock = socket.create_connection(address, timeout=5.0)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        client = cls(sock, **kw)
        if magic:
            client.send(MAGIC_V2)
        return client

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def send(self, data: bytes) -> None:
        self.sock.settimeout(self.timeout)
        self.sock.sendall(data)

    # -- frames --
    def read_frame(self, timeout: float | None = None) -> tuple[int, bytes]:
        """Next frame that is not a heartbeat."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            ftype, data = self._frame(deadline)
            if ftype == FRAME_RESPONSE and data == HEARTBEAT:
                self.heartbeats.append(time.monotonic())
                if self.answer_heartbeats:
                    self.send(nop())
                continue
            return ftype, data

    def _frame(self, deadline: float) -> tuple[int, bytes]:
        """One frame by ``deadline`` (TimeoutError otherwise, keeping what was read: the
        next call goes on from there); it reads no byte past the frame."""
        buf = self.partial
        while True:
            need = 4
            if len(buf) >= 4:
                size, = struct.unpack_from(">i", buf, 0)
                assert size >= 4, f"frame size {size} < 4"
                need = 4 + size
                if len(buf) >= need:
                    frame_type, = struct.unpack_from(">i", buf, 4)
                    data = bytes(buf[8:need])
                    del buf[:need]
                    return frame_type, data
            buf += _recv_exact(self.sock, need - len(buf), deadline, some=True)

    def _read_non_message(self, timeout: float | None) -> tuple[int, bytes]:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            ftype, data = self.read_frame(max(0.0, deadline - time.monotonic()))
            if ftype == FRAME_MESSAGE:
                self.pending.append(parse_message(data))
                continue
            return ftype, data

    def expect_response(self, expected: bytes | None = b"OK",
                        timeout: float | None = None) -> bytes:
        """Read the next response frame; assert its data equals ``expected`` if given."""
        ftype, data = self._read_non_message(timeout)
        assert ftype == FRAME_RESPONSE, f"expected response {expected!r}, got frame " \
                                        f"type {ftype}: {data!r}"
        if expected is not None:
            assert data == expected, f"expected {expected!r}, got {data!r}"
        return data

    def expect_error(self, code: bytes | str, prefix: bytes | str | None = None,
                     fatal: bool | None = None, timeout: float | None = None) -> bytes:
        """Read an error frame; assert its exact code, optional text prefix, and fatality.

        Fatal (every code but E_FIN/REQ/TOUCH_FAILED, unless ``fatal`` says otherwise):
        the server must then close the connection without sending anything else.
        Non-fatal: the connection must still answer a PUB round trip.
        Returns the whole error data ("CODE description").
        """
        code_b = _b(code)
        ftype, data = self._read_non_message(timeout)
        assert ftype == FRAME_ERROR, f"expected error {code_b!r}, got frame type " \
                                     f"{ftype}: {data!r}"
        got_code = data.split(b" ", 1)[0]
        assert got_code == code_b, f"expected error code {code_b!r}, got {data!r}"
        if prefix is not None:
            assert data.startswith(_b(prefix)), f"expected prefix {_b(prefix)!r}, got {data!r}"
        if fatal is None:
            fatal = code_b not in NON_FATAL_CODES
        if fatal:
            self.assert_closed()
        else:
            self.assert_alive()
        return data

    def assert_closed(self, timeout: float = 5.0) -> None:
        assert not self.partial, f"a frame begun before the close: {bytes(self.partial)!r}"
        wait_closed(self.sock, timeout)

    def assert_alive(self) -> None:
        """Round trip a PUB to a throwaway ephemeral topic and expect OK."""
        self.pub(PROBE_TOPIC, b"probe")

    # -- commands --
    def identify(self, **fields: Any) -> dict[str, Any] | None:
        """IDENTIFY; returns the negotiated JSON when feature_negotiation, else None."""
        self.send(identify(**fields))
        if fields.get("feature_negotiation"):
            data = self.expect_response(None)
            result: dict[str, Any] = json.loads(data)
            return result
        self.expect_response(b"OK")
        return None

    def sub(self, topic: str, channel: str) -> None:
        self.send(sub(topic, channel))
        self.expect_response(b"OK")

    def rdy(self, count: int | None = None) -> None:
        self.send(rdy(count))

    def pub(self, topic: str, body: bytes) -> None:
        self.send(pub(topic, body))
        self.expect_response(b"OK")

    def mpub(self, topic: str, bodies: Iterable[bytes]) -> None:
        self.send(mpub(topic, bodies))
        self.expect_response(b"OK")

    def dpub(self, topic: str, delay_ms: int, body: bytes) -> None:
        self.send(dpub(topic, delay_ms, body))
        self.expect_response(b"OK")

    def fin(self, msg_id: bytes) -> None:
        self.send(fin(msg_id))

    def req(self, msg_id: bytes, timeout_ms: int = 0) -> None:
        self.send(req(msg_id, timeout_ms))

    def touch(self, msg_id: bytes) -> None:
        self.send(touch(msg_id))

    def cls(self) -> None:
        self.send(cls())
        self.expect_response(b"CLOSE_WAIT")

    def nop(self) -> None:
        self.send(nop())

    def read_message(self, timeout: float | None = None) -> Message:
        """The next message frame; any other non-heartbeat frame fails the test."""
        if self.pending:
            return self.pending.pop(0)
        ftype, data = self.read_frame(timeout)
        assert ftype == FRAME_MESSAGE, f"expected a message, got frame type {ftype}: " \
                                       f"{data!r}"
        return parse_message(data)

    def read_messages(self, n: int, timeout: float | None = None) -> list[Message]:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        return [self.read_message(max(0.0, deadline - time.monotonic())) for _ in range(n)]

    def expect_nothing(self, within: float) -> None:
        """Assert no frame other than heartbeats arrives for ``within`` seconds."""
        assert not self.pending, f"unexpected messages {self.pending!r}"
        deadline = time.monotonic() + within
        while (left := deadline - time.monotonic()) > 0:
            try:
                ftype, data = self.read_frame(left)
            except TimeoutError:
                return
            raise AssertionError(f"expected silence, got frame type {ftype}: {data[:200]!r}")


def subscribe(client: WireClient, topic: str, channel: str = "ch", rdy: int = 0,
              **identify_fields: Any) -> WireClient:
    """IDENTIFY (if fields are given), SUB and RDY (if > 0) on ``client``; returns it."""
    if identify_fields:
        client.identify(**identify_fields)
    client.sub(topic, channel)
    if rdy:
        client.rdy(rdy)
    return client


def publish(address: tuple[str, int], topic: str, bodies: Iterable[bytes]) -> None:
    """PUB each body on a fresh connection, expecting OK for each."""
    with WireClient.connect(address) as client:
        for body in bodies:
            client.pub(topic, body)
