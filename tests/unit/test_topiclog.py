"""TopicLog on a temporary directory: append and read across the memory tail and the
segment files, roll-over, reopen, torn tails, damaged records, time lookups, segment
deletion, the ephemeral bound, write failures, and sync beside appends."""
from __future__ import annotations

import os
import resource
import signal
import struct
import threading
from pathlib import Path

import pytest

from pybroker.storage import StorageError
from pybroker.storage.topiclog import SEG_HEADER_SIZE, OffsetOutOfRange, TopicLog

TS = 1_700_000_000 * 10**9


def open_log(path: Path | None, mem: int = 10, seg: int = 4096) -> TopicLog:
    return TopicLog(None if path is None else str(path), max_bytes_per_file=seg,
                    mem_records=mem, max_record_bytes=1 << 16)


def put(log: TopicLog, bodies: list[bytes], ts: int = TS, deliver_at: int = 0) -> int:
    with log.lock:
        first = log.append(bodies, ts, deliver_at)
        log.write_pending()
    return first


def read_all(log: TopicLog, start: int | None = None) -> list[tuple[int, bytes]]:
    """(offset, body) of every record from start (default: oldest) to written."""
    out = []
    off = log.oldest if start is None else start
    while off < log.written:
        b = log.read(off, 7, 1 << 20)
        assert b.n >= 1
        for i in range(b.n):
            out.append((b.first + i, b.payload(i)[34:]))
        off = b.first + b.n
    return out


def bodies(n: int, prefix: bytes = b"m") -> list[bytes]:
    return [prefix + b"%04d" % i for i in range(n)]


def test_offsets_ids_and_reads_from_memory_and_disk(tmp_path: Path) -> None:
    log = open_log(tmp_path / "t", mem=10)
    assert put(log, bodies(50)) == 0
    assert put(log, [b"x"]) == 50
    assert (log.oldest, log.written, log.head) == (0, 51, 51)
    assert log.tail_start >= 41          # the newest 10 in memory, the rest on disk
    got = read_all(log)
    assert [o for o, _ in got] == list(range(51))
    assert [b for _, b in got] == bodies(50) + [b"x"]
    payload = log.payload(7)
    assert payload is not None and payload[18:34] == b"%016x" % 7   # the id is the offset
    with pytest.raises(OffsetOutOfRange):
        log.read(52, 1, 100)
    assert log.read(51, 5, 100).n == 0


def test_roll_over_reopen_and_drop_before(tmp_path: Path) -> None:
    log = open_log(tmp_path / "t", seg=2048)
    for _ in range(20):
        put(log, bodies(10))
    segs = log.segments()
    assert len(segs) > 3 and segs[0].base == 0 and segs[-1].end == 200
    assert all(a.end == b.base for a, b in zip(segs, segs[1:]))
    log.close()
    again = open_log(tmp_path / "t", seg=2048)
    assert (again.oldest, again.written) == (0, 200)
    assert [b for _, b in read_all(again)] == bodies(10) * 20
    assert put(again, [b"after"]) == 200
    cut = segs[2].end
    assert again.drop_before(cut) == cut
    assert again.oldest == cut and not (tmp_path / "t" / ("%020d.log" % 0)).exists()
    with pytest.raises(OffsetOutOfRange):
        again.read(0, 1, 100)
    assert read_all(again)[0][0] == cut
    assert again.drop_before(10**9) == again.segments()[0].base   # never the active one


def test_torn_tail_is_cut_on_open(tmp_path: Path) -> None:
    log = open_log(tmp_path / "t")
    put(log, bodies(5))
    log.close()
    seg = tmp_path / "t" / ("%020d.log" % 0)
    size = seg.stat().st_size
    os.truncate(seg, size - 7)
    again = open_log(tmp_path / "t")
    assert again.written == 4 and seg.stat().st_size < size - 7
    assert [b for _, b in read_all(again)] == bodies(4)
    assert put(again, [b"next"]) == 4


def test_damaged_record_costs_only_itself(tmp_path: Path) -> None:
    log = open_log(tmp_path / "t", mem=0, seg=1 << 20)
    for _ in range(3):
        put(log, bodies(5))
    log.close()
    seg = tmp_path / "t" / ("%020d.log" % 0)
    raw = bytearray(seg.read_bytes())
    # find record 7 and flip a byte of its body
    pos = SEG_HEADER_SIZE
    for _ in range(7):
        pos += 16 + struct.unpack_from(">I", raw, pos + 4)[0]
    raw[pos + 16 + 34 + 2] ^= 0xFF        # a byte of its body
    seg.write_bytes(bytes(raw))
    again = open_log(tmp_path / "t", mem=0, seg=1 << 20)
    got = read_all(again)
    assert [o for o, _ in got] == [o for o in range(15) if o != 7]
    assert (tmp_path / "t" / ("%020d.log.bad" % 0)).exists()


def test_offset_for_time(tmp_path: Path) -> None:
    log = open_log(tmp_path / "t", seg=1024)
    for i in range(10):
        put(log, bodies(5), ts=TS + i * 1000)
    assert log.offset_for_time(0) == 0
    assert log.offset_for_time(TS + 3000) == 15
    assert log.offset_for_time(TS + 2500) == 15
    assert log.offset_for_time(TS + 10**9) == 50


def test_ephemeral_log_keeps_only_its_memory_bound() -> None:
    log = open_log(None, mem=5)
    put(log, bodies(3))
    put(log, bodies(4, b"n"))
    assert log.oldest == 2 and log.written == 7 and log.dropped_count == 2
    assert [o for o, _ in read_all(log)] == list(range(2, 7))


def test_deferred_records_are_found(tmp_path: Path) -> None:
    log = open_log(tmp_path / "t")
    put(log, [b"a"])
    put(log, [b"b", b"c"], deliver_at=TS + 5)
    assert log.read(0, 10, 1 << 20).deferred_indices(3) == []
    b = log.read(1, 10, 1 << 20)
    assert b.deferred_indices(2) == [0, 1] and b.deliver_at(1) == TS + 5
    log.close()
    again = open_log(tmp_path / "t")
    assert again.recovered_dpubs == [(1, TS + 5), (2, TS + 5)]


def test_write_failure_leaves_nothing_half_written(tmp_path: Path) -> None:
    log = open_log(tmp_path / "t", seg=1 << 20)
    put(log, bodies(3))
    seg = tmp_path / "t" / ("%020d.log" % 0)
    size = seg.stat().st_size
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size + 10, hard))
    try:
        with log.lock:
            log.append([b"y" * 100], TS)
            with pytest.raises(StorageError):
                log.write_pending()
            log.discard_pending()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    assert seg.stat().st_size == size and (log.head, log.written) == (3, 3)
    assert put(log, [b"ok"]) == 3
    log.close()
    assert [b for _, b in read_all(open_log(tmp_path / "t", seg=1 << 20))] == bodies(3) + [b"ok"]


def test_sync_beside_appends(tmp_path: Path) -> None:
    log = open_log(tmp_path / "t", seg=8192)
    stop = threading.Event()
    synced: list[int] = []

    def syncer() -> None:
        while not stop.is_set():
            synced.append(log.sync())

    th = threading.Thread(target=syncer)
    th.start()
    for _ in range(200):
        put(log, bodies(5))
    stop.set()
    th.join()
    assert synced == sorted(synced) and log.sync() == 1000
    assert len(read_all(log)) == 1000


@pytest.mark.parametrize("on_disk", [False, True])
@pytest.mark.parametrize("kind", ["append", "dpub", "parts", "raw", "two"])
def test_a_write_knows_its_records_as_a_scan_would(tmp_path: Path, on_disk: bool,
                                                   kind: str) -> None:
    """write_pending takes a lone build's record starts, newest time and deferred count
    from the build instead of scanning what it wrote: the same as the scan finds, in
    the block kept in memory and the segment's newest time (``two`` builds: scanned)."""
    from pybroker import _native

    log = open_log(tmp_path / "t" if on_disk else None, mem=1000, seg=1 << 20)
    put(log, [b"before"], ts=TS - 5)
    bodies = [b"m%d" % i * (i + 1) for i in range(7)]
    with log.lock:
        first = log.head
        if kind in ("append", "two"):
            log.append(bodies, TS + 3)
        elif kind == "dpub":
            log.append(bodies[:1], TS + 3, TS + 10**9)
        elif kind == "parts":
            src = b"".join(bodies)
            offs, at = [], 0
            for b in bodies:
                offs.append(at)
                at += len(b)
            log.append_parts(src, offs, [len(b) for b in bodies], TS + 3)
        else:
            data, _ = _native.log_build(first, TS + 3, 0, b"".join(bodies),
                                        [sum(map(len, bodies[:i])) for i in range(7)],
                                        [len(b) for b in bodies])
            log.append_raw(data, first)
        if kind == "two":
            log.append([b"late"], TS + 9)
        log.write_pending()
    block = log._blocks[-1]
    pos, used, (_, deferred, newest) = _native.log_scan(block.data, first, True,
                                                        log.max_payload, 1 << 20)
    assert used == len(block.data)
    assert list(block.pos) == list(pos) and block.deferred == deferred
    if on_disk:
        assert log._segs[-1].max_ts == max(newest, TS - 5)
    assert [b for _, b in read_all(log, first)] == (
        bodies[:1] if kind == "dpub" else bodies + ([b"late"] if kind == "two" else []))


@pytest.mark.parametrize("on_disk", [True, False])
def test_restart_at_drops_everything_and_begins_there(tmp_path: Path, on_disk: bool) -> None:
    """A replica behind its leader's oldest record begins again there: every record
    and segment file goes, the next write starts a segment at that offset, reads and a
    reopen see the log from there on."""
    path = tmp_path / "t" if on_disk else None
    log = open_log(path, mem=10, seg=1024)
    for k in range(6):
        put(log, bodies(10, b"%d" % k))
    if on_disk:
        assert len(log.segments()) > 1
        log.sync()
    with log.lock:
        log.restart_at(500)
    assert (log.oldest, log.written, log.head) == (500, 500, 500)
    assert log.segments() == [] and read_all(log) == []
    if on_disk:
        assert [p for p in os.listdir(path) if p.endswith(".log")] == []
    with pytest.raises(OffsetOutOfRange):
        log.read(10, 1, 1 << 20)
    assert put(log, bodies(5, b"n")) == 500
    assert read_all(log) == list(zip(range(500, 505), bodies(5, b"n")))
    if on_disk:
        assert [s.base for s in log.segments()] == [500]
        log.close()
        again = open_log(path)
        assert (again.oldest, again.written) == (500, 505)
        assert read_all(again) == list(zip(range(500, 505), bodies(5, b"n")))
        again.close()
