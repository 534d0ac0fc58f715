"""A topic's saved channel states written as changes (docs/storage.md, "Saved states
written as changes"): ``state/<topic>.json`` holds a whole state, as before, and
``state/<topic>.journal`` beside it the changes since, so that a checkpoint of a
changed state writes what changed, not the whole file (35 MB with 1,000,000 deferred
messages, at every checkpoint while a consumer defers a few more).

The states are encoded with ``jsonvalue.dumps_keyed``: in pieces (a chunk of deferred
messages each), with the *ops* that make them from the pieces of the encoding before.
The journal is a run of records, ``[u32 length][u32 crc32][body]``, the body
``[u64 base crc][u64 base size][u64 gen][u64 prev][u32 n][n x i64 ops][new pieces]``:

- the first (``prev`` = 0) names the whole file it follows (its crc32 and size) and how
  it is cut into pieces (ops of new pieces only; their bytes are the file's);
- each next one makes the pieces of encoding ``gen`` from those of ``prev`` (the record
  before) and its new pieces.

Reading (``load``): the file, then the journal's records in order while each is whole
(length and crc), follows the one before and names this very file; what follows the
first that is not is ignored (a torn last write, a crash). A journal that names another
file (the file was rewritten and the crash came before the new journal) is ignored.
Either way the state read is one that was written whole and synced: an older one only
repeats deliveries.

Writing (``StateWriter.save``): a change is appended to the journal and synced when
the journal has a record for the encoding before, holds fewer than MAX_RECORDS and,
with it, at most half the file's size (or MIN_JOURNAL); else the whole file is written
again (temp file, fsync, rename, directory fsync) and then a new journal naming it.
A state of more than MAX_PIECES pieces is always written whole (its journal would be
16 bytes a piece). A failed append leaves the journal unusable until the next whole
write. Budgets: on the storage thread; reading at start-up applies at most MAX_RECORDS
records of at most MAX_PIECES ops each.
"""
from __future__ import annotations

import logging
import os
import struct
import zlib
from collections.abc import Iterator, Sequence

from pybroker.jsonvalue import Keyed, Piece, apply_ops
from pybroker.storage._fsutil import atomic_write, pwrite_all
from pybroker.storage.fileops import REAL, FileOps

log = logging.getLogger("pybroker")

SUFFIX = ".journal"
# changes appended before the whole file is written again (start-up reads them all:
# each a few pieces' ops; the journal's bytes are the tighter limit for a large state)
MAX_RECORDS = 1024
MIN_JOURNAL = 1 << 20       # a journal may grow to this, or half its file's size
MAX_PIECES = 16_384         # a state of more pieces is written whole
_REC = struct.Struct(">II")
_HEAD = struct.Struct(">QQQQI")


def _record(base_crc: int, base_size: int, gen: int, prev: int, ops: Sequence[int],
            data: Sequence[Piece]) -> list[Piece]:
    body = [_HEAD.pack(base_crc, base_size, gen, prev, len(ops)),
            struct.pack(f">{len(ops)}q", *ops), *data]
    crc = 0
    size = 0
    for p in body:
        crc = zlib.crc32(p, crc)
        size += len(p)
    return [_REC.pack(size, crc), *body]


def _whole_ops(pieces: Sequence[Piece]) -> list[int]:
    return [x for p in pieces for x in (-1, len(p))]


class StateWriter:
    """Writes one topic's states (on the storage thread): the changes when it can,
    else the whole file and a new journal."""

    def __init__(self, path: str, fileops: FileOps = REAL) -> None:
        self.path = path
        self.journal = path + SUFFIX
        self.fileops = fileops
        self.gen = 0            # the encoding the journal ends with (0: none usable)
        self.base_crc = 0
        self.base_size = 0
        self.records = 0
        self.bytes = 0          # the journal's size

    def save(self, keyed: Keyed) -> bool:
        """Write the state ``keyed`` (encoded by dumps_keyed with this topic's memory);
        True when it was appended to the journal, False when written whole. Raises
        OSError (then the next save writes the whole file)."""
        if self.gen and keyed.base == self.gen and self.records < MAX_RECORDS \
                and len(keyed.pieces) <= MAX_PIECES:
            rec = _record(self.base_crc, self.base_size, keyed.gen, keyed.base,
                          keyed.ops, keyed.literals)
            size = sum(map(len, rec))
            if self.bytes + size <= max(MIN_JOURNAL, self.base_size // 2):
                self.gen = 0            # unusable unless the append completes
                self._append(rec)
                self.gen, self.records, self.bytes = keyed.gen, self.records + 1, \
                    self.bytes + size
                return True
        self.gen = 0
        crc = 0
        for p in keyed.pieces:
            crc = zlib.crc32(p, crc)
        atomic_write(self.path, keyed.pieces, ops=self.fileops)
        self.base_crc, self.base_size = crc, keyed.size
        if len(keyed.pieces) > MAX_PIECES:
            self._remove_journal()
            return False
        rec = _record(crc, keyed.size, keyed.gen, 0, _whole_ops(keyed.pieces), ())
        atomic_write(self.journal, rec, ops=self.fileops)
        self.gen, self.records, self.bytes = keyed.gen, 0, sum(map(len, rec))
        return False

    def _append(self, rec: list[Piece]) -> None:
        ops = self.fileops
        fd = ops.open(self.journal, os.O_WRONLY)
        try:
            # (a change: small) one write, mostly
            pwrite_all(ops, fd, b"".join(rec), self.bytes, self.journal)
            ops.fsync(fd)
        finally:
            ops.close(fd)

    def _remove_journal(self) -> None:
        try:
            os.unlink(self.journal)
        except FileNotFoundError:
            pass


def load(path: str) -> bytes | None:
    """The state file's text with the journal's changes made (None: no file). Raises
    OSError if the file cannot be read; a journal that cannot be read or does not fit
    is ignored from where it stops fitting (logged)."""
    try:
        with open(path, "rb") as f:
            base = f.read()
    except FileNotFoundError:
        return None
    try:
        with open(path + SUFFIX, "rb") as f:
            journal = f.read()
    except FileNotFoundError:
        return base
    except OSError as e:
        log.error("NSQ: state journal %s%s unreadable (%s): the state file alone",
                  path, SUFFIX, e)
        return base
    pieces, why = _replay(base, journal)
    if why:
        log.warning("NSQ: state journal %s%s: %s", path, SUFFIX, why)
    return base if pieces is None else b"".join(pieces)


def _replay(base: bytes, journal: bytes) -> tuple[list[Piece] | None, str]:
    """The pieces the journal makes of ``base`` (None: it is not for this file), and
    why it stopped before its end ("": it did not)."""
    crc, size = zlib.crc32(base), len(base)
    pieces: list[Piece] | None = None
    gen = 0
    at = 0
    view = memoryview(journal)
    while at < len(journal):
        if at + _REC.size > len(journal):
            return pieces, f"a torn record at byte {at}: the records before it kept"
        n, want = _REC.unpack_from(journal, at)
        body = view[at + _REC.size:at + _REC.size + n]
        if len(body) < n or zlib.crc32(body) != want or n < _HEAD.size:
            return pieces, f"a torn or damaged record at byte {at}: the records before it kept"
        bcrc, bsize, g, prev, k = _HEAD.unpack_from(body, 0)
        if bcrc != crc or bsize != size:
            return pieces, "it follows another state file: ignored"
        end = _HEAD.size + 8 * k
        if k % 2 or end > n or k // 2 > MAX_PIECES:
            return pieces, f"a record at byte {at} with {k} ops: the records before it kept"
        if (prev == 0) != (pieces is None) or prev and prev != gen:
            return pieces, f"a record at byte {at} follows another one: the records before it kept"
        ops = struct.unpack_from(f">{k}q", body, _HEAD.size)
        data = memoryview(base) if prev == 0 else body[end:]
        try:
            made = apply_ops(pieces or (), ops, _cut(data, ops))
        except ValueError as e:
            return pieces, f"a record at byte {at} does not fit ({e}): the records before it kept"
        pieces, gen = made, g
        at += _REC.size + n
    return pieces, ""


def _cut(data: memoryview, ops: Sequence[int]) -> Iterator[Piece]:
    """The new pieces of ``ops``, in order, out of ``data`` (which they must fill)."""
    total = sum(ops[i + 1] for i in range(0, len(ops), 2) if ops[i] == -1)
    if total != len(data) or any(ops[i] == -1 and ops[i + 1] < 0
                                 for i in range(0, len(ops), 2)):
        raise ValueError("the new pieces are not the record's bytes")
    at = 0
    for i in range(0, len(ops), 2):
        if ops[i] == -1:
            yield data[at:at + ops[i + 1]]
            at += ops[i + 1]


__all__ = ["MAX_RECORDS", "SUFFIX", "StateWriter", "load"]
