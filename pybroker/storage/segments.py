"""The topic log's in-memory pieces: ``Block`` (records written together, kept in
memory: the log's tail) and ``Segment`` (one segment file's offsets, size and indexes),
with the segment file's header.

What it owns: the shapes the log (storage.topiclog) builds and its readers
(storage.cursor, storage.timeindex) walk; below all three, so none of them imports
another to name these.
"""
from __future__ import annotations

import struct
from collections.abc import Sequence

from . import timeindex

SEG_HEADER = struct.Struct(">6sHQ")
SEG_HEADER_SIZE = SEG_HEADER.size      # 16


class Block:
    """Records written together, kept in memory."""

    __slots__ = ("first", "data", "pos", "deferred")

    def __init__(self, first: int, data: bytes | bytearray, pos: Sequence[int],
                 deferred: int) -> None:
        self.first = first
        self.data = data
        self.pos = pos
        self.deferred = deferred

    @property
    def end(self) -> int:
        return self.first + len(self.pos)


class Segment:
    """One segment file as the log tracks it: its offsets, written size, sparse index
    (offset -> file position every so many bytes) and time index."""

    __slots__ = ("path", "base", "end", "size", "max_ts", "index", "damaged", "times")

    def __init__(self, path: str, base: int) -> None:
        self.path = path
        self.base = base
        self.end = base
        self.size = SEG_HEADER_SIZE
        self.max_ts = 0
        self.index: list[tuple[int, int]] = [(base, SEG_HEADER_SIZE)]  # (offset, file pos)
        self.damaged = False
        self.times = timeindex.TimeIndex()     # built as records are written or scanned
