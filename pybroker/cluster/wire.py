"""The replication connection's framing (sans-IO): a frame is ``[u32 size][u32 head
size][head: JSON object][blob]``, size counting everything after itself. The head says
what the frame is; the blob carries records (raw log bytes, referenced from the head
as ``[position, length]``). No NSQ client ever speaks this: it is served on the
cluster address only.

Budgets: a frame over ``MAX_FRAME`` bytes, a head over ``MAX_HEAD`` or a head that is
not a JSON object is a protocol error (the connection is dropped); a reader holds at
most one frame plus one read; a request names at most ``MAX_TOPICS`` topics. The
readers of an answer's parts (``blob_span``, ``history_of``) raise ValueError on
anything malformed or outside the frame.
"""
from __future__ import annotations

import json
import struct
from typing import Union
from pybroker.cluster.ports import Json, JsonObj, need_int

MAX_FRAME = 64 * 1024 * 1024
MAX_HEAD = 4 * 1024 * 1024
# topics one request may name (a request is served on an event loop: about 10 us each)
MAX_TOPICS = 1000
_HDR = struct.Struct(">II")
_ENCODER = json.JSONEncoder(separators=(",", ":"))   # built once, not per frame


class WireError(Exception):
    """A peer sent something that is not a frame of this protocol."""


Buffer = Union[bytes, bytearray, memoryview]


def encode(head: JsonObj, *blobs: Buffer) -> list[Buffer]:
    """One frame as buffers for sendmsg; the blob is the blobs one after another (they
    are not copied: each must stay unchanged until sent)."""
    h = _ENCODER.encode(head).encode()
    size = sum(len(b) for b in blobs)
    if len(h) > MAX_HEAD or 4 + len(h) + size > MAX_FRAME:
        raise WireError(f"frame too large ({len(h)} + {size} bytes)")
    return [_HDR.pack(4 + len(h) + size, len(h)) + h, *(b for b in blobs if len(b))]


def parse_header(hdr: bytes | bytearray, max_frame: int = MAX_FRAME) -> tuple[int, int]:
    """(size, head size) of a frame's 8-byte header; WireError past the limits."""
    size, hlen = _HDR.unpack_from(hdr, 0)
    if size > max_frame or hlen > MAX_HEAD or hlen + 4 > size:
        raise WireError(f"bad frame header (size {size}, head {hlen})")
    return int(size), int(hlen)


def parse_head(raw: bytes | bytearray | memoryview) -> JsonObj:
    """A frame's head: a JSON object, else WireError."""
    try:
        head: object = json.loads(bytes(raw).decode("utf-8"))
    except ValueError:
        raise WireError("frame head is not JSON") from None
    if not isinstance(head, dict):
        raise WireError("frame head is not a JSON object")
    return head


class FrameReader:
    """Bytes in, (head, blob) frames out; a frame over ``max_frame`` is refused from
    its header (a request reader takes a small one: requests are small)."""

    __slots__ = ("_buf", "max_frame")

    def __init__(self, max_frame: int = MAX_FRAME) -> None:
        self._buf = bytearray()
        self.max_frame = max_frame

    def feed(self, data: bytes | memoryview) -> None:
        self._buf += data

    def pending(self) -> int:
        return len(self._buf)

    def next(self) -> tuple[JsonObj, memoryview] | None:
        buf = self._buf
        if len(buf) < 8:
            return None
        size, hlen = parse_header(buf, self.max_frame)
        if len(buf) < 4 + size:
            return None
        head = parse_head(buf[8:8 + hlen])
        blob = memoryview(bytes(buf[8 + hlen:4 + size]))
        del buf[:4 + size]
        return head, blob


def history_of(v: Json) -> list[list[int]]:
    """An epoch history a leader sent: [[epoch, start], ...] (ValueError otherwise)."""
    if not isinstance(v, list):
        raise ValueError("the epoch history is not a list")
    out = []
    for pair in v:
        if not isinstance(pair, list) or len(pair) != 2:
            raise ValueError("an epoch history entry is not [epoch, start]")
        out.append([need_int(pair[0]), need_int(pair[1])])
    return out


def blob_span(blob: memoryview, span: Json) -> bytes:
    """The records an answer's ``blob: [at, length]`` names (ValueError if outside)."""
    if span is None:
        return b""
    if not isinstance(span, list) or len(span) != 2:
        raise ValueError("a blob span is not [at, length]")
    at, n = need_int(span[0]), need_int(span[1])
    if at < 0 or n < 0 or at + n > len(blob):
        raise ValueError(f"a blob span [{at}, {n}] outside the frame")
    return bytes(blob[at:at + n])



def frame_need(buf: bytes | bytearray) -> int:
    """Bytes still missing for the first frame of buf (0: complete or unknown yet)."""
    if len(buf) < 8:
        return 8 - len(buf)
    size = int(_HDR.unpack_from(buf, 0)[0])
    return max(0, 4 + size - len(buf))


__all__ = ["MAX_FRAME", "MAX_TOPICS", "Buffer", "FrameReader", "WireError", "blob_span",
           "encode", "frame_need", "history_of", "parse_head", "parse_header"]
