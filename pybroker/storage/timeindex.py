"""Lookups by time in a topic log: a sparse time index per segment (docs/storage.md).

Kafka keeps a ``.timeindex`` file beside each segment. Here the index lives in memory:
recovery reads every segment in full on start anyway (checksums), so rebuilding it
costs one extra C scan of a slice now and then, no file format to version, and no file
that could disagree with its segment after a crash. It costs 24 bytes per entry, one
entry per ``EVERY`` bytes of segment (about 40 KB per 100 MiB segment).

Entry k of a segment is ``(m_k, o_k, p_k)``: record ``o_k`` starts at file position
``p_k``, and every record of the segment before ``o_k`` has a publish time ``<= m_k``.
Entry 0 is the segment's first record; the next entry goes at the first record that
starts ``EVERY`` bytes or more after the previous entry, so two entries are at most
``EVERY`` bytes plus one record apart. ``m`` never decreases.

The lookup answers exactly Kafka's ``offsetsForTimes`` rule: the first offset (in log
order) whose publish time is ``>= t``. Every record of a segment whose newest time is
``< t`` is older than t, so the answer is in the first segment whose newest time is
``>= t``. In it, with k the last entry whose ``m_k < t`` (a bisect), nothing before
``o_k`` qualifies, and something before ``o_(k+1)`` does (``m_(k+1) >= t``): one read of
``[p_k, p_(k+1))`` finds the answer. Publish times out of order (the wall clock stepped
back) do not change the rule: the answer is still the first record in log order with a
time ``>= t``, and records after it may be older than t.
"""
from __future__ import annotations

import bisect
import os
import struct
from array import array
from typing import TYPE_CHECKING, Protocol, Sequence

from pybroker import _native

from pybroker.storage.records import LogBounds

if TYPE_CHECKING:
    from pybroker.storage.records import RecordBatch


class TimedSegment(Protocol):
    """What a lookup reads of a segment (storage.segments.Segment)."""

    @property
    def path(self) -> str: ...
    @property
    def base(self) -> int: ...
    @property
    def end(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def max_ts(self) -> int: ...
    @property
    def times(self) -> TimeIndex: ...


class TimedLog(LogBounds, Protocol):
    """What a lookup by time reads of a log (storage.topiclog.TopicLog), which owns
    the time indexes and calls ``offset_for_time``: named here, not imported."""

    @property
    def directory(self) -> str | None: ...
    @property
    def _segs(self) -> Sequence[TimedSegment]: ...

    def read(self, offset: int, max_records: int, max_bytes: int) -> RecordBatch: ...

EVERY = 64 * 1024           # bytes of segment between two entries
_TS_AT = 24                 # a record's ts_ns: after [crc][len][offset][deliver_at]
_I64 = struct.Struct(">q")


class TimeIndex:
    """The sparse time index of one segment (entries in three parallel arrays)."""

    __slots__ = ("ts", "offs", "pos", "next_pos")

    def __init__(self) -> None:
        self.ts = array("q")        # m_k: newest time of the records before o_k
        self.offs = array("q")      # o_k
        self.pos = array("q")       # p_k
        self.next_pos = 0           # the next entry: the first record starting here or after

    def __len__(self) -> int:
        return len(self.offs)

    def add(self, buf: bytes | bytearray | memoryview, starts: Sequence[int], first: int, buf_pos: int,
            max_ts_before: int, max_payload: int, uniform_ts: int | None = None) -> None:
        """Records ``first``.. were written to (or found in) the segment: record i
        starts at ``buf[starts[i]]``, file position ``buf_pos + starts[i]``.
        ``max_ts_before``: the newest time of the segment's records before them.
        ``uniform_ts``: the time of every one of them, when they share one (then no
        scan is needed to know the newest before an entry)."""
        n = len(starts)
        if n == 0 or buf_pos + starts[n - 1] < self.next_pos:
            return
        i = bisect.bisect_left(starts, self.next_pos - buf_pos)
        running = max_ts_before
        prev = 0
        while i < n:
            if i > prev:
                # the newest time among records [prev, i): given, or one C scan (no CRC)
                if uniform_ts is not None:
                    newest = uniform_ts
                else:
                    view = memoryview(buf)[starts[prev]:starts[i]]
                    _, _, (_, _, newest) = _native.log_scan(view, first + prev, False,
                                                            max_payload, i - prev)
                running = max(running, newest)
            at = buf_pos + starts[i]
            self.ts.append(running)
            self.offs.append(first + i)
            self.pos.append(at)
            self.next_pos = at + EVERY
            prev = i
            i = bisect.bisect_left(starts, self.next_pos - buf_pos, i + 1)

    def span(self, ts_ns: int, size: int) -> tuple[int, int, int]:
        """(first offset, file position, end position) of the one stretch of the
        segment (``size`` bytes long) that holds the first record with time >= ts_ns,
        if the segment holds one."""
        k = max(0, bisect.bisect_left(self.ts, ts_ns) - 1)
        end = self.pos[k + 1] if k + 1 < len(self.pos) else size
        return self.offs[k], self.pos[k], end


def offset_for_time(log: TimedLog, ts_ns: int) -> int:
    """The first offset of log whose publish time is >= ts_ns (``written`` if none):
    a bisect in the first segment new enough and one read of at most EVERY bytes plus
    a record. A log without segments (memory only) is scanned (it holds at most its
    memory tail). Called on every thread; the read happens outside the log's lock."""
    for _ in range(3):
        with log.lock:
            oldest, written = log.oldest, log.written
            segs = log._segs
            seg = next((s for s in segs if s.end > max(oldest, s.base) and s.max_ts >= ts_ns
                        and len(s.times)), None)
            if seg is None:
                if segs or log.directory is not None:
                    return written
                plan = None
            else:
                first, start, end = seg.times.span(ts_ns, seg.size)
                plan = (seg.path, first, start, end)
        if plan is None:
            return _scan(log, oldest, ts_ns)
        try:
            found = _read_span(log, *plan, ts_ns)
        except FileNotFoundError:
            continue            # retention deleted the segment meanwhile: look again
        return min(found, log.written) if found >= 0 else _scan(log, plan[1], ts_ns)
    return _scan(log, log.oldest, ts_ns)


def _read_span(log: TimedLog, path: str, first: int, start: int, end: int,
               ts_ns: int) -> int:
    """The first record in file bytes [start, end) (records from ``first`` on) with a
    time >= ts_ns; -1 if none is found there (damage: the caller scans instead)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = os.pread(fd, end - start, start)
    finally:
        os.close(fd)
    log.count_read(len(buf))
    starts, _, _ = _native.log_scan(buf, first, True, log.max_payload, 1 << 30)
    unpack = _I64.unpack_from
    for i, p in enumerate(starts):
        if unpack(buf, p + _TS_AT)[0] >= ts_ns:
            return first + i
    return -1


def _scan(log: TimedLog, start: int, ts_ns: int) -> int:
    """The slow way (a memory-only log, or damage in the span): read on from start."""
    off = max(start, log.oldest)
    while off < log.written:
        try:
            b = log.read(off, 4096, 1 << 20)
        except ValueError:          # OffsetOutOfRange: retention moved oldest on
            off = log.oldest
            continue
        for i in range(b.n):
            if b.ts_ns(i) >= ts_ns:
                return int(b.first + i)
        off = b.first + max(b.n, 1)
    return int(log.written)
