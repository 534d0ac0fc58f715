"""DiskQueue: a durable FIFO of opaque byte records with acknowledgements (stdlib only).

Theory of operation
-------------------
Every record gets a sequence number (seq) when it is put: 0, 1, 2, ... per queue,
never reused (the meta file keeps a floor, so even an emptied queue goes on upward).
Records are appended to numbered segment files; a segment is rolled when the next
batch would push it past ``max_bytes_per_file`` (a single larger batch gets a segment
of its own). ``put_many`` frames a whole batch in memory and issues one ``pwrite``.

Reading hands records out as ``(seq, data)`` and moves an in-memory cursor; a record
stays *un-acked* until the caller calls ``ack(seq)`` (on FIN, in the broker). The read
state persisted by a checkpoint is ``(frontier, unacked)``: every seq below
``frontier`` that is not in ``unacked`` is done; everything else is delivered again
after a restart, from the position of the lowest un-acked record (``start``). So
after kill -9 each record that was put and not acked comes back (at-least-once);
acks made after the last checkpoint only cause duplicates. ``put(..., claim=True)``
appends a record that the caller keeps in memory: it counts as read-but-un-acked, so
it is never read back while the queue is open (if unread records precede it, the
reader skips it when it gets there), yet comes back after a crash. This is the
write-ahead mode the broker uses when publishes must be durable, and how a
deferred message is re-written with its new due time before the old copy is acked.

Syncing: ``sync()`` fsyncs data (rolled segments, the write segment, the directory
after a segment was created) and returns ``synced_seq``: every seq <= it is on disk.
It may run in another thread than ``put``: the fsync happens outside the queue lock
on a dup of the fd, so puts continue meanwhile and the next sync covers them all
(group commit); ``sync(seq)`` returns at once when seq is already covered. The meta
file is not part of ``sync()``: a durable publish needs one fsync, not three.
``checkpoint()`` syncs data first, then writes the meta file, then deletes segments
that hold no un-acked record; data is always durable before an ack that may depend
on it. ``maybe_sync(now_ns)`` checkpoints every ``sync_every`` puts+acks or after
``sync_timeout_s`` with activity (nsqd's policy; the caller supplies time). Every
method is thread-safe. Write side: _segments; read side and acks: _cursor; open and
repair: _recovery; framing: segment; meta file: _queuemeta.

On-disk format, version 1 (directory ``<root>/<safe name>/``, see _fsutil.safe_name)
----------------------------------------------------------------------------------
``%08d.seg`` segment: 32-byte header ``>4sHHIQQI`` = magic ``PBDQ``, format version
(1), header length (32), flags (0), file number, first seq, crc32 of the previous 28
bytes; then records ``[u32 crc32][u32 length][u64 seq][data]`` (big-endian), crc32
(zlib) over length+seq+data; seqs within a segment are consecutive. ``meta``: JSON
read state (see _queuemeta), replaced atomically. ``*.bad``: damaged segments moved
aside. ``*.tmp``: leftovers of an interrupted atomic write, removed on open.

Damage
------
Open: the last segment is verified from the last checkpoint's write position (or
its start); an incomplete record at its end, or a bad one followed only by zeros or
ending exactly at EOF, is a torn write: the file is truncated there. Any other bad
record (crc, impossible length, seq out of order) is damage. Found on read, it is
logged, a copy of the segment is kept as ``<seg>.bad``, and reading resyncs on the
next intact record (the next seqs' headers are searched for within 4 MiB), so one
bad record costs only itself. Found on open, or where no intact record follows, the
segment's intact prefix is copied to a new file that takes the segment's name, the
original is kept as ``<seg>.bad`` (hard link, else a copy), and reading goes on with
the next segment. A segment with a bad header is moved aside whole. Damage is never raised
from read paths; OS errors on writes raise ``StorageError`` subclasses (``DiskFullError``
for ENOSPC/EDQUOT/EFBIG) after truncating away any partial write.
"""
from __future__ import annotations

import logging
import os
import secrets
import shutil
import threading
from collections.abc import Iterable
from typing import Self

from ._cursor import ReadCursor
from ._fsutil import atomic_write, fsync_dir, safe_name
from ._queuemeta import QueueMeta, encode_meta
from ._recovery import list_queues, recover
from ._segments import SegmentFiles
from .errors import QueueClosedError, StorageError, from_oserror
from .segment import REC_HEADER_SIZE, SEG_HEADER_SIZE

log = logging.getLogger("pybroker.storage.diskqueue")

DEFAULT_MAX_BYTES_PER_FILE = 100 * 1024 * 1024   # nsqd --max-bytes-per-file
DEFAULT_MAX_RECORD_BYTES = 64 * 1024 * 1024


class DiskQueue:
    """One named queue in ``<root>/<safe name>/``; see the module docstring.

    Thread-safe: one lock guards the write side (SegmentFiles) and the read side
    (ReadCursor); a second one serialises syncs, whose fsyncs run outside the first.

    Args:
        root: directory holding the queues (created if missing).
        name: queue name, e.g. ``"topic"`` or ``"topic:channel"``.
        max_bytes_per_file: segment roll size.
        max_record_bytes: larger records are refused on put and are damage on read.
        sync_every, sync_timeout_s: the checkpoint policy of ``maybe_sync``.
    Raises:
        StorageError: the directory or files cannot be created or opened.
        UnsupportedFormatError: a segment of a newer format version is present.
    """

    def __init__(self, root: str | os.PathLike[str], name: str, *,
                 max_bytes_per_file: int = DEFAULT_MAX_BYTES_PER_FILE,
                 max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
                 sync_every: int = 2500, sync_timeout_s: float = 2.0) -> None:
        if max_bytes_per_file < SEG_HEADER_SIZE + REC_HEADER_SIZE:
            raise ValueError("max_bytes_per_file too small")
        self.name = name
        self.root = os.fspath(root)
        self.path = os.path.join(self.root, safe_name(name))
        self._max_record = max_record_bytes
        self._sync_every = max(1, sync_every)
        self._sync_timeout_ns = int(sync_timeout_s * 1e9)
        self._lock = threading.Lock()        # _segs, _cursor and the fields below
        self._sync_lock = threading.Lock()   # one sync/checkpoint at a time
        self._closed = False
        self._ops = 0                        # puts + acks since the last checkpoint
        self._last_sync_ns: int | None = None
        rec = None
        try:
            rec = recover(self.path, name, max_record_bytes, max_bytes_per_file)
            self._segs = SegmentFiles(self.path, rec, max_bytes_per_file)
            self._cursor = ReadCursor(name, self._segs, max_record_bytes, rec.meta)
        except OSError as e:
            if rec is not None and rec.wfd >= 0:
                os.close(rec.wfd)
            raise from_oserror("cannot open queue", self.path, e) from e

    # -- writing --------------------------------------------------------------------
    def put(self, record: bytes, *, claim: bool = False) -> int:
        """Append one record; return its seq. See put_many."""
        return self.put_many((record,), claim=claim)

    def put_many(self, records: Iterable[bytes], *, claim: bool = False) -> int:
        """Append records in one write; return the seq of the first (they are consecutive).

        With ``claim=True`` the records count as handed out (the caller keeps them in
        memory and acks them later): they are never read back while the queue is
        open, but come back after a restart unless acked. Claiming while unread
        records are on disk lets the claimed ones overtake them (fine for a deferred
        or requeued message; keep FIFO for publishes by claiming only when
        ``depth() == 0``). Not durable until ``sync()`` returns a seq >= theirs.
        Raises:
            ValueError: a record is larger than max_record_bytes.
            StorageError: the write failed; nothing was appended.
        """
        recs = records if isinstance(records, (list, tuple)) else list(records)
        if recs and max(map(len, recs)) > self._max_record:
            raise ValueError(f"record larger than max_record_bytes={self._max_record}")
        with self._lock:
            self._check_open()
            if not recs:
                return self._segs.next_seq
            first, base = self._segs.append(recs)
            self._ops += len(recs)
            if claim:
                self._cursor.claim(first, base, recs)
            return first

    # -- reading and acking ---------------------------------------------------------
    def read_many(self, max_n: int, *, auto_ack: bool = False) -> list[tuple[int, bytes]]:
        """Hand out up to max_n unread records, oldest first, as (seq, data).

        They stay un-acked (delivered again after a restart) until ``ack``; with
        ``auto_ack`` they are done at once (nsqd's advance-on-hand-off semantics).
        Never raises for damaged data (it is logged and skipped).
        """
        with self._lock:
            self._check_open()
            out = self._cursor.read(max_n, auto_ack)
            if auto_ack:
                self._ops += len(out)
            return out

    def ack(self, seq: int) -> bool:
        """Mark a handed-out record done. False if seq was not un-acked (no-op)."""
        with self._lock:
            if not self._cursor.ack(seq):
                return False
            self._ops += 1
            return True

    def ack_many(self, seqs: Iterable[int]) -> int:
        """ack() each seq; return how many were un-acked."""
        with self._lock:
            ack, n = self._cursor.ack, 0
            for seq in seqs:
                if ack(seq):
                    n += 1
            self._ops += n
            return n

    # -- syncing --------------------------------------------------------------------
    def sync(self, seq: int | None = None) -> int:
        """fsync everything written so far; return synced_seq (all seqs <= it are on disk).

        Group commit: puts go on while a sync waits for the disk, and the next sync
        covers them all. With ``seq``, return at once if that seq is already synced,
        including by a sync another thread finished while this one waited for it.
        Raises StorageError if fsync fails.
        """
        segs = self._segs
        if seq is not None and segs.synced_seq >= seq:
            return segs.synced_seq
        with self._sync_lock:
            if seq is not None and segs.synced_seq >= seq:
                return segs.synced_seq
            return self._sync_data()

    def _sync_data(self) -> int:
        segs = self._segs
        with self._lock:
            plan = segs.begin_sync()
            if plan is None:
                return segs.synced_seq
        try:
            n = SegmentFiles.run_sync(plan)
        except OSError as e:
            with self._lock:
                segs.end_sync(plan, 0, ok=False)
            raise from_oserror("fsync failed in", self.path, e) from e
        with self._lock:
            segs.end_sync(plan, n, ok=True)
            return segs.synced_seq

    @property
    def synced_seq(self) -> int:
        """Highest seq known to be on disk (-1 if none)."""
        return self._segs.synced_seq

    def maybe_sync(self, now_ns: int) -> bool:
        """Checkpoint if sync_every ops happened or sync_timeout passed with activity.

        ``now_ns`` is a monotonic clock reading; returns whether it checkpointed.
        """
        with self._lock:
            if self._closed:
                return False
            if self._last_sync_ns is None:
                self._last_sync_ns = now_ns
            due = self._ops >= self._sync_every or (
                self._ops > 0 and now_ns - self._last_sync_ns >= self._sync_timeout_ns)
        if due:
            self.checkpoint(now_ns)
        return due

    def checkpoint(self, now_ns: int | None = None) -> None:
        """Sync data, persist the read state atomically, delete fully acked segments.

        Raises StorageError if the data cannot be synced or the meta file written.
        """
        with self._sync_lock:
            self._check_open()
            self._checkpoint(now_ns)

    def _checkpoint(self, now_ns: int | None) -> None:
        """checkpoint() with the sync lock held."""
        self._sync_data()
        with self._lock:
            meta, dead = self._cursor.snapshot()
            self._ops = 0
            if now_ns is not None:
                self._last_sync_ns = now_ns
        self._write_meta(meta)
        with self._lock:
            self._segs.fsyncs += 2
            for num in dead:
                self._segs.drop(num)

    def _write_meta(self, meta: QueueMeta) -> None:
        path = os.path.join(self.path, "meta")
        try:
            atomic_write(path, encode_meta(meta))
        except OSError as e:
            raise from_oserror("cannot write meta", path, e) from e

    # -- state and lifecycle --------------------------------------------------------
    def depth(self) -> int:
        """Records on disk not yet handed out (nsqd's backend depth)."""
        with self._lock:
            return self._cursor.depth()

    def is_empty(self) -> bool:
        return self.depth() == 0

    def unacked_count(self) -> int:
        with self._lock:
            return self._cursor.unacked_count()

    def stats(self) -> dict[str, int]:
        """Counters for health and metrics."""
        with self._lock:
            segs = self._segs
            return {"depth": self._cursor.depth(), "unacked": self._cursor.unacked_count(),
                    "next_seq": segs.next_seq, "synced_seq": segs.synced_seq,
                    "segments": len(segs.nums), "fsyncs": segs.fsyncs,
                    "writes": segs.writes}

    def empty(self) -> None:
        """Drop every record, read or not (nsqd's Empty); seqs keep counting up.

        Raises StorageError if the new (empty) state cannot be persisted.
        """
        with self._sync_lock, self._lock:
            self._check_open()
            self._segs.drop_all()
            self._cursor.reset()
            self._write_meta(self._cursor.snapshot()[0])

    def close(self) -> None:
        """Checkpoint and release files. Idempotent; raises StorageError if the final
        checkpoint fails (files are released anyway)."""
        with self._sync_lock:
            if self._closed:
                return
            try:
                self._checkpoint(None)
            finally:
                with self._lock:
                    self._closed = True
                    self._cursor.close_reader()
                    self._segs.close()

    def delete(self) -> None:
        """Close without checkpointing and remove the queue's directory.

        Crash-safe: the directory is first renamed to a hidden tombstone.
        """
        with self._sync_lock, self._lock:
            self._closed = True
            self._cursor.close_reader()
            self._segs.close()
        tomb = os.path.join(self.root, f".deleted-{secrets.token_hex(6)}")
        try:
            os.replace(self.path, tomb)
            fsync_dir(self.root)
        except FileNotFoundError:
            return
        except OSError as e:
            raise from_oserror("cannot delete queue", self.path, e) from e
        shutil.rmtree(tomb, ignore_errors=True)

    def _check_open(self) -> None:
        if self._closed:
            raise QueueClosedError(f"queue {self.name!r} is closed", path=self.path)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = [
    "DEFAULT_MAX_BYTES_PER_FILE",
    "DEFAULT_MAX_RECORD_BYTES",
    "DiskQueue",
    "StorageError",
    "list_queues",
]
