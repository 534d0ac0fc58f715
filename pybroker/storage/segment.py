"""The DiskQueue segment file format (version 1): header, record framing, parsing.

Owns bytes <-> records for one segment file; knows nothing of queues, acks or
directories. stdlib only. The format is described in ``diskqueue``'s docstring.
"""
from __future__ import annotations

import enum
import os
import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

MAGIC = b"PBDQ"
FORMAT_VERSION = 1
SEG_HEADER = struct.Struct(">4sHHIQQI")   # magic, version, header_len, flags,
SEG_HEADER_SIZE = SEG_HEADER.size         # file_num, first_seq, crc32 of the rest
REC_HEADER = struct.Struct(">IIQ")        # crc32, length, seq
REC_HEADER_SIZE = REC_HEADER.size         # 16
_LEN_SEQ = struct.Struct(">IQ")
_U32 = struct.Struct(">I")
READ_CHUNK = 256 * 1024
assert SEG_HEADER_SIZE == 32 and REC_HEADER_SIZE == 16


class Stop(enum.Enum):
    """Why :meth:`SegmentReader.parse` stopped."""
    FULL = "max_n records parsed"
    END = "clean end of the readable region"
    TORN = "incomplete record at the end of the region"
    BAD_LENGTH = "impossible record length"
    BAD_CRC = "checksum mismatch"
    BAD_SEQ = "sequence out of order"

    @property
    def is_damage(self) -> bool:
        return self in (Stop.BAD_LENGTH, Stop.BAD_CRC, Stop.BAD_SEQ)


class SegmentHeaderError(ValueError):
    """The first 32 bytes are not a valid segment header."""


class FutureFormatError(SegmentHeaderError):
    """A valid header of a newer format version than this code knows."""


@dataclass(frozen=True, slots=True)
class SegmentHeader:
    file_num: int
    first_seq: int
    version: int = FORMAT_VERSION


def pack_segment_header(file_num: int, first_seq: int) -> bytes:
    body = SEG_HEADER.pack(MAGIC, FORMAT_VERSION, SEG_HEADER_SIZE, 0, file_num,
                           first_seq, 0)[:-4]
    return body + _U32.pack(zlib.crc32(body))


def parse_segment_header(raw: bytes) -> SegmentHeader:
    """Decode a segment header. Raises SegmentHeaderError (or FutureFormatError)."""
    if len(raw) < SEG_HEADER_SIZE:
        raise SegmentHeaderError(f"short header ({len(raw)} bytes)")
    magic, version, hlen, _flags, num, first, crc = SEG_HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise SegmentHeaderError(f"bad magic {magic!r}")
    if zlib.crc32(raw[:SEG_HEADER_SIZE - 4]) != crc:
        raise SegmentHeaderError("header checksum mismatch")
    if version != FORMAT_VERSION or hlen != SEG_HEADER_SIZE:
        raise FutureFormatError(f"unsupported segment format version {version}")
    return SegmentHeader(num, first, version)


def encode_records(records: Iterable[bytes], first_seq: int, out: list[bytes]) -> int:
    """Frame records (seqs first_seq, first_seq+1, ...) into ``out``; return the count.

    Framing: [u32 crc32][u32 length][u64 seq][data], where the crc covers
    length, seq and data, so a zero-filled or shifted region never checks out.
    """
    seq = first_seq
    pack_ls, pack_u32, crc32 = _LEN_SEQ.pack, _U32.pack, zlib.crc32
    append = out.append
    for rec in records:
        ls = pack_ls(len(rec), seq)
        append(pack_u32(crc32(rec, crc32(ls))))
        append(ls)
        append(rec)
        seq += 1
    return seq - first_seq


class SegmentReader:
    """Buffered, checksum-verifying reader over one segment file (owns the fd).

    Owned by whoever holds the queue lock; reads with pread, so the fd's offset
    is never used and a writer may append to the same file concurrently.
    """

    __slots__ = ("_base", "_buf", "_view", "fd", "file_num", "size")

    def __init__(self, path: str, file_num: int) -> None:
        self.fd = os.open(path, os.O_RDONLY)
        self.file_num = file_num
        self.size = os.fstat(self.fd).st_size
        self._buf = b""
        self._view = memoryview(self._buf)
        self._base = 0

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _fill(self, off: int, need: int, limit: int) -> bool:
        want = min(max(READ_CHUNK, need), limit - off)
        data = os.pread(self.fd, want, off)
        self._buf, self._view, self._base = data, memoryview(data), off
        return len(data) >= need

    def parse(self, off: int, limit: int, expect_seq: int, max_n: int, max_len: int,
              collect: bool = True
              ) -> tuple[list[tuple[int, int, bytes]], int, int, Stop]:
        """Parse up to max_n records starting at byte ``off``, not reading past ``limit``.

        Returns (items, next_off, next_seq, stop): items are (seq, offset, data) when
        ``collect`` (else empty); next_off/next_seq point just past the last good
        record; stop says why parsing ended (at next_off for damage or a torn tail).
        Raises OSError only for I/O errors.
        """
        items: list[tuple[int, int, bytes]] = []
        n_done = 0
        unpack, crc32 = REC_HEADER.unpack_from, zlib.crc32
        buf, view, base = self._buf, self._view, self._base
        while n_done < max_n:
            if off >= limit:
                return items, off, expect_seq, Stop.END
            rel = off - base
            if rel < 0 or rel + REC_HEADER_SIZE > len(buf):
                if off + REC_HEADER_SIZE > limit:
                    return items, off, expect_seq, Stop.TORN
                if not self._fill(off, REC_HEADER_SIZE, limit):
                    return items, off, expect_seq, Stop.TORN
                buf, view, base, rel = self._buf, self._view, self._base, 0
            crc, length, seq = unpack(buf, rel)
            if length > max_len:
                return items, off, expect_seq, Stop.BAD_LENGTH
            end = off + REC_HEADER_SIZE + length
            if end > limit:
                return items, off, expect_seq, Stop.TORN
            if rel + REC_HEADER_SIZE + length > len(buf):
                if not self._fill(off, REC_HEADER_SIZE + length, limit):
                    return items, off, expect_seq, Stop.TORN
                buf, view, base, rel = self._buf, self._view, self._base, 0
            if crc32(view[rel + 4:rel + REC_HEADER_SIZE + length]) != crc:
                return items, off, expect_seq, Stop.BAD_CRC
            if seq != expect_seq:
                return items, off, expect_seq, Stop.BAD_SEQ
            if collect:
                items.append((seq, off, buf[rel + REC_HEADER_SIZE:rel + REC_HEADER_SIZE
                                            + length]))
            expect_seq += 1
            n_done += 1
            off = end
        return items, off, expect_seq, Stop.FULL

    def resync(self, off: int, limit: int, expect_seq: int, max_len: int,
               window: int = 4 << 20, tries: int = 64) -> tuple[int, int] | None:
        """After damage at ``off``: find the next intact record, so that one bad record
        costs only itself. Looks for a record of seq expect_seq+1 .. +tries whose
        header and checksum are right, within ``window`` bytes; returns its (offset,
        seq), or None. Raises OSError only for I/O errors."""
        end = min(limit, off + window)
        data = os.pread(self.fd, end - off, off) if end > off else b""
        crc32 = zlib.crc32
        for seq in range(expect_seq + 1, expect_seq + 1 + tries):
            needle = struct.pack(">Q", seq)
            pos = data.find(needle, 1)
            while pos >= 0:
                start = pos - 8
                if start > 0 and start + REC_HEADER_SIZE <= len(data):
                    crc, length, rseq = REC_HEADER.unpack_from(data, start)
                    stop = start + REC_HEADER_SIZE + length
                    if (rseq == seq and length <= max_len and stop <= len(data)
                            and crc32(data[start + 4:stop]) == crc):
                        return off + start, seq
                pos = data.find(needle, pos + 1)
        return None

    def rest_is_zero(self, off: int, limit: int) -> bool:
        """True if bytes [off, limit) are all zero (a power-loss tail, not damage)."""
        while off < limit:
            chunk = os.pread(self.fd, min(READ_CHUNK, limit - off), off)
            if not chunk:
                return True
            if chunk.count(0) != len(chunk):
                return False
            off += len(chunk)
        return True


def read_header(path: str) -> SegmentHeader:
    """Read and decode the header of the segment at path (OSError, SegmentHeaderError)."""
    with open(path, "rb") as f:
        return parse_segment_header(f.read(SEG_HEADER_SIZE))
