"""The DiskQueue meta file ("meta", JSON, format 1): the persisted read state.

Owns encoding/decoding of the read state and the seq-range compression of the
un-acked set; the file is replaced atomically by the queue. stdlib only.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field

META_FORMAT = 1


class MetaFormatError(ValueError):
    """The meta file is not valid (damaged or hand-edited)."""


@dataclass(slots=True)
class QueueMeta:
    """What a checkpoint persists (see diskqueue's docstring for the invariants).

    next_seq: the seq the next put will get (a floor: seqs never go backwards).
    frontier: every seq < frontier that is not in ``unacked`` has been acked.
    start: (file_num, offset, seq) where reading resumes: the first un-acked record.
    unacked: seqs < frontier handed out but not acked, as sorted [lo, hi) ranges.
    write: (file_num, offset, seq) of the write end at the checkpoint, a hint that
        lets open() verify the tail from there instead of from the segment start.
    skip: seqs >= frontier that are done (claimed ahead of unread records, then
        acked), as sorted [lo, hi) ranges.
    """

    name: str
    next_seq: int = 0
    frontier: int = 0
    start: tuple[int, int, int] | None = None
    unacked: list[tuple[int, int]] = field(default_factory=list)
    write: tuple[int, int, int] | None = None
    skip: list[tuple[int, int]] = field(default_factory=list)


def to_ranges(seqs: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted distinct seqs -> [lo, hi) ranges (input must be ascending)."""
    out: list[tuple[int, int]] = []
    lo = hi = -1
    for s in seqs:
        if s == hi:
            hi += 1
            continue
        if hi >= 0:
            out.append((lo, hi))
        lo, hi = s, s + 1
    if hi >= 0:
        out.append((lo, hi))
    return out


def from_ranges(ranges: Iterable[tuple[int, int]]) -> set[int]:
    out: set[int] = set()
    for lo, hi in ranges:
        out.update(range(lo, hi))
    return out


def encode_meta(meta: QueueMeta) -> bytes:
    doc = {
        "format": META_FORMAT,
        "name": meta.name,
        "next_seq": meta.next_seq,
        "frontier": meta.frontier,
        "start": list(meta.start) if meta.start else None,
        "unacked": [list(r) for r in meta.unacked],
        "write": list(meta.write) if meta.write else None,
        "skip": [list(r) for r in meta.skip],
    }
    return json.dumps(doc, separators=(",", ":")).encode() + b"\n"


def _int(v: object, what: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise MetaFormatError(f"{what} must be a non-negative integer, got {v!r}")
    return v


def _triple(v: object, what: str) -> tuple[int, int, int] | None:
    if v is None:
        return None
    if not isinstance(v, list) or len(v) != 3:
        raise MetaFormatError(f"{what} must be [file, offset, seq], got {v!r}")
    return (_int(v[0], what), _int(v[1], what), _int(v[2], what))


def decode_meta(raw: bytes) -> QueueMeta:
    """Parse and validate a meta file. Raises MetaFormatError."""
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise MetaFormatError(f"not JSON: {e}") from e
    if not isinstance(doc, dict):
        raise MetaFormatError("not a JSON object")
    if doc.get("format") != META_FORMAT:
        raise MetaFormatError(f"unknown meta format {doc.get('format')!r}")
    name = doc.get("name")
    if not isinstance(name, str):
        raise MetaFormatError("name missing")
    ranges = _ranges(doc.get("unacked", []), "unacked")
    skip = _ranges(doc.get("skip", []), "skip")
    meta = QueueMeta(name=name, next_seq=_int(doc.get("next_seq"), "next_seq"),
                     frontier=_int(doc.get("frontier"), "frontier"),
                     start=_triple(doc.get("start"), "start"), unacked=ranges,
                     write=_triple(doc.get("write"), "write"), skip=skip)
    if meta.frontier > meta.next_seq or (ranges and ranges[-1][1] > meta.frontier) \
            or (skip and (skip[0][0] < meta.frontier or skip[-1][1] > meta.next_seq)):
        raise MetaFormatError("frontier/unacked/skip inconsistent with next_seq")
    return meta


def _ranges(raw: object, what: str) -> list[tuple[int, int]]:
    if not isinstance(raw, list):
        raise MetaFormatError(f"{what} must be a list")
    out: list[tuple[int, int]] = []
    prev = -1
    for r in raw:
        if not isinstance(r, list) or len(r) != 2:
            raise MetaFormatError(f"bad {what} range {r!r}")
        lo, hi = _int(r[0], what), _int(r[1], what)
        if lo >= hi or lo < prev:
            raise MetaFormatError(f"{what} ranges not sorted: {r!r}")
        prev = hi
        out.append((lo, hi))
    return out
