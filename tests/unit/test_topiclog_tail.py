"""A topic log's memory tail (TopicLog._trim_tail): the oldest blocks are dropped by
moving a front index and cut off the lists FRONT_CUT at a time, not popped from the
front at every write. Checked against the rule written out plainly (drop the oldest
block while at least one is left and the others still hold ``mem_records`` records, or,
on disk, ``TAIL_MAX_BYTES`` bytes), with small limits so that cuts, the byte budget and
a truncation happen within each example: the same blocks live, the same ``oldest``,
``tail_start`` and drop count, and every record read back, from the tail, from a cursor
and from the files."""
from __future__ import annotations


import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pybroker.storage.topiclog as topiclog
from pybroker.storage.records import REC_HEADER
from pybroker.storage.topiclog import PAYLOAD_HEAD, TopicLog

TS = 1_700_000_000 * 10**9
MAX_BYTES = 600          # TAIL_MAX_BYTES in these tests


class Plain:
    """The tail's rule, one block popped from the front at a time."""

    def __init__(self, keep: int, on_disk: bool) -> None:
        self.keep = keep
        self.on_disk = on_disk
        # (first, records, bytes, where each record starts in the block's bytes)
        self.blocks: list[tuple[int, int, int, list[int]]] = []
        self.written = self.oldest = self.tail_start = self.dropped = 0

    def write(self, n: int, nbytes: int, pos: list[int]) -> None:
        self.blocks.append((self.written, n, nbytes, pos))
        self.written += n
        blocks, keep = self.blocks, self.keep
        while len(blocks) > 1 and (sum(b[1] for b in blocks) - blocks[0][1] >= keep
                                   or self.on_disk and sum(b[2] for b in blocks)
                                   - blocks[0][2] >= MAX_BYTES):
            blocks.pop(0)
        if not self.on_disk:
            low = max(self.written - keep, blocks[0][0] if blocks else self.written)
            if low > self.oldest:
                self.dropped += low - self.oldest
                self.oldest = low
            if blocks and blocks[-1][0] + blocks[-1][1] <= self.oldest:
                blocks.clear()
        first = blocks[0][0] if blocks else self.written
        self.tail_start = max(first, self.written - keep)
        if self.on_disk and sum(b[2] for b in blocks) > MAX_BYTES and blocks:
            self.tail_start = max(self.tail_start, blocks[0][0] + blocks[0][1])

    def truncate(self, offset: int) -> None:
        offset = max(offset, self.oldest)
        while self.blocks and self.blocks[-1][0] >= offset:
            self.blocks.pop()
        if self.blocks and sum(self.blocks[-1][:2]) > offset:
            first, _, _, starts = self.blocks[-1]
            keep = offset - first
            self.blocks[-1] = (first, keep, starts[keep], starts[:keep])
        self.written = offset
        self.tail_start = min(self.tail_start, offset)


def body(off: int) -> bytes:
    return b"r%05d" % off + b"." * (off % 7)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(on_disk=st.booleans(), keep=st.integers(0, 12),
       writes=st.lists(st.integers(1, 5), min_size=1, max_size=120),
       cut_at=st.integers(0, 119), back=st.integers(0, 8))
def test_the_tail_holds_what_the_plain_rule_holds(
        tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch,
        on_disk: bool, keep: int, writes: list[int], cut_at: int, back: int) -> None:
    monkeypatch.setattr(topiclog, "FRONT_CUT", 3)
    monkeypatch.setattr(topiclog, "TAIL_MAX_BYTES", MAX_BYTES)
    d = str(tmp_path_factory.mktemp("tail")) if on_disk else None
    lg = TopicLog(d, max_bytes_per_file=2048, mem_records=keep, max_record_bytes=64)
    plain = Plain(keep, on_disk)
    for k, n in enumerate(writes):
        bs = [body(lg.head + i) for i in range(n)]
        with lg.lock:
            first = lg.append(bs, TS)
            lg.write_pending()
        sizes = [REC_HEADER + PAYLOAD_HEAD + len(b) for b in bs]
        pos = [sum(sizes[:i]) for i in range(n)]
        plain.write(n, sum(sizes), pos)
        if lg._blocks:
            assert list(lg._blocks[-1].pos) == pos
        assert first == plain.written - n
        if k == cut_at and on_disk and back:
            # a follower cutting its tail back (pybroker.cluster): blocks from the end
            with lg.lock:
                lg.truncate(max(lg.written - back, 0))
            plain.truncate(max(plain.written - back, 0))
        live = lg._blocks[lg._front:]
        assert len(lg._blocks) - lg._front == len(plain.blocks)
        assert [b.first for b in live] == [b[0] for b in plain.blocks]
        assert lg._front < 3 or not live      # cut FRONT_CUT at a time
        assert lg._tail_records == sum(len(b.pos) for b in live)
        assert lg._tail_bytes == sum(len(b.data) for b in live) == sum(b[2] for b in plain.blocks)
        assert (lg.written, lg.oldest, lg.tail_start, lg.dropped_count) == \
            (plain.written, plain.oldest, plain.tail_start, plain.dropped)
    # every record held reads back: a one-off read at each offset, and a cursor
    cur = lg.cursor()
    for off in range(lg.oldest, lg.written):
        got = lg.read(off, 1, 1 << 16)
        assert got.first == off and got.payload(0)[34:] == body(off)
        got = cur.read(off, 1, 1 << 16)
        assert got.first == off and got.payload(0)[34:] == body(off)
    cur.release()
    lg.close()
