"""LastReads: the leader's reads of its log for its followers' fetches
(pybroker.cluster.serve). An answer carries every write since the offset a follower
asked for, up to the fetch's byte budget (cut on a record boundary, at least one
record), as views of the log's buffers, sent uncopied. The followers mostly ask for the
same records, so the last read of each topic is kept while nothing was written after
it (records never change under a leader's epoch): at most READ_CACHE_TOPICS topics and
READ_CACHE_BYTES bytes. Used on the event loops (a read is bounded by the budget).
"""
from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

from pybroker.storage.topiclog import REC_HEADER, OffsetOutOfRange

if TYPE_CHECKING:
    from pybroker.cluster.replica import Replica
    from pybroker.core.seams import Batch

READ_CACHE_TOPICS = 64        # last reads kept for the next follower: this many topics
READ_CACHE_BYTES = 32 * 1024 * 1024   # and at most this many bytes


def record_bytes(batch: Batch, n: int) -> memoryview:
    """The raw bytes of the first n records of a RecordBatch (one contiguous span)."""
    buf, pos = batch.buf, batch.pos
    last = pos[n - 1]
    end = last + REC_HEADER + int.from_bytes(buf[last + 4:last + 8], "big")
    return memoryview(buf)[pos[0]:end]


class LastReads:
    def __init__(self) -> None:
        # topic -> ((log, incarnation, epoch, offset, log end), n, raw views, size): its
        # last read
        self.last: dict[str, tuple[tuple[int, int, int, int, int], int, list[memoryview],
                                   int]] = {}
        self.bytes = 0

    def read(self, r: Replica, offset: int, written: int,
              budget: int) -> tuple[int, list[memoryview], int] | None:
        """(n, raw bytes as views, their size) of the records from ``offset`` on, up
        to ``budget`` bytes (at least one record) or the log's end: every write
        (block) since, not only the first (None: not in the log any more). The
        followers mostly ask for the same records: the last read of each topic is kept
        while nothing was written after it (records never change under a leader's
        epoch)."""
        lg = r.topic.log
        key = (id(lg), r.inc, r.epoch, offset, written)
        last = self.last.get(r.name)
        if last is not None and last[0] == key and last[3] <= budget:
            return last[1], last[2], last[3]
        parts: list[memoryview] = []
        n = size = 0
        at = offset
        while at < written and (size < budget or not parts):
            try:
                batch = lg.read(at, 100_000, max(1, budget - size))
            except OffsetOutOfRange:
                if not parts:
                    return None
                break
            if not batch.n or batch.first != at:
                break
            k = batch.n
            raw = record_bytes(batch, k)
            if size + len(raw) > budget:
                pos = batch.pos
                # records are contiguous: the first k end where record k starts
                k = max(0 if parts else 1,
                        bisect.bisect_right(pos, pos[0] + budget - size) - 1)
                if not k:
                    break
                raw = record_bytes(batch, k)
            parts.append(raw)
            n += k
            size += len(raw)
            at += k
            if k < batch.n:
                break
        if n and offset + n == written:
            reads = self.last
            old = reads.pop(r.name, None)
            self.bytes -= old[3] if old is not None else 0
            if len(reads) >= READ_CACHE_TOPICS or self.bytes > READ_CACHE_BYTES:
                reads.clear()
                self.bytes = 0
            reads[r.name] = (key, n, parts, size)
            self.bytes += size
        return n, parts, size


__all__ = ["LastReads", "READ_CACHE_BYTES", "READ_CACHE_TOPICS", "record_bytes"]
