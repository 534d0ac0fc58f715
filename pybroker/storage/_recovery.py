"""Opening a DiskQueue directory: segments, meta, tail verification, quarantine.

Owns what happens to files when a queue is opened or damage is found: which
segments exist, whether the last one ends in a torn write (cut off) or damage
(set aside), and moving damaged segments to ``.bad``. stdlib only.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
from dataclasses import dataclass, field

from ._fsutil import fsync_dir, tmp_path, unique_aside, unsafe_name
from ._queuemeta import MetaFormatError, QueueMeta, decode_meta
from .errors import UnsupportedFormatError
from .segment import (
    REC_HEADER_SIZE,
    SEG_HEADER_SIZE,
    FutureFormatError,
    SegmentHeaderError,
    SegmentReader,
    Stop,
    read_header,
)

log = logging.getLogger("pybroker.storage.diskqueue")

SEG_RE = re.compile(r"(\d{8,})\.seg")


def seg_path(qdir: str, num: int) -> str:
    return os.path.join(qdir, f"{num:08d}.seg")


@dataclass
class Recovered:
    """The write-side state found on disk (see DiskQueue for the meaning of fields)."""
    meta: QueueMeta | None = None
    first: dict[int, int] = field(default_factory=dict)
    nums: list[int] = field(default_factory=list)
    ends: dict[int, int] = field(default_factory=dict)
    wfd: int = -1
    wend: int = 0
    need_roll: bool = True
    next_file: int = 0
    next_seq: int = 0


def recover(qdir: str, name: str, max_record: int, max_bytes: int) -> Recovered:
    """Open (creating if needed) a queue directory and repair what a crash left.

    Raises OSError, or UnsupportedFormatError for a segment of a newer format.
    """
    if not os.path.isdir(qdir):
        os.makedirs(qdir, exist_ok=True)
        fsync_dir(os.path.dirname(qdir) or ".")
    nums = []
    for entry in os.listdir(qdir):
        if entry.endswith(".tmp"):
            os.unlink(os.path.join(qdir, entry))
        elif m := SEG_RE.fullmatch(entry):
            nums.append(int(m.group(1)))
    rec = Recovered(meta=_load_meta(qdir, name))
    nums.sort()
    for i, num in enumerate(nums):
        _add_existing(rec, qdir, name, num, is_last=(i == len(nums) - 1))
    rec.next_file = max(rec.nums, default=-1) + 1
    meta = rec.meta
    if meta is not None:
        rec.next_seq = meta.next_seq
        if meta.write is not None:
            rec.next_file = max(rec.next_file, meta.write[0] + 1)
        if meta.start is not None:
            rec.next_file = max(rec.next_file, meta.start[0])
    if rec.nums:
        _open_tail(rec, qdir, name, max_record, max_bytes)
    return rec


def _load_meta(qdir: str, name: str) -> QueueMeta | None:
    path = os.path.join(qdir, "meta")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    try:
        return decode_meta(raw)
    except MetaFormatError as e:
        aside = unique_aside(path, ".bad")
        os.replace(path, aside)
        log.error("DISKQUEUE(%s) damaged meta file (%s), moved to %s; every record "
                  "on disk will be delivered again", name, e, aside)
        return None


def _add_existing(rec: Recovered, qdir: str, name: str, num: int, is_last: bool) -> None:
    path = seg_path(qdir, num)
    try:
        hdr = read_header(path)
        if hdr.file_num != num:
            raise SegmentHeaderError(f"header names file {hdr.file_num}")
        if rec.nums and hdr.first_seq < rec.first[rec.nums[-1]]:
            raise SegmentHeaderError("first seq goes backwards")
    except FutureFormatError as e:
        raise UnsupportedFormatError(f"{path}: {e}; not touching it", path=path) from e
    except SegmentHeaderError as e:
        size = os.path.getsize(path)
        if is_last and size <= SEG_HEADER_SIZE:
            log.warning("DISKQUEUE(%s) removing torn new segment %s", name, path)
            os.unlink(path)
        else:
            aside = unique_aside(path, ".bad")
            os.replace(path, aside)
            log.error("DISKQUEUE(%s) bad segment header in %s (%s), moved to %s",
                      name, path, e, aside)
        return
    rec.first[num] = hdr.first_seq
    rec.nums.append(num)
    if not is_last:
        rec.ends[num] = os.path.getsize(path)


def _open_tail(rec: Recovered, qdir: str, name: str, max_record: int,
               max_bytes: int) -> None:
    """Verify the last segment from the checkpoint's write hint; cut a torn tail."""
    num = rec.nums[-1]
    path = seg_path(qdir, num)
    first = rec.first[num]
    reader = SegmentReader(path, num)
    try:
        size = reader.size
        hint = rec.meta.write if rec.meta is not None else None
        off, seq = SEG_HEADER_SIZE, first
        if hint and hint[0] == num and SEG_HEADER_SIZE <= hint[1] <= size:
            off, seq = hint[1], hint[2]
        _, end, nseq, stop = reader.parse(off, size, seq, 1 << 62, max_record,
                                          collect=False)
        if stop.is_damage and end == off and (off, seq) != (SEG_HEADER_SIZE, first):
            _, end, nseq, stop = reader.parse(SEG_HEADER_SIZE, size, first, 1 << 62,
                                              max_record, collect=False)
        torn = stop is Stop.TORN or (stop.is_damage and looks_torn(reader, end, size))
    finally:
        reader.close()
    rec.next_seq = max(rec.next_seq, nseq)
    if stop.is_damage and not torn:
        # Seqs are never reused: skip past any record the damaged bytes could hold.
        rec.next_seq = max(rec.next_seq, nseq + (size - end) // REC_HEADER_SIZE + 1)
        quarantine(qdir, name, num, end, stop)
        rec.ends[num] = end
        return
    rec.wfd = os.open(path, os.O_WRONLY)
    if end < size:
        log.warning("DISKQUEUE(%s) torn write at the end of %s: cut off %d bytes",
                    name, path, size - end)
        os.ftruncate(rec.wfd, end)
    rec.wend = end
    rec.need_roll = nseq != rec.next_seq or end >= max_bytes


def looks_torn(reader: SegmentReader, off: int, size: int) -> bool:
    """A bad record at the very end (or followed only by zeros) is a torn write."""
    if reader.rest_is_zero(off, size):
        return True
    head = os.pread(reader.fd, REC_HEADER_SIZE, off)
    if len(head) < REC_HEADER_SIZE:
        return True
    length = int.from_bytes(head[4:8], "big")
    return off + REC_HEADER_SIZE + length == size


def quarantine(qdir: str, name: str, num: int, good_end: int, why: Stop) -> None:
    """Keep [0, good_end) of segment num under its name; the original goes to .bad.

    Best effort: an OSError is logged, never raised (read paths must not fail).
    """
    path = seg_path(qdir, num)
    aside = unique_aside(path, ".bad")
    tmp = tmp_path(path)
    try:
        src = os.open(path, os.O_RDONLY)
        try:
            dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                off = 0
                while off < good_end:
                    chunk = os.pread(src, min(1 << 20, good_end - off), off)
                    if not chunk:
                        break
                    os.write(dst, chunk)
                    off += len(chunk)
                os.fsync(dst)
            finally:
                os.close(dst)
        finally:
            os.close(src)
        try:
            os.link(path, aside)
        except OSError:
            shutil.copyfile(path, aside)
        os.replace(tmp, path)
        fsync_dir(qdir)
        log.error("DISKQUEUE(%s) %s at offset %d of %s: kept the %d bytes before it, "
                  "the damaged segment is saved as %s; reading goes on with the next "
                  "segment", name, why.value, good_end, path, good_end, aside)
    except OSError as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        log.error("DISKQUEUE(%s) %s at offset %d of %s; could not set it aside (%s); "
                  "skipping the rest of it", name, why.value, good_end, path, e)


def list_queues(root: str | os.PathLike[str]) -> list[str]:
    """Names of the queues stored under root (read from their meta when hashed)."""
    out = []
    try:
        entries = sorted(os.listdir(root))
    except FileNotFoundError:
        return []
    for entry in entries:
        full = os.path.join(root, entry)
        if entry.startswith(".") or not os.path.isdir(full):
            continue
        name = unsafe_name(entry)
        if name is None:
            try:
                with open(os.path.join(full, "meta"), "rb") as f:
                    name = decode_meta(f.read()).name
            except (OSError, MetaFormatError):
                continue
        out.append(name)
    return out


def keep_copy(qdir: str, num: int) -> None:
    """Copy segment num aside as ``.bad`` (damage that reading skipped over), once.

    Best effort: an OSError is logged, never raised (read paths must not fail).
    """
    path = seg_path(qdir, num)
    if os.path.exists(path + ".bad"):
        return
    try:
        shutil.copyfile(path, unique_aside(path, ".bad"))
    except OSError as e:
        log.error("cannot keep a copy of damaged segment %s: %s", path, e)
