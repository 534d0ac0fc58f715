"""Writing pybroker's earlier per-queue format (read by pybroker.storage.oldqueues) for
the migration tests: segment files and an optional meta file, as that format had them."""
from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

from pybroker.storage._fsutil import safe_name

SEG_HEADER = struct.Struct(">4sHHIQQI")


def segment(records: list[bytes], file_num: int = 0, first_seq: int = 0) -> bytes:
    head = SEG_HEADER.pack(b"PBDQ", 1, 32, 0, file_num, first_seq, 0)[:-4]
    out = [head, struct.pack(">I", zlib.crc32(head))]
    for seq, rec in enumerate(records, first_seq):
        ls = struct.pack(">IQ", len(rec), seq)
        out += [struct.pack(">I", zlib.crc32(rec, zlib.crc32(ls))), ls, rec]
    return b"".join(out)


def write_queue(root: Path, name: str, segments: list[list[bytes]],
                meta: dict[str, object] | None = None) -> Path:
    """One queue: segments of consecutive records (seqs from 0), and meta if given."""
    qdir = root / safe_name(name)
    qdir.mkdir(parents=True, exist_ok=True)
    seq = 0
    for num, recs in enumerate(segments):
        (qdir / f"{num:08d}.seg").write_bytes(segment(recs, num, seq))
        seq += len(recs)
    if meta is not None:
        doc = {"format": 1, "name": name, "next_seq": seq, "frontier": 0, "start": None,
               "unacked": [], "write": None, "skip": []}
        doc.update(meta)
        (qdir / "meta").write_text(json.dumps(doc))
    return qdir
