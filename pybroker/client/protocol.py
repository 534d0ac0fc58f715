"""The client side of NSQ's TCP protocol V2, sans-IO: commands to bytes, bytes to frames.

This module owns no socket, thread or clock. It is written independently of the
server's codec (``pybroker.protocol``) so that a bug in one cannot hide in the other.
"""
from __future__ import annotations

import enum
import json
import re
import struct
from dataclasses import dataclass
from typing import Iterable, NamedTuple

MAGIC_V2 = b"  V2"
HEARTBEAT = b"_heartbeat_"
OK = b"OK"
CLOSE_WAIT = b"CLOSE_WAIT"
MSG_ID_LENGTH = 16
MESSAGE_HEADER_LENGTH = 8 + 2 + MSG_ID_LENGTH

_NAME_RE = re.compile(r"^[.a-zA-Z0-9_-]+(#ephemeral)?$")
_SIZE = struct.Struct(">l")
_FRAME_HEADER = struct.Struct(">ll")
_MESSAGE_HEADER = struct.Struct(">qH")


class FrameType(enum.IntEnum):
    """The frame types a server sends."""

    RESPONSE = 0
    ERROR = 1
    MESSAGE = 2


_FRAME_TYPES = {int(t): t for t in FrameType}


def is_valid_topic_name(name: str) -> bool:
    """nsqd's rule: 1..64 characters of ``[.a-zA-Z0-9_-]``, optionally ``#ephemeral``."""
    return 0 < len(name) <= 64 and _NAME_RE.match(name) is not None


is_valid_channel_name = is_valid_topic_name


# -- commands ------------------------------------------------------------------------
def _with_body(line: bytes, body: bytes) -> bytes:
    return line + _SIZE.pack(len(body)) + body


def identify(data: dict[str, object]) -> bytes:
    """``IDENTIFY`` with a JSON body."""
    return _with_body(b"IDENTIFY\n", json.dumps(data, separators=(",", ":")).encode())


def auth(secret: bytes | str) -> bytes:
    raw = secret.encode() if isinstance(secret, str) else secret
    return _with_body(b"AUTH\n", raw)


def sub(topic: str, channel: str) -> bytes:
    return b"SUB %s %s\n" % (topic.encode(), channel.encode())


def pub(topic: str, body: bytes) -> bytes:
    return _with_body(b"PUB %s\n" % topic.encode(), body)


def mpub(topic: str, bodies: Iterable[bytes]) -> bytes:
    """``MPUB``: ``[int32 body size][int32 count]([int32 size][data])*``."""
    parts = list(bodies)
    payload = bytearray(_SIZE.pack(len(parts)))
    for body in parts:
        payload += _SIZE.pack(len(body))
        payload += body
    return _with_body(b"MPUB %s\n" % topic.encode(), bytes(payload))


def dpub(topic: str, delay_ms: int, body: bytes) -> bytes:
    return _with_body(b"DPUB %s %d\n" % (topic.encode(), delay_ms), body)


def rdy(count: int) -> bytes:
    return b"RDY %d\n" % count


def fin(msg_id: bytes) -> bytes:
    return b"FIN " + msg_id + b"\n"


def req(msg_id: bytes, delay_ms: int) -> bytes:
    return b"REQ %s %d\n" % (msg_id, delay_ms)


def touch(msg_id: bytes) -> bytes:
    return b"TOUCH " + msg_id + b"\n"


def cls() -> bytes:
    return b"CLS\n"


def nop() -> bytes:
    return b"NOP\n"


@dataclass(frozen=True, slots=True)
class IdentifyResponse:
    """What the server granted in its IDENTIFY answer (feature negotiation)."""

    max_rdy_count: int = 2500
    msg_timeout_ms: int = 60000
    auth_required: bool = False
    version: str = ""
    tls_v1: bool = False
    snappy: bool = False
    deflate: bool = False
    deflate_level: int = 6
    raw: dict[str, object] | None = None


def parse_identify_response(payload: bytes) -> IdentifyResponse:
    """The JSON answer to IDENTIFY; a plain ``OK`` (old servers) gives the defaults.

    Raises:
        ValueError: the payload is neither ``OK`` nor a JSON object.
    """
    if not payload.startswith(b"{"):
        return IdentifyResponse()
    raw = json.loads(payload)
    if not isinstance(raw, dict):
        raise ValueError("IDENTIFY response is not a JSON object")
    return IdentifyResponse(
        max_rdy_count=int(raw.get("max_rdy_count", 2500)),
        msg_timeout_ms=int(raw.get("msg_timeout", 60000)),
        auth_required=bool(raw.get("auth_required", False)),
        version=str(raw.get("version", "")), tls_v1=bool(raw.get("tls_v1", False)),
        snappy=bool(raw.get("snappy", False)), deflate=bool(raw.get("deflate", False)),
        deflate_level=int(raw.get("deflate_level", 6)), raw=raw)


# -- frames --------------------------------------------------------------------------
class FrameError(Exception):
    """The server sent bytes that can never form a valid frame."""


class RawMessage(NamedTuple):
    """A decoded message frame (before it is bound to a connection). A named tuple: it
    is built once per message on the IO loop, at a third of a frozen dataclass's cost."""

    timestamp: int
    attempts: int
    id: bytes
    body: bytes


def decode_message(data: bytes) -> RawMessage:
    """Split a message frame's data: ``[int64 ts][uint16 attempts][16-byte id][body]``."""
    if len(data) < MESSAGE_HEADER_LENGTH:
        raise FrameError(f"message frame of {len(data)} bytes is shorter than its header")
    ts, attempts = _MESSAGE_HEADER.unpack_from(data)
    return RawMessage(ts, attempts, bytes(data[10:MESSAGE_HEADER_LENGTH]),
                      bytes(data[MESSAGE_HEADER_LENGTH:]))


class FrameReader:
    """Incremental frame parser: ``feed()`` bytes, then pull frames with ``next_frame()``.

    A frame is ``[int32 size][int32 type][data]`` with ``size = len(data) + 4``.
    """

    def __init__(self, max_frame_size: int = 64 << 20) -> None:
        self._buf = bytearray()
        self._pos = 0
        self._max = max_frame_size

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Append data (copied: the caller may reuse its buffer)."""
        self._buf += data

    def next_frame(self) -> tuple[FrameType, bytes] | None:
        """The next complete frame, or None when more bytes are needed.

        Raises:
            FrameError: on a size below 4, above the limit, or an unknown frame type.
        """
        buf, pos = self._buf, self._pos
        if len(buf) - pos < 8:
            self._compact()
            return None
        size, ftype = _FRAME_HEADER.unpack_from(buf, pos)
        if size < 4 or size > self._max:
            raise FrameError(f"invalid frame size {size}")
        end = pos + 4 + size
        if len(buf) < end:
            self._compact()
            return None
        kind = _FRAME_TYPES.get(ftype)     # a dict: FrameType(n) costs ten times more
        if kind is None:
            raise FrameError(f"unknown frame type {ftype}")
        data = bytes(buf[pos + 8:end])
        self._pos = end
        return kind, data

    def take_buffered(self) -> bytes:
        """Every byte fed and not yet returned as a frame (they belong to a new layer:
        nsqd sends the compressed OK right after its IDENTIFY answer)."""
        rest = bytes(self._buf[self._pos:])
        self._buf.clear()
        self._pos = 0
        return rest

    def _compact(self) -> None:
        if self._pos:
            del self._buf[:self._pos]
            self._pos = 0

    def pending(self) -> int:
        """Bytes buffered but not yet returned as frames."""
        return len(self._buf) - self._pos
