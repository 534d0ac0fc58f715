"""TopicLog (interim pure-Python version; see docs/storage.md for the format)."""
from __future__ import annotations

import bisect
import logging
import os
import shutil
import struct
import threading
import zlib
from collections import deque
from dataclasses import dataclass

from .errors import StorageError, from_oserror

log = logging.getLogger("pybroker.storage.topiclog")
_HDR = struct.Struct(">IIQ")
_PAY = struct.Struct(">qqH16s")
HDR = 16
MAGIC = b"PBLG\x00\x01"


class OffsetOutOfRange(ValueError):
    pass


@dataclass
class SegmentInfo:
    base: int
    end: int
    size_bytes: int
    max_ts_ns: int


def _record(off: int, deliver_at: int, ts: int, attempts: int, body: bytes) -> bytes:
    payload = _PAY.pack(deliver_at, ts, attempts, b"%016x" % off) + body
    head = struct.pack(">IQ", len(payload), off)
    return struct.pack(">I", zlib.crc32(payload, zlib.crc32(head))) + head + payload


class RecordBatch:
    def __init__(self, first: int, recs: list[bytes]) -> None:
        self.first = first
        self.n = len(recs)
        self.recs = recs

    def frames(self, i: int, j: int, attempts: int | None = None) -> bytes:
        out = []
        for r in self.recs[i:j]:
            body = r[24:]
            a = attempts if attempts is not None else int.from_bytes(r[32:34], "big") + 1
            out.append(struct.pack(">iiqH", len(body) + 4, 2, int.from_bytes(r[24:32], "big", signed=True), a)
                       + body[10:])
        return b"".join(out)

    def deferred_indices(self, count: int) -> list[int]:
        return [i for i in range(min(count, self.n)) if self.recs[i][16:24] != b"\0" * 8]

    def deliver_at(self, i: int) -> int:
        return int.from_bytes(self.recs[i][16:24], "big", signed=True)

    def stored_attempts(self, i: int) -> int:
        return int.from_bytes(self.recs[i][32:34], "big")

    def ts_ns(self, i: int) -> int:
        return int.from_bytes(self.recs[i][24:32], "big", signed=True)


class _Seg:
    def __init__(self, path: str, base: int) -> None:
        self.path = path
        self.base = base
        self.end = base
        self.size = 0
        self.max_ts = 0
        self.index: list[tuple[int, int]] = []   # (offset, pos)


class TopicLog:
    def __init__(self, directory: str | None, *, max_bytes_per_file: int, mem_records: int,
                 max_record_bytes: int) -> None:
        self.directory = directory
        self.max_bytes = max_bytes_per_file
        self.mem_records = mem_records
        self.max_record_bytes = max_record_bytes
        self.lock = threading.Lock()
        self.head = self.written = self.oldest = 0
        self._pending: list[bytes] = []
        self._pending_first = 0
        self._tail: deque[tuple[int, list[bytes]]] = deque()
        self._tail_n = 0
        self.tail_start = 0
        self._segs: list[_Seg] = []
        self._fd: int | None = None
        self._synced = 0
        if directory is not None:
            os.makedirs(directory, exist_ok=True)
            self._recover()

    def _recover(self) -> None:
        assert self.directory is not None
        names = sorted(n for n in os.listdir(self.directory) if n.endswith(".log"))
        for n in names:
            path = os.path.join(self.directory, n)
            seg = _Seg(path, int(n[:-4]))
            with open(path, "rb") as f:
                data = f.read()
            pos, off = 0, seg.base
            good = 0
            while pos + HDR <= len(data):
                crc, ln, o = _HDR.unpack_from(data, pos)
                if pos + HDR + ln > len(data) or o != off:
                    break
                if zlib.crc32(data[pos + HDR:pos + HDR + ln], zlib.crc32(data[pos + 4:pos + HDR])) != crc:
                    break
                if (off - seg.base) % 1000 == 0:
                    seg.index.append((off, pos))
                seg.max_ts = max(seg.max_ts, int.from_bytes(data[pos + 24:pos + 32], "big", signed=True))
                pos += HDR + ln
                off += 1
                good = pos
            if good < len(data):
                with open(path, "r+b") as f:
                    f.truncate(good)
            seg.end = off
            seg.size = good
            self._segs.append(seg)
        if self._segs:
            self.oldest = self._segs[0].base
            self.head = self.written = self._synced = self._segs[-1].end
            self.tail_start = self.head
            self._fd = os.open(self._segs[-1].path, os.O_WRONLY | os.O_APPEND)

    # -- write side
    def append(self, bodies: list[bytes], ts_ns: int, deliver_at_ns: int = 0) -> int:
        return self.append_records([(ts_ns, 0, b, deliver_at_ns) for b in bodies])

    def append_records(self, items: list[tuple[int, int, bytes, int]]) -> int:
        first = self.head
        if not self._pending:
            self._pending_first = first
        off = first
        for ts, attempts, body, deliver_at in items:
            self._pending.append(_record(off, deliver_at, ts, attempts, body))
            off += 1
        self.head = off
        return first

    def discard_pending(self) -> None:
        self._pending = []
        self.head = self._pending_first if self._pending else self.written
        self.head = self.written

    def write_pending(self) -> int:
        if not self._pending:
            return self.written
        recs = self._pending
        first = self._pending_first
        if self.directory is not None:
            data = b"".join(recs)
            seg = self._segs[-1] if self._segs else None
            if seg is None or (seg.size and seg.size + len(data) > self.max_bytes):
                seg = self._new_segment(first)
            assert self._fd is not None
            try:
                n = os.write(self._fd, data)
                if n != len(data):
                    raise OSError(28, "short write")
            except OSError as e:
                try:
                    os.ftruncate(self._fd, seg.size)
                except OSError:
                    pass
                raise from_oserror(e, seg.path) from None
            seg.index.append((first, seg.size))
            seg.size += len(data)
            seg.end = first + len(recs)
            seg.max_ts = max(seg.max_ts, int.from_bytes(recs[-1][24:32], "big", signed=True))
        self._pending = []
        self._tail.append((first, recs))
        self._tail_n += len(recs)
        while len(self._tail) > 1 and self._tail_n - len(self._tail[0][1]) >= self.mem_records:
            _, old = self._tail.popleft()
            self._tail_n -= len(old)
        if self._tail_n > self.mem_records and self.directory is None:
            # ephemeral: keep only the newest mem_records
            f, r = self._tail[0]
            cut = self._tail_n - self.mem_records
            self._tail[0] = (f + cut, r[cut:])
            self._tail_n -= cut
        self.tail_start = self._tail[0][0]
        if self.directory is None:
            self.oldest = self.tail_start
        self.written = first + len(recs)
        return self.written

    def _new_segment(self, base: int) -> _Seg:
        assert self.directory is not None
        path = os.path.join(self.directory, "%020d.log" % base)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as e:
            raise from_oserror(e, path) from None
        if self._fd is not None:
            os.close(self._fd)
        self._fd = fd
        seg = _Seg(path, base)
        seg.end = base
        self._segs.append(seg)
        return seg

    # -- read side
    def read(self, offset: int, max_records: int, max_bytes: int) -> RecordBatch:
        with self.lock:
            if offset < self.oldest or offset > self.written:
                raise OffsetOutOfRange(offset)
            if offset == self.written:
                return RecordBatch(offset, [])
            if offset >= self.tail_start:
                out: list[bytes] = []
                for first, recs in self._tail:
                    if first + len(recs) <= offset:
                        continue
                    i = max(0, offset + len(out) - first)
                    out.extend(recs[i:i + max_records - len(out)])
                    if len(out) >= max_records:
                        break
                return RecordBatch(offset, out)
            bases = [s.base for s in self._segs]
            k = bisect.bisect_right(bases, offset) - 1
            seg = self._segs[k]
            idx = seg.index[bisect.bisect_right(seg.index, (offset, 1 << 62)) - 1] if seg.index else (seg.base, 0)
            path, end = seg.path, seg.end
        out = []
        with open(path, "rb") as f:
            f.seek(idx[1])
            off = idx[0]
            size = 0
            while off < end and len(out) < max_records and size < max_bytes:
                h = f.read(HDR)
                if len(h) < HDR:
                    break
                crc, ln, o = _HDR.unpack(h)
                payload = f.read(ln)
                if off >= offset:
                    out.append(h + payload)
                    size += len(h) + ln
                off += 1
        return RecordBatch(offset, out)

    def payload(self, offset: int) -> bytes | None:
        b = self.read(offset, 1, 1 << 30)
        return b.recs[0][16:] if b.n else None

    def timestamps(self, offsets: list[int]) -> list[int]:
        out = []
        for off in offsets:
            try:
                b = self.read(off, 1, 1 << 30)
            except OffsetOutOfRange:
                continue
            if b.n:
                out.append(b.ts_ns(0))
        return out

    def offset_for_time(self, ts_ns: int) -> int:
        off = self.oldest
        while off < self.written:
            b = self.read(off, 1000, 1 << 30)
            for i in range(b.n):
                if b.ts_ns(i) >= ts_ns:
                    return off + i
            off += b.n
            if not b.n:
                break
        return self.written

    def segments(self) -> list[SegmentInfo]:
        with self.lock:
            return [SegmentInfo(s.base, s.end, s.size, s.max_ts) for s in self._segs]

    def size_bytes(self) -> int:
        return sum(s.size for s in self._segs)

    def drop_before(self, offset: int) -> int:
        with self.lock:
            while len(self._segs) > 1 and self._segs[0].end <= offset:
                seg = self._segs.pop(0)
                try:
                    os.unlink(seg.path)
                except OSError:
                    pass
            if self._segs:
                self.oldest = max(self.oldest, self._segs[0].base)
            return self.oldest

    def sync(self) -> int:
        with self.lock:
            fd = os.dup(self._fd) if self._fd is not None else None
            w = self.written
        if fd is not None:
            try:
                os.fsync(fd)
            except OSError as e:
                raise from_oserror(e, self.directory or "") from None
            finally:
                os.close(fd)
        self._synced = w
        return w

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def delete(self) -> None:
        self.close()
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)


__all__ = ["TopicLog", "RecordBatch", "OffsetOutOfRange", "SegmentInfo", "StorageError"]
