"""TopicLog: one topic's append-only log of records, on disk and in memory (stdlib + the
C record codec in pybroker._native).

Theory of operation
-------------------
Every record gets an *offset* (0, 1, 2, ... per log; never reused once written: the
offsets of records whose write failed are given to the next ones).
``append`` builds the records of a publish in one C call (``nsqf_log_build``) into a
pending list; ``write_pending`` hands everything pending to the kernel in one ``write``
(rolling to a new segment file first when the active one would pass
``max_bytes_per_file``), and keeps the written bytes as one *block* of the memory tail.
Readers take records from the tail while it holds the offset, else from the segment
files, records checked by ``nsqf_log_scan``: a channel (and the logread thread) through
a ``cursor()`` (storage/cursor.py: it keeps its segment open, reads ahead sequentially
into a buffer it reuses, and uses the segment's sparse index only to seek), anyone else
through ``read(offset, n, max_bytes)`` (one read from the sparse index point). A
RecordBatch is a view of one block or one read buffer, never a copy per record;
``frames`` builds NSQ message frames for a slice of it in one C call
(``nsqf_log_frames``). ``bytes_read`` counts the bytes read from the files.

The tail keeps about ``mem_records`` of the newest records, and at most about
``TAIL_MAX_BYTES`` for a log on disk (whole blocks; records beyond that count as on
disk for ``tail_start`` and /stats). A log without a directory
(``#ephemeral`` topics) is only its tail: older records are dropped (``oldest`` moves).

Write epochs: each ``write_pending`` carries the records appended since the one before
and is numbered (``epoch``: the number the pending records will be written with). It
returns that number, or raises a StorageError naming it; ``sync`` moves
``durable_epoch``, or fails and declares every written epoch not yet durable lost
(``lost_by``). A publisher compares the epoch its records were appended in with these
(docs/storage.md, "When a write fails"). Every file operation of the write side goes through
``fileops`` (pybroker.storage.fileops: the fault seam for tests).

Concurrency: ``lock`` guards everything here. Callers hold it around ``append`` /
``write_pending`` / ``discard_pending`` (the Topic does); ``read`` and the other methods
take it themselves, and do file reads and fsyncs outside it (on dup'd descriptors).
``sync`` and ``drop_before`` run on the storage thread.

On disk (``<directory>/%020d.log``, the base offset): a 16-byte header ``PBTLOG`` +
u16 format version (1) + u64 base offset, then records back to back:
``[u32 crc32][u32 length][u64 offset] payload``, payload = ``[i64 deliver_at_ns]
[i64 ts_ns][u16 attempts][16-byte id][body]``, crc32 (zlib's) over length, offset and
payload; the id is the offset in 16 lowercase hex digits, so ``payload[8:]`` is nsqd's
message encoding. Recovery on open scans every segment: an incomplete or damaged record
at the very end of the last segment is a torn write and is cut off; damage elsewhere is
logged, the segment copied aside once as ``<name>.bad``, and reading resyncs on the next
intact record, so a damaged record costs only itself.
"""
from __future__ import annotations

import bisect
import errno
import logging
import os
import struct
import threading
import zlib
from dataclasses import dataclass
from typing import BinaryIO, Sequence

from pybroker import _native

from .records import _WHY, REC_HEADER, OffsetOutOfRange, RecordBatch
from . import timeindex
from .segments import SEG_HEADER, SEG_HEADER_SIZE
from .segments import Block as _Block
from .segments import Segment as _Segment
from .errors import StorageError, from_oserror
from .fileops import REAL, FileOps

log = logging.getLogger("pybroker.storage.topiclog")
SEG_MAGIC = b"PBTLOG"
SEG_VERSION = 1
PAYLOAD_HEAD = 34
READ_CHUNK = 256 * 1024
LOG_END, LOG_PARTIAL, LOG_FULL = 0, 1, 2      # nsqf_log_scan's statuses (>= 0: no damage)
RESYNC_LIMIT = 4 * 1024 * 1024
# the memory tail of a log on disk holds at most mem_queue_size records and about this
# many bytes; older records are read back from the segment files (the page cache)
TAIL_MAX_BYTES = 32 * 1024 * 1024
INDEX_EVERY = 1024          # records between sparse index points within one write
MAX_LOST = 64               # ranges of lost epochs kept (older ones are merged)
_U64 = struct.Struct(">Q")
_GONE = _Block(0, b"", (), 0)   # a dropped block's place in the tail until the lists are cut
FRONT_CUT = 4096                # dropped blocks cut off the tail's lists at a time


@dataclass(frozen=True)
class SegmentInfo:
    base: int           # first offset
    end: int            # one past the last offset
    size_bytes: int
    max_ts_ns: int      # newest publish time in it


class TopicLog:
    def __init__(self, directory: str | None, *, max_bytes_per_file: int, mem_records: int,
                 max_record_bytes: int, fileops: FileOps = REAL) -> None:
        self.directory = directory
        self.fileops = fileops
        self.max_bytes_per_file = max_bytes_per_file
        self.mem_records = max(0, mem_records)
        self.max_payload = max_record_bytes + PAYLOAD_HEAD
        self.lock = threading.Lock()
        self.head = 0          # next offset to assign
        self.written = 0       # every offset below is in the tail or a segment file
        self.oldest = 0        # the lowest offset held
        self.tail_start = 0    # offsets below are counted as on disk
        self.dropped_count = 0
        # appended chunks, each with what its build (or check) already found: (record
        # starts, newest time, deferred count, whether every record has that time);
        # None: write_pending scans it
        self._pending: list[tuple[bytes | bytearray,
                                  tuple[Sequence[int], int, int, bool] | None]] = []
        self._pending_deferred = 0
        # the memory tail: blocks from ``_front`` on (the ones before it are dropped,
        # replaced by _GONE, and cut off the lists FRONT_CUT at a time: ``_trim_tail``)
        self._blocks: list[_Block] = []
        self._block_firsts: list[int] = []
        self._front = 0
        self._tail_records = 0
        self._tail_bytes = 0
        self._segs: list[_Segment] = []
        self._fd: int | None = None
        self._to_sync: list[int] = []      # dup'd fds of rolled segments not yet fsynced
        self._dir_dirty = False
        self.writes = 0
        self.bytes_read = 0    # read from the segment files since start (count_read)
        # write epochs (docs/storage.md, "When a write fails"): the pending records will
        # be carried by the write of ``epoch``; every write, failed or not, uses one up
        self.epoch = 1
        self.last_written_epoch = 0     # the newest epoch whose write succeeded
        self.durable_epoch = 0          # epochs up to this were covered by an fsync
        self._durable_offset = 0        # offsets below were covered by an fsync
        self._must_roll = False         # an fsync failed: the active segment takes no more
        # (first, last, error) of the epochs a failed fsync left unknown, oldest first
        self._lost: list[tuple[int, int, StorageError]] = []
        self._cut_back: int | None = None   # a failed write could not be cut back to this
        # (offset, deliver_at_ns) of the DPUB records found by recovery
        self.recovered_dpubs: list[tuple[int, int]] = []
        if directory is not None:
            os.makedirs(directory, exist_ok=True)
            self._recover()

    def __repr__(self) -> str:
        name = os.path.basename(self.directory) if self.directory else "memory"
        return f"TOPICLOG({name})"

    # -- recovery ---------------------------------------------------------------------
    def _recover(self) -> None:
        assert self.directory is not None
        names = sorted(n for n in os.listdir(self.directory)
                       if n.endswith(".log") and n[:-4].isdigit())
        for i, name in enumerate(names):
            path = os.path.join(self.directory, name)
            seg = self._scan_segment(path, int(name[:-4]), last=i == len(names) - 1)
            if seg is not None:
                if self._segs and seg.base < self._segs[-1].end:
                    log.error("%s: segment %s overlaps the one before; ignored", self, name)
                    continue
                self._segs.append(seg)
        if self._segs:
            self.oldest = self._segs[0].base
            self.head = self.written = self.tail_start = self._segs[-1].end
            try:
                self._fd = self.fileops.open(self._segs[-1].path, os.O_WRONLY)
            except OSError as e:
                raise from_oserror("open", self._segs[-1].path, e) from None

    def _scan_segment(self, path: str, base: int, last: bool) -> _Segment | None:
        """Check a segment's records (C scan, checksums), build its sparse index, cut a
        torn tail of the last segment, resync past damage; None if unusable."""
        seg = _Segment(path, base)
        try:
            with open(path, "rb") as f:
                head = f.read(SEG_HEADER_SIZE)
                if len(head) < SEG_HEADER_SIZE and last:
                    f.close()
                    os.unlink(path)       # created, header not yet written: start again
                    return None
                magic, version, hbase = SEG_HEADER.unpack(head.ljust(SEG_HEADER_SIZE, b"\0"))
                if magic != SEG_MAGIC or version != SEG_VERSION or hbase != base:
                    raise ValueError(f"bad segment header {head!r}")
                pos, off, carry = SEG_HEADER_SIZE, base, b""
                while True:
                    chunk = f.read(READ_CHUNK)
                    buf = carry + chunk
                    if not buf:
                        break
                    starts, used, (status, deferred, max_ts) = _native.log_scan(
                        buf, off, True, self.max_payload, 1 << 30)
                    if starts:
                        if seg.index[-1][1] != pos:
                            seg.index.append((off, pos))
                        seg.times.add(buf, starts, off, pos, seg.max_ts, self.max_payload)
                        seg.max_ts = max(seg.max_ts, max_ts)
                    if deferred:    # DPUBs: the topic counts them as deferred until due
                        batch = RecordBatch(off, buf, starts, deferred)
                        self.recovered_dpubs += [(off + i, batch.deliver_at(i))
                                                 for i in batch.deferred_indices(len(starts))]
                    off += len(starts)
                    pos += used
                    carry = buf[used:]
                    if status in (LOG_END, LOG_FULL) or status == LOG_PARTIAL and chunk:
                        continue
                    # damage, or an incomplete record at the end of the file
                    resumed = self._resync(f, pos, off)
                    if resumed is None and last:
                        log.warning("%s: torn write at the end of %s (offset %d): cut off",
                                    self, os.path.basename(path), off)
                        break
                    self._set_aside(seg)
                    log.error("%s: damaged record at offset %d in %s (%s): skipped", self, off,
                              os.path.basename(path), _WHY.get(status, "incomplete"))
                    if resumed is None:
                        break
                    pos, off = resumed
                    seg.index.append((off, pos))
                    f.seek(pos)
                    carry = b""
        except (OSError, ValueError) as e:
            log.error("%s: segment %s unreadable (%s): set aside", self, path, e)
            try:
                os.replace(path, path + ".bad")
            except OSError:
                pass
            return None
        if last and pos < os.path.getsize(path):
            with open(path, "r+b") as f:
                f.truncate(pos)
        seg.end = off
        seg.size = pos
        return seg

    def _resync(self, f: BinaryIO, pos: int, off: int) -> tuple[int, int] | None:
        """After a bad record at file position pos (offset off): the position and
        offset of the next intact record within RESYNC_LIMIT, or None."""
        f.seek(pos)
        window = f.read(RESYNC_LIMIT)
        for skip in range(1, 64):
            want = _U64.pack(off + skip)
            at = window.find(want, 1)
            while at >= 0:
                start = at - 8
                if start > 0:
                    got, _, _ = _native.log_scan(window[start:start + REC_HEADER + self.max_payload],
                                                 off + skip, True, self.max_payload, 1)
                    if got:
                        return pos + start, off + skip
                at = window.find(want, at + 1)
        return None

    def _set_aside(self, seg: _Segment) -> None:
        if seg.damaged:
            return
        seg.damaged = True
        try:
            import shutil  # a damaged segment only

            shutil.copyfile(seg.path, seg.path + ".bad")
        except OSError as e:
            log.error("%s: could not copy %s aside: %s", self, seg.path, e)

    # -- write side (caller holds self.lock) ------------------------------------------
    def append(self, bodies: list[bytes], ts_ns: int, deliver_at_ns: int = 0) -> int:
        """Build records for bodies (one C call); returns the first offset. They are
        readable once ``write_pending`` has run."""
        first = self.head
        if len(bodies) == 1:
            src = bodies[0]
            offs: Sequence[int] = (0,)
            lens: Sequence[int] = (len(src),)
        else:
            src = b"".join(bodies)
            lens = [len(b) for b in bodies]
            offs = [0] * len(bodies)
            at = 0
            for i, n in enumerate(lens):
                offs[i] = at
                at += n
        data, pos = _native.log_build(first, ts_ns, deliver_at_ns, src, offs, lens)
        self._pending.append((data, (pos, ts_ns, len(bodies) if deliver_at_ns else 0, True)))
        if deliver_at_ns:
            self._pending_deferred += len(bodies)
        self.head = first + len(bodies)
        return first

    def append_parts(self, src: bytes | bytearray, offs: Sequence[int], lens: Sequence[int],
                     ts_ns: int) -> int:
        """Records for the parts src[offs[i]:offs[i] + lens[i]] (an MPUB body as
        mpub_split found it): one C call, no object per part."""
        first = self.head
        data, pos = _native.log_build(first, ts_ns, 0, src, offs, lens)
        self._pending.append((data, (pos, ts_ns, 0, True)))
        self.head = first + len(lens)
        return first

    def append_records(self, items: list[tuple[int, int, bytes, int]]) -> int:
        """Records with their own (ts_ns, attempts, body, deliver_at_ns): imports."""
        first = self.head
        for i, (ts, attempts, body, deliver_at) in enumerate(items):
            data, _ = _native.log_build(first + i, ts, deliver_at, body, (0,), (len(body),))
            if attempts:
                rec = bytearray(data)
                rec[32:34] = min(attempts, 0xFFFF).to_bytes(2, "big")
                rec[0:4] = zlib.crc32(bytes(rec[4:])).to_bytes(4, "big")
                data = bytes(rec)
            self._pending.append((data, None))
            if deliver_at:
                self._pending_deferred += 1
        self.head = first + len(items)
        return first

    def append_raw(self, data: bytes | bytearray, first: int) -> tuple[Sequence[int], int]:
        """Records already built elsewhere (a replica's copy of its leader's log:
        pybroker.cluster): they must start at ``head`` and be whole and intact (offsets
        in sequence, checksums); returns where each starts in ``data`` and how many are
        deferred (DPUB). Raises ValueError otherwise (nothing is appended). Written by
        the next ``write_pending`` like any append."""
        if first != self.head:
            raise ValueError(f"records start at {first}, the log's head is {self.head}")
        starts, used, (status, deferred, max_ts) = _native.log_scan(
            data, first, True, self.max_payload, 1 << 30)
        if used != len(data) or status < 0:
            raise ValueError(f"records from {first} are damaged or incomplete")
        if not starts:
            return starts, 0
        self._pending.append((bytes(data), (starts, max_ts, deferred, False)))
        self._pending_deferred += deferred
        self.head = first + len(starts)
        return starts, deferred

    def truncate(self, offset: int) -> int:
        """Cut the log back so that ``offset`` is the next offset written (a replica
        dropping the tail its new leader does not have: pybroker.cluster). Nothing may
        be pending. Segments after it are removed, the one holding it is cut and
        rescanned (its index rebuilt); returns the new ``written``. Raises StorageError
        on a file error. Caller holds the lock."""
        assert not self._pending, "truncate with records pending"
        if offset >= self.written:
            return self.written
        offset = max(offset, self.oldest)
        blocks = self._blocks
        while len(blocks) > self._front and blocks[-1].first >= offset:
            b = blocks.pop()
            self._block_firsts.pop()
            self._tail_records -= len(b.pos)
            self._tail_bytes -= len(b.data)
        if len(blocks) == self._front:
            self._clear_tail()
        elif blocks[-1].end > offset:
            b = blocks[-1]
            keep = offset - b.first
            cut = b.pos[keep]
            self._tail_records -= len(b.pos) - keep
            self._tail_bytes -= len(b.data) - cut
            blocks[-1] = _Block(b.first, bytes(b.data[:cut]), b.pos[:keep], b.deferred)
        if self.directory is not None and self._segs:
            self._truncate_files(offset)
        self.head = self.written = offset
        self.tail_start = min(self.tail_start, offset)
        self._durable_offset = min(self._durable_offset, offset)
        self.recovered_dpubs = sorted({d for d in self.recovered_dpubs if d[0] < offset})
        return offset

    def restart_at(self, offset: int) -> None:
        """Drop every record and begin again at ``offset`` (past ``written``): a
        replica whose log lies wholly below its leader's oldest record
        (pybroker.cluster), which fetches from there on. The segment files are removed,
        oldest first; the next write starts a new one at ``offset``. Nothing may be
        pending. Raises StorageError when a file cannot be removed (the ones removed
        before it are gone: ``oldest`` says where the log begins). Caller holds the
        lock."""
        assert not self._pending, "restart with records pending"
        assert offset > self.written, "restart below the log's end"
        ops = self.fileops
        for fd in self._to_sync + ([self._fd] if self._fd is not None else []):
            try:
                ops.close(fd)
            except OSError:
                pass
        self._to_sync = []
        self._fd = None
        self._must_roll = False
        self._cut_back = None
        while self._segs:
            seg = self._segs[0]
            try:
                os.unlink(seg.path)
            except FileNotFoundError:
                pass
            except OSError as e:
                self.oldest = seg.base
                raise from_oserror("restart", seg.path, e) from None
            self._segs.pop(0)
            self._dir_dirty = True
        self._clear_tail()
        self.head = self.written = self.oldest = self.tail_start = offset
        self._durable_offset = offset
        self.durable_epoch = max(self.durable_epoch, self.last_written_epoch)
        self.recovered_dpubs = []

    def _truncate_files(self, offset: int) -> None:
        ops = self.fileops
        while len(self._segs) > 1 and self._segs[-1].base >= offset:
            seg = self._segs.pop()
            try:
                os.unlink(seg.path)
            except OSError as e:
                raise from_oserror("truncate", seg.path, e) from None
            if self._fd is not None:
                ops.close(self._fd)
                self._fd = None
        seg = self._segs[-1]
        pos = self._file_pos(seg, offset)
        try:
            if self._fd is None:
                self._fd = ops.open(seg.path, os.O_WRONLY)
            ops.ftruncate(self._fd, pos)
        except OSError as e:
            raise from_oserror("truncate", seg.path, e) from None
        self._cut_back = None
        self._dir_dirty = True
        again = self._scan_segment(seg.path, seg.base, last=True)
        if again is not None:
            self._segs[-1] = again

    def _file_pos(self, seg: _Segment, offset: int) -> int:
        """The file position of record ``offset`` of seg (its end if past the last)."""
        if offset >= seg.end:
            return seg.size
        start_off, fpos = seg.index[bisect.bisect_right(seg.index, (offset, 1 << 62)) - 1]
        fd = os.open(seg.path, os.O_RDONLY)
        try:
            while start_off < offset:
                chunk = os.pread(fd, READ_CHUNK, fpos)
                starts, used, _ = _native.log_scan(chunk, start_off, False, self.max_payload,
                                                   offset - start_off)
                if not starts:
                    # a record larger than the chunk
                    need = REC_HEADER + int.from_bytes(chunk[4:8], "big")
                    if len(chunk) < 8 or need <= len(chunk):
                        raise StorageError(f"{seg.path}: no record at offset {start_off}")
                    fpos += need
                    start_off += 1
                    continue
                start_off += len(starts)
                fpos += used
        finally:
            os.close(fd)
        return fpos

    def discard_pending(self) -> None:
        """Forget appended records not yet written (their publishes failed)."""
        self._pending = []
        self._pending_deferred = 0
        self.head = self.written

    def write_pending(self) -> int:
        """One write of everything appended; returns the epoch that write carried (0
        when nothing was pending) and moves ``epoch`` on. On an OS error the file is
        cut back, the records stay pending (the caller discards them: their publishes
        failed), ``epoch`` still moves on, and a StorageError naming the failed epoch
        (``.epoch``) is raised."""
        if not self._pending:
            return 0
        epoch = self.epoch
        self.epoch += 1
        first = self.written
        n = self.head - first
        pending = self._pending
        meta = pending[0][1] if len(pending) == 1 else None
        if meta is not None:
            # one build this write (a turn's publishes to this topic, mostly): its
            # starts and times are known, no scan needed
            data = pending[0][0]
            pos, max_ts, deferred, uniform = meta
        else:
            data = b"".join(d for d, _ in pending)
            pos, _, (_, deferred, max_ts) = _native.log_scan(data, first, False,
                                                             self.max_payload, n)
            uniform = False
        if self.directory is not None:
            try:
                self._write_file(data, first, n, pos, max_ts if uniform else None)
            except StorageError as e:
                e.epoch = epoch
                raise
        self._pending = []
        self._pending_deferred = 0
        if self._segs:
            seg = self._segs[-1]
            seg.max_ts = max(seg.max_ts, max_ts)
        self._blocks.append(_Block(first, data, pos, deferred))
        self._block_firsts.append(first)
        self._tail_records += n
        self._tail_bytes += len(data)
        self.written = self.head
        self._trim_tail()
        self.writes += 1
        self.last_written_epoch = epoch
        if self.directory is None:
            self.durable_epoch = epoch     # memory only: nothing to sync
        return epoch

    def _write_file(self, data: bytes | bytearray, first: int, n: int,
                    pos: Sequence[int], uniform_ts: int | None) -> None:
        """``uniform_ts``: the publish time of every record of ``data``, when they
        share one (one build: a turn's publishes to the topic), else None."""
        ops = self.fileops
        seg = self._segs[-1] if self._segs else None
        if seg is not None and self._cut_back is not None:
            self._retry_cut_back(seg)
        if (seg is None or self._must_roll
                or seg.end > seg.base and seg.size + len(data) > self.max_bytes_per_file):
            seg = self._roll(first)
        assert self._fd is not None
        try:
            done = 0
            while done < len(data):
                # a short write (a disk filling up) goes on where it stopped; a write of
                # nothing at all is an error, not a reason to spin
                k = ops.pwrite(self._fd, memoryview(data)[done:] if done else data,
                               seg.size + done)
                if k <= 0:
                    raise OSError(errno.EIO, "short write: the kernel took no bytes")
                done += k
        except OSError as e:
            try:
                ops.ftruncate(self._fd, seg.size)
            except OSError as e2:
                # bytes of the failed records may remain past seg.size: the next write
                # cuts them off first (it fails while it cannot), so that no record of
                # a failed publish is ever followed by a good one in the file
                self._cut_back = seg.size
                log.error("%s: cutting %s back to %d after a failed write failed: %s",
                          self, os.path.basename(seg.path), seg.size, e2)
            raise from_oserror("write", seg.path, e) from None
        if seg.index[-1][1] != seg.size:
            seg.index.append((first, seg.size))
        # index points inside a big block too, so a read near its end does not scan it all
        for k in range(INDEX_EVERY, n, INDEX_EVERY):
            seg.index.append((first + k, seg.size + pos[k]))
        # before write_pending updates seg.max_ts with this write's times
        seg.times.add(data, pos, first, seg.size, seg.max_ts, self.max_payload, uniform_ts)
        seg.size += len(data)
        seg.end = first + n

    def _retry_cut_back(self, seg: _Segment) -> None:
        assert self._fd is not None and self._cut_back is not None
        try:
            self.fileops.ftruncate(self._fd, self._cut_back)
        except OSError as e:
            raise from_oserror("write", seg.path, e) from None
        self._cut_back = None

    def _roll(self, base: int) -> _Segment:
        """A new active segment starting at offset base (after a full one, or after a
        failed fsync: the old one is closed without another fsync)."""
        assert self.directory is not None
        ops = self.fileops
        path = os.path.join(self.directory, "%020d.log" % base)
        fd = -1
        try:
            fd = ops.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            header = SEG_HEADER.pack(SEG_MAGIC, SEG_VERSION, base)
            if ops.pwrite(fd, header, 0) != len(header):
                raise OSError(errno.ENOSPC, "short write of a segment header")
        except OSError as e:
            if fd >= 0:
                ops.close(fd)
                try:
                    os.unlink(path)
                except OSError:
                    pass
            raise from_oserror("write", path, e) from None
        if self._fd is not None:
            if self._must_roll:
                # an fsync of it failed: its tail is unknown and a second fsync could
                # report success for pages the kernel dropped; never sync it again
                ops.close(self._fd)
            else:
                self._to_sync.append(self._fd)   # fsynced (and closed) by the next sync
        self._must_roll = False
        self._fd = fd
        self._dir_dirty = True
        seg = _Segment(path, base)
        if self._segs and self._segs[-1].base == base:
            self._segs[-1] = seg      # the same file again: it held no record
        else:
            self._segs.append(seg)
        if len(self._segs) == 1:
            self.oldest = base
        return seg

    def _tail_block(self, offset: int) -> _Block | None:
        """The memory tail's block that holds offset (below ``written``), or None when
        offset is older than the tail (the lock held: the log's reads and its cursors')."""
        f = self._front
        blocks = self._blocks
        if len(blocks) > f and offset >= blocks[f].first:
            return blocks[bisect.bisect_right(self._block_firsts, offset, f) - 1]
        return None

    def _clear_tail(self) -> None:
        self._blocks.clear()
        self._block_firsts.clear()
        self._front = 0
        self._tail_records = self._tail_bytes = 0

    def _trim_tail(self) -> None:
        """Drop the oldest blocks past ``mem_records`` (and ``TAIL_MAX_BYTES`` on
        disk), keeping at least one. A block dropped is replaced by _GONE and the front
        index moves; the lists lose their dropped heads FRONT_CUT blocks at a time (a
        ``pop(0)`` a write moved the whole list: with 134,000 blocks, a tail of
        one-record writes under ``--mem-queue-size=1000000``, 28 us a write against 7)."""
        blocks = self._blocks
        keep = self.mem_records
        on_disk = self.directory is not None
        i = self._front
        last = len(blocks) - 1
        while i < last and (self._tail_records - len(blocks[i].pos) >= keep
                            or on_disk and self._tail_bytes - len(blocks[i].data)
                            >= TAIL_MAX_BYTES):
            b = blocks[i]
            blocks[i] = _GONE
            self._tail_records -= len(b.pos)
            self._tail_bytes -= len(b.data)
            i += 1
        if i >= FRONT_CUT:
            del blocks[:i]
            del self._block_firsts[:i]
            i = 0
        self._front = i
        live = len(blocks) > i
        if self.directory is None:
            # memory only: keep the newest mem_records; the rest is gone
            low = max(self.written - keep, blocks[i].first if live else self.written)
            if low > self.oldest:
                self.dropped_count += low - self.oldest
                self.oldest = low
            if live and blocks[-1].end <= self.oldest:
                self._clear_tail()
                live = False
        first = blocks[i].first if live else self.written
        self.tail_start = max(first, self.written - keep)
        if on_disk and self._tail_bytes > TAIL_MAX_BYTES and live:
            # a byte budget too: past it, reads go to the segment files (the kernel's
            # page cache), and the records count as on disk
            self.tail_start = max(self.tail_start, blocks[i].end)

    # -- read side (any thread) -------------------------------------------------------
    def cursor(self, min_read: int = 0, max_read: int = 0) -> "_cursor.LogCursor":
        """A reader that keeps its segment open and reads ahead (storage/cursor.py):
        for a channel, the logread thread, any sequential reader."""
        return _cursor.LogCursor(self, min_read or _cursor.MIN_READ,
                                 max_read or _cursor.MAX_READ)

    def read(self, offset: int, max_records: int, max_bytes: int) -> RecordBatch:
        """Records from offset on (at least one when offset < written; none at
        written): a one-off read (from the memory tail, else from the segment's sparse
        index point; the batch owns its buffer). Raises OffsetOutOfRange outside
        [oldest, written]."""
        with self.lock:
            if offset < self.oldest or offset > self.written:
                raise OffsetOutOfRange(f"offset {offset} not in [{self.oldest}, {self.written}]")
            if offset == self.written:
                return RecordBatch(offset, b"", (), 0)
            b = self._tail_block(offset)
            if b is not None:
                i = offset - b.first
                j = min(len(b.pos), i + max(1, max_records))
                return RecordBatch(offset, b.data, b.pos[i:j], b.deferred)
        cur = _cursor.LogCursor(self, _cursor.ONE_OFF_READ, READ_CHUNK)
        try:
            return cur.read(offset, max_records, max_bytes)
        finally:
            cur.release()       # the batch keeps the buffer it points into

    def count_read(self, nbytes: int) -> None:
        """Log bytes read from the segment files (/stats ``log_bytes_read``)."""
        with self.lock:
            self.bytes_read += nbytes

    def payload(self, offset: int) -> bytes | None:
        """One record's payload, or None if it is gone or damaged."""
        try:
            b = self.read(offset, 1, 0)
        except OffsetOutOfRange:
            return None
        return b.payload(0) if b.n and b.first == offset else None

    def timestamps(self, offsets: list[int]) -> list[int]:
        """Publish times of these offsets (those still held), in offset order: one
        cursor for all, so offsets near each other share a read."""
        out = []
        cur = _cursor.LogCursor(self, 4096, READ_CHUNK)
        try:
            for off in sorted(offsets):
                try:
                    b = cur.read(off, 1, 0)
                except (OffsetOutOfRange, StorageError):
                    continue
                if b.n and b.first == off:
                    out.append(b.ts_ns(0))
        finally:
            cur.release()
        return out

    def offset_for_time(self, ts_ns: int) -> int:
        """The first offset whose publish time is >= ts_ns (``written`` if none): a
        bisect of a segment's time index and one small read (storage/timeindex.py)."""
        return timeindex.offset_for_time(self, ts_ns)

    # -- segments, retention, durability (storage thread) -----------------------------
    def segments(self) -> list[SegmentInfo]:
        with self.lock:
            return [SegmentInfo(s.base, s.end, s.size, s.max_ts) for s in self._segs]

    def size_bytes(self) -> int:
        with self.lock:
            return sum(s.size for s in self._segs)

    def drop_before(self, offset: int) -> int:
        """Delete whole segments whose records are all below offset (never the active
        one); returns the new ``oldest``."""
        with self.lock:
            gone = []
            while len(self._segs) > 1 and self._segs[0].end <= offset:
                gone.append(self._segs.pop(0))
            if gone:
                self.oldest = self._segs[0].base
            oldest = self.oldest
        for seg in gone:
            try:
                os.unlink(seg.path)
            except OSError as e:
                log.error("%s: cannot delete %s: %s", self, seg.path, e)
        return oldest

    def sync(self) -> int:
        """fsync what is written (rolled segments, the active one, the directory after
        a new segment); returns the offset below which everything is on disk and moves
        ``durable_epoch`` to the newest epoch this fsync covered.

        A failed fsync raises a StorageError whose ``.epoch`` is the newest epoch
        written to the files it covered. Their tail is now unknown (the kernel may have
        dropped the dirty pages and would report the next fsync as a success): every
        written epoch not yet durable is lost (``lost_by``), none of those files is
        fsynced again, and the active segment takes no more writes (the next write
        rolls to a new one)."""
        ops = self.fileops
        with self.lock:
            if self.directory is None:
                return self.written
            if self._must_roll:
                return self._durable_offset     # nothing new can be made durable
            upto, upto_epoch = self.written, self.last_written_epoch
            if upto <= self._durable_offset and upto_epoch <= self.durable_epoch \
                    and not self._to_sync and not self._dir_dirty:
                # nothing written, rolled, cut or created since the last fsync (an idle
                # topic at every checkpoint: no dup, fsync and close of its segment)
                return self._durable_offset
            fds = self._to_sync
            self._to_sync = []
            try:
                active = ops.dup(self._fd) if self._fd is not None else None
            except OSError as e:
                self._to_sync = fds + self._to_sync
                failure = from_oserror("sync", self.directory, e)
                self._lose_unsynced(failure)
                raise failure from None
            dir_dirty, self._dir_dirty = self._dir_dirty, False
        err: OSError | None = None
        for fd in fds + ([active] if active is not None else []):
            if err is None:
                try:
                    ops.fsync(fd)
                except OSError as e:
                    err = e
            try:
                ops.close(fd)
            except OSError:
                pass
        if err is None and dir_dirty:
            try:
                dfd = ops.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    ops.fsync(dfd)
                finally:
                    ops.close(dfd)
            except OSError as e:
                err = e
        if err is not None:
            failure = from_oserror("sync", self.directory, err)
            with self.lock:
                self._lose_unsynced(failure)
            raise failure
        with self.lock:
            self.durable_epoch = max(self.durable_epoch, upto_epoch)
            self._durable_offset = max(self._durable_offset, upto)
            return self._durable_offset

    def lose_unsynced(self, err: StorageError) -> None:
        """Declare every written epoch not yet durable lost, as a failed fsync does (for
        a caller whose sync failed in a way the log did not see)."""
        with self.lock:
            self._lose_unsynced(err)

    def _lose_unsynced(self, err: StorageError) -> None:
        # caller holds the lock
        err.epoch = self.last_written_epoch
        lo, hi = self.durable_epoch + 1, self.last_written_epoch
        if hi >= lo:
            lost = self._lost
            if lost and lost[-1][1] >= lo - 1:
                lost[-1] = (lost[-1][0], hi, err)    # no success in between: one range
            else:
                lost.append((lo, hi, err))
            if len(lost) > MAX_LOST:
                # bounded: the two oldest ranges become one (the epochs between them
                # now count as lost too: a publish may fail that was stored, never the
                # other way round)
                (lo0, _, _), (_, hi1, err1) = lost[0], lost[1]
                lost[0:2] = [(lo0, hi1, err1)]
        if self._fd is not None:
            self._must_roll = True
        for fd in self._to_sync:               # rolled meanwhile: as unknown as the rest
            try:
                self.fileops.close(fd)
            except OSError:
                pass
        self._to_sync = []
        self._dir_dirty = True

    def lost_by(self, epoch: int) -> StorageError | None:
        """The error of the failed fsync that lost this epoch's records, or None."""
        with self.lock:
            lost = self._lost
            i = bisect.bisect_left(lost, epoch, key=lambda r: r[1])
            if i < len(lost) and lost[i][0] <= epoch:
                return lost[i][2]
            return None

    def close(self) -> None:
        with self.lock:
            if self._cut_back is not None and self._segs:
                try:            # the bytes of a failed write: not to be found on reopening
                    self._retry_cut_back(self._segs[-1])
                except StorageError as e:
                    log.error("%s: %s", self, e)
            fds = self._to_sync + ([self._fd] if self._fd is not None else [])
            self._to_sync = []
            self._fd = None
        for fd in fds:
            try:
                self.fileops.close(fd)
            except OSError:
                pass

    def delete(self) -> None:
        """Close and remove the log's directory."""
        self.close()
        if self.directory is not None:
            import shutil  # not at start-up (it loads bz2 and lzma)

            shutil.rmtree(self.directory, ignore_errors=True)


# the reader (it imports the names above; used at call time, so the order is free)
from . import cursor as _cursor  # noqa: E402

__all__ = ["REC_HEADER", "OffsetOutOfRange", "RecordBatch", "SegmentInfo", "TopicLog"]
