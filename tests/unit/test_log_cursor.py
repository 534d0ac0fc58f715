"""LogCursor (storage/cursor.py) on real segment files: a sequential reader reads each
byte once (``bytes_read``) and uses the sparse index only to seek; small reads are
served from the batch it scanned; rewinds and far jumps seek; records larger than its
read-ahead; damage; a concurrent writer; segments deleted by retention (or a whole
log deleted and made again) under an open reader; one-off reads own their buffer; and
a Hypothesis state machine against a list of bodies."""
from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pybroker.storage import StorageError
from pybroker.storage.cursor import TAIL_RELEASE, LogCursor
from pybroker.storage.topiclog import SEG_HEADER_SIZE, OffsetOutOfRange, TopicLog

TS = 1_700_000_000 * 10**9


def open_log(path: Path, mem: int = 0, seg: int = 64 * 1024,
             max_record: int = 1 << 20) -> TopicLog:
    return TopicLog(str(path), max_bytes_per_file=seg, mem_records=mem,
                    max_record_bytes=max_record)


def put(log: TopicLog, bodies: list[bytes]) -> int:
    with log.lock:
        first = log.append(bodies, TS)
        log.write_pending()
    return first


def body(i: int, size: int = 100) -> bytes:
    return (b"%08d" % i) * (size // 8) + b"x" * (size % 8)


def file_bytes(log: TopicLog) -> int:
    return sum(s.size_bytes - SEG_HEADER_SIZE for s in log.segments())


def drain(cur: LogCursor, start: int, end: int, want: int, ahead: int = 0) -> list[bytes]:
    out = []
    off = start
    while off < end:
        b = cur.read(off, min(want, end - off), 0, ahead)
        assert b.first == off and 1 <= b.n <= min(want, end - off)
        out += [b.payload(i)[34:] for i in range(b.n)]
        off += b.n
    return out


def open_files() -> list[str]:
    """Where this process's descriptors point (Linux /proc)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return out


@pytest.fixture
def disk_log(tmp_path: Path) -> TopicLog:
    log = open_log(tmp_path / "t", mem=0, seg=64 * 1024)
    for k in range(40):     # 2,000 records of 100 bytes in writes of 50: ~6 segments
        put(log, [body(k * 50 + i) for i in range(50)])
    assert len(log.segments()) >= 4
    log.sync()              # the writer closes the rolled segments' descriptors
    return log


@pytest.mark.parametrize("want,ahead", [(1, 0), (8, 256), (1, 32), (2500, 0)])
def test_sequential_reads_read_each_byte_once(disk_log: TopicLog, want: int,
                                              ahead: int) -> None:
    log = disk_log
    cur = log.cursor()
    got = drain(cur, 0, log.written, want, ahead)
    assert got == [body(i) for i in range(2000)]
    assert cur.seeks == 0
    # each byte once, plus the partial record carried at the end of each read
    assert file_bytes(log) <= log.bytes_read <= file_bytes(log) * 1.02


def test_one_off_reads_from_the_index_read_far_more(disk_log: TopicLog) -> None:
    """What the cursor replaces: TopicLog.read starts at the sparse index point and
    reads a whole chunk for every call."""
    log = disk_log
    for off in range(0, 400, 8):
        b = log.read(off, 8, 0)
        assert b.first == off and b.n == 8
    assert log.bytes_read > 20 * 400 * 150


def test_small_reads_are_served_from_the_scanned_batch(disk_log: TopicLog) -> None:
    cur = disk_log.cursor()
    cur.read(0, 8, 0, 256)
    before = disk_log.bytes_read
    for off in range(8, 200, 8):       # 256 records ahead were read: no more I/O
        assert cur.read(off, 8, 0, 256).first == off
    assert disk_log.bytes_read == before


def test_rewind_and_far_jumps_seek_near_jumps_read_on(disk_log: TopicLog) -> None:
    log = disk_log
    cur = log.cursor(min_read=4096)
    assert drain(cur, 0, 300, 8) == [body(i) for i in range(300)]
    assert cur.seeks == 0
    # a rewind behind the buffer: from the index point at or before it
    assert drain(cur, 120, 130, 8) == [body(i) for i in range(120, 130)]
    assert cur.seeks == 1
    # a jump into a later segment: its index again
    far = log.segments()[-2].base + 7
    b = cur.read(far, 3, 0)
    assert [b.payload(i)[34:] for i in range(b.n)] == [body(far + i) for i in range(3)]
    assert cur.seeks == 2
    # a short jump forward reads on from where it is
    near = far + 20
    assert cur.read(near, 1, 0).payload(0)[34:] == body(near)
    assert cur.seeks == 2


def test_records_larger_than_the_read_ahead(tmp_path: Path) -> None:
    log = open_log(tmp_path / "t", seg=1 << 20)
    sizes = [10, 50_000, 10, 200_000, 3, 70_000]
    put(log, [b"%d" % n * (n // len(b"%d" % n)) for n in sizes])
    cur = log.cursor(min_read=4096, max_read=16 * 1024)
    for want in (1, 4):
        off = 0
        while off < log.written:
            b = cur.read(off, want, 0)
            for i in range(b.n):
                n = sizes[off + i]
                assert b.payload(i)[34:] == b"%d" % n * (n // len(b"%d" % n))
            off += b.n


def test_memory_tail_is_served_without_io_and_the_file_released(tmp_path: Path) -> None:
    log = open_log(tmp_path / "t", mem=100, seg=1 << 20)
    for k in range(10):
        put(log, [body(k * 100 + i) for i in range(100)])
    cur = log.cursor()
    assert drain(cur, 0, 900, 50) == [body(i) for i in range(900)]   # from the file
    assert cur._fd >= 0
    for i in range(1000, 1200):
        put(log, [body(i)])             # the tail now holds 1100..1199
    read = log.bytes_read
    for off in range(1100, 1100 + TAIL_RELEASE):
        assert cur.read(off, 1, 0).payload(0)[34:] == body(off)
    assert log.bytes_read == read
    assert cur._fd < 0 and not cur._buf       # caught up: nothing held


def test_damaged_record_is_skipped_by_a_sequential_reader(tmp_path: Path) -> None:
    log = open_log(tmp_path / "t", seg=1 << 20)
    for k in range(4):
        put(log, [body(k * 10 + i) for i in range(10)])
    seg = log.segments()[0]
    path = tmp_path / "t" / ("%020d.log" % seg.base)
    rec = (seg.size_bytes - SEG_HEADER_SIZE) // 40
    with open(path, "r+b") as f:         # flip a byte in record 20's body
        f.seek(SEG_HEADER_SIZE + 20 * rec + rec - 5)
        c = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([c[0] ^ 0xFF]))
    cur = log.cursor(min_read=1024)
    assert drain(cur, 0, 5, 1) == [body(i) for i in range(5)]
    got: dict[int, bytes] = {}
    off = 5
    while off < log.written:
        b = cur.read(off, 7, 0)
        for i in range(b.n):
            got[b.first + i] = b.payload(i)[34:]
        off = b.first + max(b.n, 1) if b.n else b.first
    assert sorted(got) == [i for i in range(5, 40) if i != 20]
    assert all(v == body(k) for k, v in got.items())
    assert (tmp_path / "t" / (path.name + ".bad")).exists()


def test_reading_beside_a_writer(tmp_path: Path) -> None:
    log = open_log(tmp_path / "t", mem=0, seg=256 * 1024)
    n = 20_000
    done = threading.Event()

    def write() -> None:
        for k in range(n // 100):
            put(log, [body(k * 100 + i, 60) for i in range(100)])
        done.set()

    th = threading.Thread(target=write)
    th.start()
    cur = log.cursor(min_read=4096)
    got: list[bytes] = []
    while len(got) < n:
        off = len(got)
        finished = done.is_set()     # read before ``written``: then that is final
        if off >= log.written:
            assert not finished, f"the writer finished, the log ends at {off} of {n}"
            continue
        b = cur.read(off, 64, 0, 64)
        assert b.first == off
        got += [b.payload(i)[34:] for i in range(b.n)]
    th.join()
    assert got == [body(i, 60) for i in range(n)]


def test_retention_deletes_the_segment_under_an_open_reader(disk_log: TopicLog) -> None:
    log = disk_log
    segs = log.segments()
    cur = log.cursor(min_read=4096)
    assert drain(cur, 0, 10, 5) == [body(i) for i in range(10)]
    assert cur._fd >= 0
    assert log.drop_before(segs[1].base) == segs[1].base
    assert not os.path.exists(os.path.join(str(log.directory), "%020d.log" % 0))
    gone = os.path.join(str(log.directory), "%020d.log (deleted)" % 0)
    assert gone in open_files()     # the reader holds it: the same file stays readable
    with pytest.raises(OffsetOutOfRange):
        cur.read(10, 5, 0)     # below the log's oldest now, as TopicLog.read says
    # the reader moves on to the next segment and closes the deleted one
    assert drain(cur, segs[1].base, segs[2].end, 8) == \
        [body(i) for i in range(segs[1].base, segs[2].end)]
    assert gone not in open_files()


def test_a_segment_gone_before_it_is_opened(disk_log: TopicLog) -> None:
    log = disk_log
    seg = log.segments()[2]
    os.unlink(os.path.join(str(log.directory), "%020d.log" % seg.base))
    cur = log.cursor()
    with pytest.raises(StorageError):        # still listed: an error, not wrong data
        cur.read(seg.base, 1, 0)
    log.drop_before(seg.end)
    with pytest.raises(OffsetOutOfRange):    # dropped: out of range
        cur.read(seg.base, 1, 0)


def test_a_log_deleted_and_made_again_is_never_read_by_an_old_reader(tmp_path: Path) -> None:
    old = open_log(tmp_path / "t", seg=1 << 20)
    put(old, [body(i) for i in range(100)])
    cur = old.cursor(min_read=4096)
    assert cur.read(0, 10, 0).n == 10
    old.delete()
    new = open_log(tmp_path / "t", seg=1 << 20)
    put(new, [b"new" * 40 for _ in range(100)])     # the same file name, other bytes
    assert drain(cur, 10, 100, 10) == [body(i) for i in range(10, 100)]


def test_one_off_reads_own_their_buffer(disk_log: TopicLog) -> None:
    a = disk_log.read(3, 5, 0)
    frames = bytes(a.frames(0, a.n))
    for off in range(0, 2000, 97):
        disk_log.read(off, 5, 0)
    assert bytes(a.frames(0, a.n)) == frames and a.payload(0)[34:] == body(3)


def test_timestamps_share_reads(disk_log: TopicLog) -> None:
    offsets = list(range(1000, 1100))
    assert disk_log.timestamps(offsets) == [TS] * 100
    assert disk_log.bytes_read < 100 * 150 + 64 * 1024


class CursorMachine(RuleBasedStateMachine):
    """Random appends (some records larger than the read-ahead), reads at random
    offsets with random sizes and hints, retention and releases: every batch holds
    exactly the records asked for."""

    @initialize()
    def setup(self) -> None:
        import tempfile
        self.dir = tempfile.mkdtemp(prefix="cursor-")
        self.log = open_log(Path(self.dir) / "t", mem=3, seg=8 * 1024)
        self.cur = self.log.cursor(min_read=512, max_read=4096)
        self.bodies: list[bytes] = []

    def teardown(self) -> None:
        import shutil
        self.cur.release()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @rule(sizes=st.lists(st.sampled_from([1, 20, 100, 700, 5000]), min_size=1, max_size=30))
    def append(self, sizes: list[int]) -> None:
        n = len(self.bodies)
        new = [(b"%d." % (n + i)) * (s // 4 + 1) for i, s in enumerate(sizes)]
        put(self.log, new)
        self.bodies += new

    @precondition(lambda self: self.bodies)
    @rule(data=st.data(), want=st.integers(1, 40), ahead=st.integers(0, 100))
    def read(self, data: st.DataObject, want: int, ahead: int) -> None:
        off = data.draw(st.integers(self.log.oldest, self.log.written))
        b = self.cur.read(off, want, 0, ahead)
        assert b.first == off
        if off == self.log.written:
            assert b.n == 0
            return
        assert 1 <= b.n <= want
        assert [b.payload(i)[34:] for i in range(b.n)] == self.bodies[off:off + b.n]

    @precondition(lambda self: self.bodies)
    @rule(data=st.data(), want=st.integers(1, 40))
    def read_on(self, data: st.DataObject, want: int) -> None:
        """The next records after the last batch (the sequential case)."""
        nxt = self.cur.next_offset
        if not self.log.oldest <= nxt < self.log.written:
            return
        b = self.cur.read(nxt, want, 0, want)
        assert b.first == nxt and 1 <= b.n
        assert [b.payload(i)[34:] for i in range(b.n)] == self.bodies[nxt:nxt + b.n]

    @precondition(lambda self: len(self.log.segments()) > 2)
    @rule(data=st.data())
    def retention(self, data: st.DataObject) -> None:
        segs = self.log.segments()
        cut = data.draw(st.sampled_from([s.end for s in segs[:-1]]))
        self.log.drop_before(cut)

    @rule()
    def release(self) -> None:
        self.cur.release()

    @invariant()
    def holds_at_most_one_descriptor(self) -> None:
        if self.cur._seg is None:
            assert self.cur._fd < 0


TestCursorMachine = CursorMachine.TestCase
TestCursorMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
