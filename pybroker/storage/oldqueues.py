"""Read pybroker's earlier on-disk queues (``<data_path>/queues/``), read-only, once.

Before topic logs, pybroker kept one disk queue per topic and per channel. The broker
moves them into topic logs at start-up (pybroker/server/importer.py) and then moves
the directory aside; this module is all that is left of that format: it lists the
queues and yields each queue's records that were not acknowledged. stdlib only.

Format (version 1), one directory per queue (the name percent-encoded, see
_fsutil.safe_name; a hashed long name is read from ``meta``):

- ``%08d.seg``: a 32-byte header ``>4sHHIQQI`` (magic ``PBDQ``, version 1, header
  length 32, flags, file number, first seq, crc32 of the 28 bytes before it), then
  records ``[u32 crc32][u32 length][u64 seq][data]`` (big-endian; the crc32 covers
  length, seq and data; seqs within a segment are consecutive).
- ``meta`` (JSON, format 1, optional): ``frontier`` (every seq below it not listed in
  ``unacked`` was acknowledged), ``unacked`` and ``skip`` (seqs at or past the frontier
  that were acknowledged) as sorted ``[lo, hi)`` ranges.

A record is pending when it is in ``unacked``, or at or past ``frontier`` and not in
``skip``. Damage (a bad header, checksum, length or seq) is logged and costs the rest
of that segment; reading goes on with the next segment.
"""
from __future__ import annotations

import json
import logging
import os
import struct
import zlib
from collections.abc import Iterator

from ._fsutil import unsafe_name

log = logging.getLogger("pybroker")
MAGIC = b"PBDQ"
SEG_HEADER = struct.Struct(">4sHHIQQI")
REC_HEADER = struct.Struct(">IIQ")


def _ranges(raw: object) -> list[tuple[int, int]]:
    if not isinstance(raw, list):
        return []
    return [(int(r[0]), int(r[1])) for r in raw
            if isinstance(r, list) and len(r) == 2]


def _in(ranges: list[tuple[int, int]], seq: int) -> bool:
    return any(lo <= seq < hi for lo, hi in ranges)


class _Meta:
    def __init__(self, doc: dict[str, object]) -> None:
        name = doc.get("name")
        self.name = name if isinstance(name, str) else None
        frontier = doc.get("frontier", 0)
        self.frontier = frontier if isinstance(frontier, int) else 0
        self.unacked = _ranges(doc.get("unacked", []))
        self.skip = _ranges(doc.get("skip", []))

    def pending(self, seq: int) -> bool:
        if seq < self.frontier:
            return _in(self.unacked, seq)
        return not _in(self.skip, seq)


def _read_meta(qdir: str) -> _Meta:
    try:
        with open(os.path.join(qdir, "meta"), "rb") as f:
            doc = json.loads(f.read())
    except FileNotFoundError:
        return _Meta({})
    except (OSError, ValueError) as e:
        log.error("NSQ: migrate: %s: unreadable meta (%s): every record is taken", qdir, e)
        return _Meta({})
    if not isinstance(doc, dict) or doc.get("format") != 1:
        log.error("NSQ: migrate: %s: unknown meta format: every record is taken", qdir)
        return _Meta({})
    return _Meta(doc)


def list_queues(root: str | os.PathLike[str]) -> dict[str, str]:
    """The queues under root: queue name -> its directory."""
    out: dict[str, str] = {}
    try:
        entries = sorted(os.listdir(root))
    except FileNotFoundError:
        return out
    for entry in entries:
        full = os.path.join(root, entry)
        if entry.startswith(".") or not os.path.isdir(full):
            continue
        name = unsafe_name(entry) or _read_meta(full).name
        if name:
            out[name] = full
    return out


def _segment_records(path: str) -> Iterator[tuple[int, bytes]]:
    """(seq, data) of one segment file's intact records, in order."""
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < SEG_HEADER.size:
        return
    magic, version, hlen, _, _, first_seq, crc = SEG_HEADER.unpack_from(raw)
    if magic != MAGIC or version != 1 or hlen != SEG_HEADER.size \
            or zlib.crc32(raw[:SEG_HEADER.size - 4]) != crc:
        log.error("NSQ: migrate: %s: not a segment of the earlier format: skipped", path)
        return
    off, seq = SEG_HEADER.size, first_seq
    while off + REC_HEADER.size <= len(raw):
        rcrc, length, rseq = REC_HEADER.unpack_from(raw, off)
        end = off + REC_HEADER.size + length
        if end > len(raw):
            break   # a torn write at the end
        data = raw[off + REC_HEADER.size:end]
        if rseq != seq or zlib.crc32(data, zlib.crc32(raw[off + 4:off + 16])) != rcrc:
            if not any(raw[off:]):
                break   # zeros after the last record
            log.error("NSQ: migrate: %s: damaged record at byte %d: the rest of this "
                      "segment is skipped", path, off)
            return
        yield seq, data
        off, seq = end, seq + 1


def pending_records(qdir: str) -> Iterator[bytes]:
    """The records of one queue directory that were not acknowledged, in order."""
    meta = _read_meta(qdir)
    segs = sorted(e for e in os.listdir(qdir) if e.endswith(".seg"))
    for seg in segs:
        for seq, data in _segment_records(os.path.join(qdir, seg)):
            if meta.pending(seq):
                yield data
