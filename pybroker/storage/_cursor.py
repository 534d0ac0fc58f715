"""ReadCursor: the read side of one DiskQueue (cursor, un-acked set, redelivery).

Owns where reading stands, which handed-out records are not yet acked, which
records must come back after a restart, and the read state a checkpoint persists.
Not thread-safe by itself: DiskQueue calls it under its lock. stdlib only.
"""
from __future__ import annotations

import heapq
import logging
from collections import OrderedDict

from ._queuemeta import QueueMeta, from_ranges, to_ranges
from ._recovery import keep_copy, quarantine
from ._segments import SegmentFiles
from .segment import REC_HEADER_SIZE, SEG_HEADER_SIZE, SegmentReader, Stop

log = logging.getLogger("pybroker.storage.diskqueue")

_POS_SHIFT = 40                          # pos = file_num << 40 | offset
_OFF_MASK = (1 << _POS_SHIFT) - 1


class ReadCursor:
    """Owned by one DiskQueue; every method is called with the queue's lock held."""

    def __init__(self, name: str, segs: SegmentFiles, max_record: int,
                 meta: QueueMeta | None) -> None:
        self.name = name
        self.segs = segs
        self.max_record = max_record
        self.reader: SegmentReader | None = None
        self.rnum = 0                    # cursor: segment, offset, seq expected there
        self.roff = SEG_HEADER_SIZE
        self.rseq = 0
        self.rverify = False             # cursor came from meta: rescan if it is bad
        self.frontier = 0                # seqs below it not in redeliver were acked
        self.redeliver: set[int] = set()     # from the last checkpoint, not read yet
        self.unacked: OrderedDict[int, int] = OrderedDict()   # seq -> pos, by seq
        # claimed records the cursor has not passed yet: seq -> pos, or -1 once acked
        self.ahead: dict[int, int] = {}
        self.ahead_unacked = 0
        start = None
        if meta is not None:
            self.frontier = meta.frontier
            self.redeliver = from_ranges(meta.unacked)
            self.ahead = dict.fromkeys(from_ranges(meta.skip), -1)
            start = meta.start
        if start is not None:
            for num in [n for n in segs.nums if n < start[0]]:
                log.info("DISKQUEUE(%s) removing fully acked segment %d", name, num)
                segs.drop(num)
        if start is not None and start[0] in segs.first:
            self.rnum, self.roff, self.rseq = start
            self.rverify = True
        elif segs.nums:
            self._set_at(segs.nums[0])
        else:
            self.rnum, self.roff, self.rseq = segs.wnum, SEG_HEADER_SIZE, segs.next_seq

    def _set_at(self, num: int) -> None:
        self.rnum, self.roff, self.rseq = num, SEG_HEADER_SIZE, self.segs.first[num]
        self.rverify = False

    def depth(self) -> int:
        return (len(self.redeliver) + self.segs.next_seq
                - max(self.rseq, self.frontier) - len(self.ahead))

    def unacked_count(self) -> int:
        return len(self.unacked) + self.ahead_unacked

    def claim(self, first: int, base: int, recs: list[bytes] | tuple[bytes, ...]) -> None:
        """Records just appended at ``base`` count as handed out.

        With nothing unread before them the cursor jumps past them; otherwise they
        wait in ``ahead`` and the reader skips them when it gets there.
        """
        segs = self.segs
        caught_up = self.depth() == len(recs)     # they were just appended
        if caught_up and self.ahead:
            self._pass_ahead()
        dest = self.unacked if caught_up else self.ahead
        pos, seq = (segs.wnum << _POS_SHIFT) | base, first
        for rec in recs:
            dest[seq] = pos
            pos += REC_HEADER_SIZE + len(rec)
            seq += 1
        if caught_up:
            self.rnum, self.roff, self.rseq = segs.wnum, segs.wend, segs.next_seq
            self.rverify = False
        else:
            self.ahead_unacked += len(recs)

    def _pass_ahead(self) -> None:
        for seq in sorted(self.ahead):
            pos = self.ahead[seq]
            if pos >= 0:
                self.unacked[seq] = pos
        self.ahead.clear()
        self.ahead_unacked = 0

    def ack(self, seq: int) -> bool:
        if self.unacked.pop(seq, None) is not None:
            return True
        if self.ahead.get(seq, -1) >= 0:
            self.ahead[seq] = -1
            self.ahead_unacked -= 1
            return True
        return False

    def read(self, max_n: int, auto_ack: bool) -> list[tuple[int, bytes]]:
        out: list[tuple[int, bytes]] = []
        while len(out) < max_n and self.depth() > 0:
            if not self._read_some(out, max_n - len(out), auto_ack):
                break
        if self.redeliver and self.rseq >= self.frontier:
            log.warning("DISKQUEUE(%s) %d un-acked records were not found on disk",
                        self.name, len(self.redeliver))
            self.redeliver.clear()
        return out

    def _read_some(self, out: list[tuple[int, bytes]], want: int, auto_ack: bool) -> bool:
        """Parse from the cursor; False when nothing more can be read now."""
        num, segs = self.rnum, self.segs
        if num not in segs.first:
            return self._next_segment()
        reader = self.reader
        if reader is None or reader.file_num != num:
            self.close_reader()
            try:
                reader = self.reader = SegmentReader(segs.path(num), num)
            except OSError as e:
                log.error("DISKQUEUE(%s) cannot open segment %d (%s); skipping it",
                          self.name, num, e)
                return self._next_segment()
        limit, live = segs.limit(num, reader.size)
        try:
            items, off, nseq, stop = reader.parse(self.roff, limit, self.rseq, want,
                                                  self.max_record)
        except OSError as e:
            log.error("DISKQUEUE(%s) read error in segment %d (%s); skipping the rest",
                      self.name, num, e)
            items, off, nseq, stop = [], self.roff, self.rseq, Stop.BAD_LENGTH
        if stop.is_damage and not items and self.rverify:
            self._set_at(num)            # meta position unusable: rescan this segment
            return True
        self.rverify = False
        frontier, redeliver, unacked = self.frontier, self.redeliver, self.unacked
        base = num << _POS_SHIFT
        ahead = self.ahead
        for seq, roff, data in items:
            if seq < frontier:
                if seq not in redeliver:
                    continue             # acked before the restart
                redeliver.discard(seq)
            elif ahead and seq in ahead:
                if ahead.pop(seq) >= 0:  # claimed, still un-acked: now behind us
                    unacked[seq] = base | roff
                    self.ahead_unacked -= 1
                continue
            out.append((seq, data))
            if not auto_ack:
                unacked[seq] = base | roff
        self.roff, self.rseq = off, nseq
        if stop is Stop.FULL:
            return True
        if stop is Stop.TORN and not live:
            log.warning("DISKQUEUE(%s) segment %d ends with a torn record at %d; "
                        "going on with the next segment", self.name, num, off)
        elif stop.is_damage:
            found = None
            try:
                found = reader.resync(off, limit, nseq, self.max_record)
            except OSError:
                pass
            if found is not None:
                # one bad record: skip just it (and keep a copy of the segment as .bad)
                keep_copy(segs.qdir, num)
                log.error("DISKQUEUE(%s) %s in segment %d at %d: skipped to the next "
                          "intact record at %d (seqs %d..%d lost)", self.name, stop.value,
                          num, off, found[0], nseq, found[1] - 1)
                self.roff, self.rseq = found
                return True
            quarantine(segs.qdir, self.name, num, off, stop)
            self.close_reader()
            segs.seal_damaged(num, off)
        return self._next_segment()

    def _next_segment(self) -> bool:
        segs = self.segs
        nxt = segs.next_after(self.rnum)
        if nxt is None:
            # Nothing after this segment: seqs up to next_seq that are not here were
            # lost (damage) or never written; the next put starts a new segment.
            self.rseq = max(self.rseq, segs.next_seq)
            if self.ahead:
                lost = [s for s in self.ahead if s < self.rseq]
                for s in lost:
                    if self.ahead.pop(s) >= 0:
                        self.ahead_unacked -= 1
            return False
        if segs.first[nxt] < self.rseq:
            log.error("DISKQUEUE(%s) segment %d starts at seq %d < %d; setting it aside",
                      self.name, nxt, segs.first[nxt], self.rseq)
            quarantine(segs.qdir, self.name, nxt, 0, Stop.BAD_SEQ)
            segs.drop(nxt)
            return True
        self._set_at(nxt)
        return True

    def snapshot(self) -> tuple[QueueMeta, list[int]]:
        """The read state to persist, and the segments deletable once it is durable."""
        segs = self.segs
        frontier = max(self.rseq, self.frontier)
        ranges = to_ranges(heapq.merge(self.unacked, sorted(self.redeliver)))
        if self.unacked:
            seq, pos = next(iter(self.unacked.items()))
            start = (pos >> _POS_SHIFT, pos & _OFF_MASK, seq)
        else:
            start = (self.rnum, self.roff, self.rseq)
        write = (segs.wnum, segs.wend, segs.next_seq) if segs.wfd >= 0 else None
        skip = to_ranges(sorted(s for s, p in self.ahead.items() if p < 0))
        meta = QueueMeta(self.name, segs.next_seq, frontier, start, ranges, write, skip)
        pinned = {pos >> _POS_SHIFT for pos in self.unacked.values()}
        dead = [n for n in segs.nums if n < self.rnum and n != segs.wnum
                and n not in pinned]
        return meta, dead

    def reset(self) -> None:
        """Everything was dropped (empty): the cursor moves to the next write."""
        self.close_reader()
        self.unacked.clear()
        self.redeliver.clear()
        self.ahead.clear()
        self.ahead_unacked = 0
        segs = self.segs
        self.frontier = segs.next_seq
        self.rnum, self.roff, self.rseq = segs.wnum, SEG_HEADER_SIZE, segs.next_seq
        self.rverify = False

    def close_reader(self) -> None:
        if self.reader is not None:
            self.reader.close()
            self.reader = None
