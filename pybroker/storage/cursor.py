"""LogCursor: a reader of one topic log's segment files that reads ahead (docs/io.md,
"The log cursor").

A cursor keeps what a sequential reader needs between reads: the open descriptor of
the segment it is in, a read buffer (a ``bytearray`` it reuses), where that buffer
starts in the file, and the records it last scanned there (their positions, checked by
``nsqf_log_scan`` once). ``read(offset, n, max_bytes, ahead)`` then serves the next
records from that batch with no I/O; when they run out it moves what is left of the
buffer (a partial record) to its front and reads on sequentially, ``ahead`` records'
worth at a time (the records it expects to deliver soon, at the average record size
seen, clamped to [min_read, max_read]). The segment's sparse index is used only on a
*seek*: an offset behind the buffer, or too far ahead of it (SUB at an old offset, a
rewind, a restart, a requeued message far behind). Records in the log's memory tail
are served from there, as ``TopicLog.read`` does.

The batches a cursor returns are views of its buffer: valid until its next ``read``
(or ``release``). Whoever keeps records longer copies them (frames, payloads and
envelopes are copies already). A ``TopicLog.read`` is a cursor made for one read, whose
buffer then belongs to the batch it returned.

Files: every file read on this side is ``pread_into`` (one helper, the file-operation
seam of the read side). The cursor holds its segment's descriptor, so a segment that
retention deletes meanwhile stays readable through it (the same file, never another
one: a segment is matched by identity, and a read below the log's oldest offset raises
``OffsetOutOfRange`` as ``TopicLog.read`` does). ``release`` closes the descriptor and
drops the buffer (a channel with no consumers, a requeue queue emptied, a cursor that
has caught up with the memory tail).

Budget: one descriptor and at most ``max_read`` bytes of buffer (more only for one
record larger than that) per cursor in use; log bytes read are counted in
``TopicLog.bytes_read``. A cursor is used by one thread at a time (a channel's owner
loop, the logread thread).
"""
from __future__ import annotations

import bisect
import logging
import os
from typing import BinaryIO, Protocol, Sequence

from pybroker import _native

from .errors import from_oserror
from .records import _WHY, REC_HEADER, LogBounds, OffsetOutOfRange, RecordBatch
from .segments import Block, Segment


class LogFiles(LogBounds, Protocol):
    """What a cursor reads of its log (storage.topiclog.TopicLog, under its lock): the
    bounds, the memory tail's blocks, the segment list, and the two repairs it asks
    for on damage. The cursor is the log's own reader, split off; it names the log's
    internals through this, so the log may import the cursor and not the reverse."""

    def _tail_block(self, offset: int) -> Block | None: ...
    @property
    def _segs(self) -> Sequence[Segment]: ...

    def _set_aside(self, seg: Segment) -> None: ...
    def _resync(self, f: BinaryIO, pos: int, off: int) -> tuple[int, int] | None: ...

log = logging.getLogger("pybroker.storage.topiclog")

MIN_READ = 64 * 1024          # a channel's read-ahead at least (one pread per this)
MAX_READ = 1024 * 1024        # ... and at most
ONE_OFF_READ = 64 * 1024      # the first read of a one-off TopicLog.read
TAIL_RELEASE = 64             # reads served by the memory tail in a row before release
_EMPTY: Sequence[int] = ()
_NO_POS: Sequence[int] = ()


def pread_into(fd: int, view: memoryview, fpos: int) -> int:
    """The read side's file operation: fill view from file position fpos; returns the
    bytes read (fewer at the end of the file)."""
    return os.preadv(fd, [view], fpos)


class LogCursor:
    """See the module docstring."""

    __slots__ = ("log", "min_read", "max_read", "seeks", "_seg", "_fd", "_buf", "_fbase",
                 "_filled", "_first", "_pos", "_used", "_deferred", "_avg", "_tail_reads",
                 "_status")

    def __init__(self, log: LogFiles, min_read: int = MIN_READ,
                 max_read: int = MAX_READ) -> None:
        self.log = log
        self.min_read = min_read
        self.max_read = max(min_read, max_read)
        self.seeks = 0              # reads that started at an index point (tests, stats)
        self._seg: Segment | None = None
        self._fd = -1
        self._buf = bytearray()
        self._fbase = 0             # file position of _buf[0]
        self._filled = 0            # valid bytes in _buf
        self._first = 0             # offset of the record at _buf[0]
        self._pos: Sequence[int] = _NO_POS   # starts of the complete records scanned
        self._used = 0              # end of the last complete record scanned
        self._deferred = 0          # how many scanned records may have a deliver_at
        self._avg = 256             # bytes per record, from the last scan
        self._tail_reads = 0
        self._status = 0            # the last scan's status (damage: < 0)

    def __repr__(self) -> str:
        where = os.path.basename(self._seg.path) if self._seg is not None else "-"
        return f"LogCursor({self.log!r} {where} next={self.next_offset})"

    def __del__(self) -> None:
        if self._fd >= 0:
            try:
                os.close(self._fd)
            except OSError:
                pass

    @property
    def next_offset(self) -> int:
        """The offset after the last record scanned (-1 with nothing scanned)."""
        return self._first + len(self._pos) if self._seg is not None else -1

    def release(self) -> None:
        """Close the descriptor and drop the buffer (the next read seeks)."""
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            try:
                os.close(fd)
            except OSError:
                pass
        self._seg = None
        self._buf = bytearray()
        self._filled = self._used = self._deferred = 0
        self._pos = _NO_POS
        self._tail_reads = 0

    close = release

    # -- reading --------------------------------------------------------------------
    def read(self, offset: int, max_records: int, max_bytes: int = 0,
             ahead: int = 0) -> RecordBatch:
        """Records from offset on (at least one when offset < written; none at
        written), as TopicLog.read; ``ahead``: how many records the caller expects to
        take soon (sizes the read-ahead; at least max_records). ``max_bytes`` (when >
        0) caps one read. Raises OffsetOutOfRange outside [oldest, written]."""
        lg = self.log
        want = max(1, max_records)
        with lg.lock:
            if offset < lg.oldest or offset > lg.written:
                raise OffsetOutOfRange(f"offset {offset} not in [{lg.oldest}, {lg.written}]")
            if offset == lg.written:
                return RecordBatch(offset, b"", _EMPTY, 0)
            seg = self._seg
            first = self._first
            if seg is not None and first <= offset and offset - first + want <= len(self._pos):
                # every record wanted is in the batch scanned last: no I/O, no index
                self._tail_reads = 0
                i = offset - first
                return RecordBatch(offset, self._buf, self._pos[i:i + want], self._deferred)
            b = lg._tail_block(offset)
            if b is not None:
                i = offset - b.first
                self._tail_reads += 1
                if self._tail_reads >= TAIL_RELEASE and self._fd >= 0:
                    self.release()     # caught up with the memory tail
                return RecordBatch(offset, b.data, b.pos[i:i + want], b.deferred)
            if seg is None or not seg.base <= offset < seg.end:
                segs = lg._segs
                k = bisect.bisect_right([s.base for s in segs], offset) - 1
                if k < 0:
                    raise OffsetOutOfRange(f"offset {offset} is in no segment")
                seg = segs[k]
                if offset >= seg.end:
                    # a gap where a segment was set aside as unreadable: its records
                    # are lost; reading goes on at the next segment
                    nxt = segs[k + 1].base if k + 1 < len(segs) else lg.written
                    return RecordBatch(nxt, b"", _EMPTY, 0)
            size = seg.size                 # bytes readable (records written whole)
            end = min(seg.end, lg.written)  # offsets readable in seg
            ix = seg.index[bisect.bisect_right(seg.index, (offset, 1 << 62)) - 1]
        self._tail_reads = 0
        if seg is not self._seg:
            self._open(seg)
            self._reset(ix)
            if offset != seg.base:
                self.seeks += 1
        elif offset < self._first or ix[0] > self.next_offset:
            self._reset(ix)                 # behind the buffer, or the index is nearer
            self.seeks += 1
        return self._fill_to(offset, want, max(ahead, want), max_bytes, size, end)

    def _open(self, seg: Segment) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._seg = None
        try:
            self._fd = os.open(seg.path, os.O_RDONLY)
        except FileNotFoundError:
            with self.log.lock:
                gone = seg not in self.log._segs
            if gone:       # retention deleted it after the lookup
                raise OffsetOutOfRange(f"segment {seg.base} is no longer in the log") from None
            raise from_oserror("read", seg.path, FileNotFoundError(seg.path)) from None
        except OSError as e:
            raise from_oserror("read", seg.path, e) from None
        self._seg = seg

    def _reset(self, ix: tuple[int, int]) -> None:
        """Start over at index point ix: (offset, file position)."""
        self._first, self._fbase = ix
        self._filled = self._used = self._deferred = 0
        self._pos = _NO_POS
        self._status = 0

    def _batch(self, offset: int, want: int) -> RecordBatch:
        i = offset - self._first
        return RecordBatch(offset, self._buf, self._pos[i:i + want], self._deferred)

    def _fill_to(self, offset: int, want: int, ahead: int, max_bytes: int, size: int,
                 end: int) -> RecordBatch:
        """Read on until offset's record (and up to want records from it) is scanned."""
        base = min(self.max_read, max(self.min_read, ahead * self._avg))
        enough = self.max_read         # bytes of records from offset that make a batch
        if max_bytes > 0:
            base = min(base, max(max_bytes, 4096))
            enough = min(enough, max_bytes)
        grow = 1
        while True:
            have = len(self._pos) - (offset - self._first)
            if have > 0 and (have >= want or self.next_offset >= end
                             or self._used - self._pos[offset - self._first] >= enough):
                return self._batch(offset, want)
            keep = offset - self._first if have > 0 else len(self._pos)
            room = size - (self._fbase + self._filled)     # bytes left to read in seg
            nbytes = min(room, max(self._record_need(), min(self.max_read, base * grow)))
            if nbytes > 0 and self._read(keep, nbytes):
                if self.next_offset <= offset:
                    grow *= 2                   # still short of it: read more next time
                continue
            # the scan stopped at damage (or a record cut short) after what it holds
            if self.next_offset > offset:
                return self._batch(offset, want)
            bad = self.next_offset
            resumed = self._damaged()
            if resumed is None or resumed >= self.log.written:
                self.release()                  # the next read starts from the index
                return RecordBatch(max(offset, bad + 1), b"", _EMPTY, 0)
            offset = max(offset, resumed)
            if offset >= end:
                return RecordBatch(offset, b"", _EMPTY, 0)

    def _record_need(self) -> int:
        """Bytes of the partial record at the end of the buffer not read yet (it may be
        larger than one read-ahead), or 0."""
        at = self._used
        if self._filled - at < 8:
            return 0
        plen = int.from_bytes(self._buf[at + 4:at + 8], "big")
        if plen > self.log.max_payload:
            return 0                            # damage: the scan reports it
        return max(0, REC_HEADER + plen - (self._filled - at))

    def _read(self, keep: int, nbytes: int) -> bool:
        """Keep the scanned records from index ``keep`` on (and the partial one after
        them) at the front of the buffer, read nbytes more after them, scan again;
        False if the scan stopped at damage or nothing could be read."""
        start = self._pos[keep] if keep < len(self._pos) else self._used
        rest = self._filled - start
        buf = self._buf
        if len(buf) < rest + nbytes:
            new = bytearray(max(rest + nbytes, min(2 * len(buf), self.max_read)))
            new[:rest] = memoryview(buf)[start:self._filled]
            buf = self._buf = new       # batches handed out keep the old buffer
        elif start:
            with memoryview(buf) as mv:
                mv[:rest] = mv[start:self._filled]      # a memmove: overlap is safe
        self._first += keep
        self._fbase += start
        with memoryview(buf) as mv:
            try:
                got = pread_into(self._fd, mv[rest:rest + nbytes], self._fbase + rest)
            except OSError as e:
                assert self._seg is not None
                raise from_oserror("read", self._seg.path, e) from None
        self.log.count_read(got)
        self._filled = rest + got
        with memoryview(buf) as mv:
            pos, used, (status, deferred, _) = _native.log_scan(
                mv[:self._filled], self._first, True, self.log.max_payload, 1 << 30)
        self._pos = pos
        self._used = used
        self._deferred = deferred
        self._status = status
        if pos:
            self._avg = max(REC_HEADER, used // len(pos))
        return status >= 0 and got > 0

    def _damaged(self) -> int | None:
        """The record after what is scanned is damaged or cut short: log it, set the
        segment aside once, and resync on the next intact record. Returns the offset
        reading goes on from (the state is set there), or None."""
        lg = self.log
        seg = self._seg
        assert seg is not None
        bad = self.next_offset
        lg._set_aside(seg)
        log.error("%s: damaged record at offset %d in %s (%s): skipped", lg, bad,
                  os.path.basename(seg.path), _WHY.get(self._status, "incomplete"))
        try:
            with open(seg.path, "rb") as f:
                resumed = lg._resync(f, self._fbase + self._used, bad)
        except OSError:
            resumed = None
        if resumed is None:
            return None
        fpos, off = resumed
        self._reset((off, fpos))
        return off


__all__ = ["LogCursor", "MAX_READ", "MIN_READ", "pread_into"]
