"""The replication connection's framing (sans-IO): a frame is ``[u32 size][u32 head
size][head][blob]``, size counting everything after itself. The head says what the
frame is; the blob carries records (raw log bytes, referenced from the head as
``[position, length]``). No NSQ client ever speaks this: it is served on the cluster
address only.

A head is a JSON object, or, in the steady state of a fetch, a compact head (its first
byte is not ``{``; big-endian, no JSON to build or parse on either side):
- ``COMPACT_FETCH`` ``[u8 1][i32 node][u32 wait_ms][u32 max_bytes][u16 n][u64 offset]*n``:
  the same fetch as the last JSON one on this connection (its n topics, epochs,
  versions and history marks), with new offsets; a follower sends it only once the
  leader's JSON answers said ``"compact": 1``;
- ``COMPACT_ANSWER`` ``[u8 2][u16 n][u64 first][u64 hw][u32 bytes]*n``: per topic of that
  fetch, in its order, the first offset and the high watermark, and the records' bytes,
  which lie in the blob one topic after the other; a leader sends it to a compact fetch
  only when no topic's answer carries more (an error, a history, channel states).

Budgets: a frame over ``MAX_FRAME`` bytes, a head over ``MAX_HEAD`` or a head that is
not a JSON object is a protocol error (the connection is dropped); a reader holds at
most one frame plus one read; a request names at most ``MAX_TOPICS`` topics. A compact
head must be exactly the size its count says, its count at most ``MAX_TOPICS``, and a
compact answer's record sizes must add up to its blob (WireError otherwise), so it is
parsed in time linear in its few bytes and allocates one tuple per topic. The
readers of an answer's parts (``blob_span``, ``history_of``) raise ValueError on
anything malformed or outside the frame.
"""
from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from typing import Union
from pybroker.cluster.ports import Json, JsonObj, need_int

MAX_FRAME = 64 * 1024 * 1024
MAX_HEAD = 4 * 1024 * 1024
# topics one request may name (a request is served on an event loop: about 10 us each)
MAX_TOPICS = 1000
_HDR = struct.Struct(">II")
_ENCODER = json.JSONEncoder(separators=(",", ":"))   # built once, not per frame
COMPACT_FETCH = 1
COMPACT_ANSWER = 2
_FETCH = struct.Struct(">BiIIH")
_ANSWER = struct.Struct(">BH")
_ENTRY = struct.Struct(">QQI")
_JSON_HEAD = ord("{")


class WireError(Exception):
    """A peer sent something that is not a frame of this protocol."""


Buffer = Union[bytes, bytearray, memoryview]


def encode(head: JsonObj, *blobs: Buffer) -> list[Buffer]:
    """One frame as buffers for sendmsg; the blob is the blobs one after another (they
    are not copied: each must stay unchanged until sent)."""
    return _frame(_ENCODER.encode(head).encode(), blobs)


def _frame(h: bytes, blobs: Sequence[Buffer]) -> list[Buffer]:
    size = sum(len(b) for b in blobs)
    if len(h) > MAX_HEAD or 4 + len(h) + size > MAX_FRAME:
        raise WireError(f"frame too large ({len(h)} + {size} bytes)")
    return [_HDR.pack(4 + len(h) + size, len(h)) + h, *(b for b in blobs if len(b))]


def is_json(raw: bytes | bytearray | memoryview) -> bool:
    """A head that is JSON (else a compact one)."""
    return len(raw) > 0 and raw[0] == _JSON_HEAD


def encode_compact_fetch(node: int, wait_ms: int, max_bytes: int,
                         offsets: Sequence[int]) -> list[Buffer]:
    n = len(offsets)
    return _frame(_FETCH.pack(COMPACT_FETCH, node, wait_ms, max_bytes, n)
                  + struct.pack(f">{n}Q", *offsets), ())


def parse_compact_fetch(raw: bytes | bytearray | memoryview
                        ) -> tuple[int, int, int, list[int]]:
    """(node, wait_ms, max_bytes, offsets) of a COMPACT_FETCH head, else WireError."""
    if len(raw) < _FETCH.size:
        raise WireError("a compact head too short")
    tag, node, wait_ms, max_bytes, n = _FETCH.unpack_from(raw, 0)
    if tag != COMPACT_FETCH:
        raise WireError(f"a compact head of kind {tag} where a request was due")
    if n > MAX_TOPICS or len(raw) != _FETCH.size + 8 * n:
        raise WireError(f"a compact fetch of {n} topics in {len(raw)} bytes")
    return node, wait_ms, max_bytes, list(struct.unpack_from(f">{n}Q", raw, _FETCH.size))


def encode_compact_answer(entries: Sequence[tuple[int, int, int]],
                          blobs: Sequence[Buffer]) -> list[Buffer]:
    """entries: (first, hw, record bytes) per topic; blobs: the records, in order."""
    h = bytearray(_ANSWER.pack(COMPACT_ANSWER, len(entries)))
    for e in entries:
        h += _ENTRY.pack(*e)
    return _frame(bytes(h), blobs)


_ONE = struct.Struct(">IIBHQQI")     # a frame's header and a one-topic compact answer
_ONE_HEAD = _ANSWER.size + _ENTRY.size


def encode_compact_one(first: int, hw: int, size: int,
                       blobs: Sequence[Buffer]) -> list[Buffer]:
    """``encode_compact_answer`` of one topic, its records ``size`` bytes in blobs."""
    if 4 + _ONE_HEAD + size > MAX_FRAME:
        raise WireError(f"frame too large ({_ONE_HEAD} + {size} bytes)")
    return [_ONE.pack(4 + _ONE_HEAD + size, _ONE_HEAD, COMPACT_ANSWER, 1, first, hw, size),
            *blobs]


def parse_compact_answer(raw: bytes | bytearray | memoryview,
                         blob_len: int) -> list[tuple[int, int, int]]:
    """The (first, hw, record bytes) entries of a COMPACT_ANSWER head whose blob is
    blob_len bytes, else WireError (a kind, a count or sizes that do not add up)."""
    if len(raw) < _ANSWER.size:
        raise WireError("a compact head too short")
    tag, n = _ANSWER.unpack_from(raw, 0)
    if tag != COMPACT_ANSWER:
        raise WireError(f"a compact head of kind {tag} where an answer was due")
    if n > MAX_TOPICS or len(raw) != _ANSWER.size + _ENTRY.size * n:
        raise WireError(f"a compact answer of {n} topics in {len(raw)} bytes")
    out = [(int(a), int(b), int(c)) for a, b, c in
           _ENTRY.iter_unpack(memoryview(raw)[_ANSWER.size:])]
    if sum(e[2] for e in out) != blob_len:
        raise WireError(f"a compact answer's records do not fill its {blob_len} bytes")
    return out


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
        """The next frame with its head parsed as JSON (WireError if it is not)."""
        frame = self.next_raw()
        return None if frame is None else (parse_head(frame[0]), frame[1])

    def next_raw(self) -> tuple[bytes, memoryview] | None:
        """The next frame, its head unparsed (JSON or compact: ``is_json``)."""
        buf = self._buf
        if len(buf) < 8:
            return None
        size, hlen = parse_header(buf, self.max_frame)
        if len(buf) < 4 + size:
            return None
        head = bytes(buf[8:8 + hlen])
        if len(buf) == 4 + size:
            # the frame is all there is (a large one always ends so): its buffer is the
            # blob's, uncopied, and the reader starts a new one
            self._buf = bytearray()
            return head, memoryview(buf)[8 + hlen:]
        with memoryview(buf) as view:
            blob = memoryview(bytes(view[8 + hlen:4 + size]))      # one copy
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
    return bytes(blob_view(blob, span))


def blob_view(blob: memoryview, span: Json) -> memoryview:
    """``blob_span`` uncopied: a view of the frame (which a view keeps alive)."""
    if span is None:
        return memoryview(b"")
    if not isinstance(span, list) or len(span) != 2:
        raise ValueError("a blob span is not [at, length]")
    at, n = need_int(span[0]), need_int(span[1])
    if at < 0 or n < 0 or at + n > len(blob):
        raise ValueError(f"a blob span [{at}, {n}] outside the frame")
    return blob[at:at + n]



def frame_need(buf: bytes | bytearray) -> int:
    """Bytes still missing for the first frame of buf (0: complete or unknown yet)."""
    if len(buf) < 8:
        return 8 - len(buf)
    size = int(_HDR.unpack_from(buf, 0)[0])
    return max(0, 4 + size - len(buf))


__all__ = ["COMPACT_ANSWER", "COMPACT_FETCH", "MAX_FRAME", "MAX_TOPICS", "Buffer",
           "FrameReader", "WireError", "blob_span", "blob_view", "encode", "encode_compact_answer",
           "encode_compact_fetch", "encode_compact_one", "frame_need", "history_of", "is_json",
           "parse_compact_answer", "parse_compact_fetch", "parse_head", "parse_header"]
