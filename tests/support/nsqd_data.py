"""Write an nsqd 1.x data directory following the documented formats, for import tests.

Independent of pybroker.storage.nsqd_import (so a misreading cannot cancel itself out):
- ``nsqd.dat`` (or the old ``nsqd.<id>.dat``): ``{"topics":[{"name","paused",
  "channels":[{"name","paused"}]}],"version":"1.3.0"}``;
- go-diskqueue 1.1.0 files ``<name>.diskqueue.%06d.dat`` holding ``[int32 BE size][data]``,
  rolled *before* a record would push a file past max_bytes_per_file; a reader that
  finishes a complete file deletes it and moves to (next file, 0);
- ``<name>.diskqueue.meta.dat``: ``"%d\\n%d,%d\\n%d,%d\\n"`` % (depth, readFileNum,
  readPos, writeFileNum, writePos);
- message data ``[int64 BE ts_ns][uint16 BE attempts][16-byte id][body]``.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path


def msg_id(n: int) -> bytes:
    """A 16-byte ASCII-hex message id, as nsqd makes them."""
    return f"{n:016x}".encode()


def encode_message(mid: bytes, ts_ns: int, attempts: int, body: bytes) -> bytes:
    assert len(mid) == 16
    return (ts_ns.to_bytes(8, "big", signed=True) + attempts.to_bytes(2, "big")
            + mid + body)


@dataclass
class FakeGoDiskQueue:
    """Writes one go-diskqueue's files like go-diskqueue 1.1.0's writeOne/moveForward."""
    data_path: Path
    name: str
    max_bytes_per_file: int = 100 * 1024 * 1024
    read_file: int = 0
    read_pos: int = 0
    write_file: int = 0
    write_pos: int = 0
    depth: int = 0
    _ends: list[tuple[int, int]] = field(default_factory=list)   # (file, end) per record

    def path(self, num: int) -> Path:
        return self.data_path / f"{self.name}.diskqueue.{num:06d}.dat"

    def put(self, data: bytes) -> None:
        total = 4 + len(data)
        if self.write_pos > 0 and self.write_pos + total > self.max_bytes_per_file:
            self.write_file += 1
            self.write_pos = 0
        with open(self.path(self.write_file), "ab") as f:
            f.write(len(data).to_bytes(4, "big", signed=True) + data)
        self.write_pos += total
        self.depth += 1
        self._ends.append((self.write_file, self.write_pos))

    def consume(self, n: int) -> None:
        """Advance the read position past the next n records, as nsqd's reader does."""
        for _ in range(n):
            f, end = self._ends.pop(0)
            self.depth -= 1
            complete = f < self.write_file
            if complete and end >= self.path(f).stat().st_size:
                self.path(f).unlink()
                self.read_file, self.read_pos = f + 1, 0
            else:
                self.read_file, self.read_pos = f, end

    def write_meta(self) -> None:
        text = (f"{self.depth}\n{self.read_file},{self.read_pos}\n"
                f"{self.write_file},{self.write_pos}\n")
        (self.data_path / f"{self.name}.diskqueue.meta.dat").write_text(text)

    def record_offset(self, index_from_read: int) -> tuple[Path, int]:
        """(file, offset of the size field) of the index-th pending record."""
        f = self._ends[index_from_read][0]
        if index_from_read > 0 and self._ends[index_from_read - 1][0] == f:
            return self.path(f), self._ends[index_from_read - 1][1]
        if index_from_read == 0 and f == self.read_file:
            return self.path(f), self.read_pos
        return self.path(f), 0


def write_metadata(data_path: Path, topics: list[dict[str, object]],
                   filename: str = "nsqd.dat", version: str = "1.3.0") -> Path:
    """Write the metadata JSON exactly as nsqd 1.3 marshals it."""
    path = data_path / filename
    path.write_text(json.dumps({"topics": topics, "version": version},
                               separators=(",", ":")))
    return path


def topic_entry(name: str, paused: bool = False,
                channels: list[tuple[str, bool]] | None = None) -> dict[str, object]:
    chans = None if channels is None else [{"name": c, "paused": p} for c, p in channels]
    return {"name": name, "paused": paused, "channels": chans}


def corrupt_size(path: Path, offset: int, size: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(size.to_bytes(4, "big", signed=True))


def truncate_by(path: Path, nbytes: int) -> None:
    os.truncate(path, path.stat().st_size - nbytes)
