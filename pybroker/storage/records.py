"""The topic log's record format, as the log and its readers share it: the record header
size, the scanner's damage codes, ``RecordBatch`` (records as a view of one buffer) and
``OffsetOutOfRange``.

What it owns: the bytes of a record as readers see them (format in docs/storage.md); the
log (storage.topiclog) writes them, its cursors (storage.cursor) and the log read them.
It imports neither, so they do not import each other.
"""
from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from pybroker import _native

if TYPE_CHECKING:
    import threading

__all__ = ["REC_HEADER", "OffsetOutOfRange", "RecordBatch"]

REC_HEADER = 16
_WHY = {-30: "impossible length", -31: "checksum mismatch", -32: "offset out of sequence"}
_I64 = struct.Struct(">q")


class OffsetOutOfRange(ValueError):
    """An offset below what the log holds, or past its written end."""


class RecordBatch:
    """Records [first, first + n) as a view of one buffer: record i starts at pos[i]."""

    __slots__ = ("first", "n", "buf", "pos", "deferred")

    def __init__(self, first: int, buf: bytes | bytearray, pos: Sequence[int],
                 deferred: int) -> None:
        self.first = first
        self.n = len(pos)
        self.buf = buf
        self.pos = pos
        self.deferred = deferred    # how many records of buf may have a deliver_at

    def frames(self, i: int, j: int, attempts: int | None = None) -> bytes | bytearray:
        """NSQ message frames for records [i, j), one C call; attempts None: each
        record's stored attempts + 1."""
        return _native.log_frames(self.buf, self.pos[i:j], -1 if attempts is None else attempts)

    def frames_each(self, idx: Sequence[int], adds: Sequence[int]) -> bytes | bytearray:
        """NSQ message frames for records idx (in that order), one C call: record
        idx[k]'s attempts its stored attempts + adds[k] (redeliveries, each with its
        own count)."""
        pos = self.pos
        return _native.log_frames_each(self.buf, [pos[i] for i in idx], adds)

    def end_of(self, i: int) -> int:
        """Where record i ends in buf."""
        p = self.pos[i]
        return p + REC_HEADER + int.from_bytes(self.buf[p + 4:p + 8], "big")

    def deferred_indices(self, count: int) -> list[int]:
        """Indices below count of the records with a deliver_at (DPUBs)."""
        if not self.deferred:
            return []
        buf, pos = self.buf, self.pos
        return [i for i in range(min(count, self.n)) if buf[pos[i] + 16:pos[i] + 24] != bytes(8)]

    def deliver_at(self, i: int) -> int:
        p = self.pos[i] + 16
        return int(_I64.unpack_from(self.buf, p)[0])

    def ts_ns(self, i: int) -> int:
        return int(_I64.unpack_from(self.buf, self.pos[i] + 24)[0])

    def stored_attempts(self, i: int) -> int:
        p = self.pos[i] + 32
        return int.from_bytes(self.buf[p:p + 2], "big")

    def payload(self, i: int) -> bytes:
        p = self.pos[i]
        plen = int.from_bytes(self.buf[p + 4:p + 8], "big")
        return bytes(self.buf[p + REC_HEADER:p + REC_HEADER + plen])


class LogBounds(Protocol):
    """What every reader of a log asks of it (storage.topiclog.TopicLog), under its
    lock: the offsets it holds, the largest record, and where to count bytes read."""

    @property
    def lock(self) -> threading.Lock: ...
    @property
    def oldest(self) -> int: ...
    @property
    def written(self) -> int: ...
    @property
    def max_payload(self) -> int: ...

    def count_read(self, nbytes: int) -> None: ...
