"""SegmentFiles: the segment files of one DiskQueue and their write end (stdlib only).

Owns the list of segments, appending (one pwrite per batch, rolled segments, rollback
of a failed write) and the fsync plan used for group commit. Not thread-safe by
itself: DiskQueue calls it under its lock, except ``run_sync`` (no shared state).
"""
from __future__ import annotations

import bisect
import os
from dataclasses import dataclass

from ._fsutil import fsync_dir
from ._recovery import Recovered, seg_path
from .errors import from_oserror
from .segment import (
    REC_HEADER_SIZE,
    SEG_HEADER_SIZE,
    encode_records,
    pack_segment_header,
)


@dataclass(slots=True)
class SyncPlan:
    """What one sync must fsync; fds are private dups/handed-over fds it closes."""
    target: int
    fds: list[int]
    dir_path: str | None


class SegmentFiles:
    """Owned by one DiskQueue; every method is called with the queue's lock held."""

    def __init__(self, qdir: str, rec: Recovered, max_bytes: int) -> None:
        self.qdir = qdir
        self.max_bytes = max_bytes
        self.first = rec.first          # file_num -> first seq in it
        self.nums = rec.nums            # sorted file_nums of segments with a header
        self.ends = rec.ends            # sealed file_num -> readable end
        self.wfd = rec.wfd              # write segment fd, -1 if none open
        self.wend = rec.wend            # bytes valid in the write segment
        self.need_roll = rec.need_roll
        self.next_file = rec.next_file
        self.next_seq = rec.next_seq    # seq of the next record put
        self.wnum = self.nums[-1] if self.wfd >= 0 else self.next_file
        self.synced_seq = self.next_seq - 1
        self.tail_dirty = False         # a failed write could not be truncated away
        self.unsynced: list[int] = []   # fds of rolled segments awaiting fsync
        self.dir_dirty = False          # a segment was created since the last sync
        self.writes = 0
        self.fsyncs = 0

    def path(self, num: int) -> str:
        return seg_path(self.qdir, num)

    def limit(self, num: int, fallback: int) -> tuple[int, bool]:
        """(readable end of segment num, whether it is the live write segment)."""
        if num == self.wnum and self.wfd >= 0:
            return self.wend, True
        return self.ends.get(num, fallback), False

    def next_after(self, num: int) -> int | None:
        i = bisect.bisect_right(self.nums, num)
        return self.nums[i] if i < len(self.nums) else None

    def append(self, recs: list[bytes] | tuple[bytes, ...]) -> tuple[int, int]:
        """Write recs as one batch; return (first seq, offset of the first record).

        Raises StorageError; then nothing was appended (a partial write is truncated).
        """
        size = sum(map(len, recs)) + REC_HEADER_SIZE * len(recs)
        if self.wfd < 0 or self.need_roll or (
                self.wend > SEG_HEADER_SIZE and self.wend + size > self.max_bytes):
            self._roll()
        first = self.next_seq
        parts: list[bytes] = []
        new_seg = self.wend == 0
        if new_seg:
            parts.append(pack_segment_header(self.wnum, first))
        n = encode_records(recs, first, parts)
        base = self.wend + (SEG_HEADER_SIZE if new_seg else 0)
        self._write(b"".join(parts))
        if new_seg:
            self.first[self.wnum] = first
            self.nums.append(self.wnum)
        self.next_seq = first + n
        return first, base

    def _roll(self) -> None:
        num = self.next_file
        path = self.path(num)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError as e:
            raise from_oserror("cannot create segment", path, e) from e
        if self.wfd >= 0:
            if self.wend > 0:
                self.ends[self.wnum] = self.wend
                self.unsynced.append(self.wfd)
            else:   # an empty file left by a failed first write
                os.close(self.wfd)
                self.drop(self.wnum)
        self.next_file += 1
        self.wnum, self.wfd, self.wend = num, fd, 0
        self.need_roll = self.tail_dirty = False
        self.dir_dirty = True

    def _write(self, data: bytes) -> None:
        fd, start = self.wfd, self.wend
        view, off = memoryview(data), start
        self.writes += 1
        try:
            if self.tail_dirty:
                os.ftruncate(fd, start)
                self.tail_dirty = False
            while view:
                n = os.pwrite(fd, view, off)
                off += n
                view = view[n:]
        except OSError as e:
            try:
                os.ftruncate(fd, start)
            except OSError:
                self.tail_dirty = True   # retried before the next write
            raise from_oserror("cannot write to segment", self.path(self.wnum), e) from e
        self.wend = off

    def seal_damaged(self, num: int, good_end: int) -> None:
        """Segment num now ends at good_end (damage); stop writing to it if live."""
        self.ends[num] = good_end
        if num == self.wnum and self.wfd >= 0:
            os.close(self.wfd)
            self.wfd, self.need_roll = -1, True

    def drop(self, num: int) -> None:
        """Delete segment num (missing is fine)."""
        try:
            os.unlink(self.path(num))
        except FileNotFoundError:
            pass
        self.first.pop(num, None)
        self.ends.pop(num, None)
        i = bisect.bisect_left(self.nums, num)
        if i < len(self.nums) and self.nums[i] == num:
            del self.nums[i]

    def drop_all(self) -> None:
        """Close the write end and delete every segment; the next put starts afresh."""
        self.close()
        for num in list(self.nums):
            self.drop(num)
        self.wnum, self.wend, self.need_roll = self.next_file, 0, True

    # -- group commit: begin (locked), run (unlocked), end (locked) ----------------
    def begin_sync(self) -> SyncPlan | None:
        target = self.next_seq - 1
        if target <= self.synced_seq and not self.unsynced and not self.dir_dirty:
            return None
        fds, self.unsynced = self.unsynced, []
        if self.wfd >= 0:
            fds.append(os.dup(self.wfd))
        plan = SyncPlan(target, fds, self.qdir if self.dir_dirty else None)
        self.dir_dirty = False
        return plan

    @staticmethod
    def run_sync(plan: SyncPlan) -> int:
        """fsync everything in plan (no lock needed); return the fsync count."""
        n = 0
        try:
            for fd in plan.fds:
                os.fsync(fd)
                n += 1
            if plan.dir_path is not None:
                fsync_dir(plan.dir_path)
                n += 1
        finally:
            for fd in plan.fds:
                os.close(fd)
        return n

    def end_sync(self, plan: SyncPlan, fsyncs: int, ok: bool) -> None:
        self.fsyncs += fsyncs
        if ok:
            self.synced_seq = max(self.synced_seq, plan.target)
        else:   # fsync errors may have dropped dirty pages: write afresh elsewhere
            self.dir_dirty = self.dir_dirty or plan.dir_path is not None
            self.need_roll = True

    def close(self) -> None:
        for fd in self.unsynced + ([self.wfd] if self.wfd >= 0 else []):
            os.close(fd)
        self.unsynced, self.wfd = [], -1
