"""Lookups by time (storage/timeindex.py): for any log (writes of any size, publish
times in and out of order, segments rolled, reopened by recovery, the oldest segments
deleted, a memory-only log), ``offset_for_time(t)`` is exactly the first offset whose
publish time is >= t, as a scan of every record finds it; and it reads at most one
small stretch of one segment."""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pybroker.storage import timeindex
from pybroker.storage.topiclog import TopicLog

MS = 1_000_000


def brute(log: TopicLog, times: list[int], t: int) -> int:
    for off in range(log.oldest, log.written):
        if times[off] >= t:
            return off
    return log.written


def open_log(directory: str | None, seg_bytes: int = 4000) -> TopicLog:
    return TopicLog(directory, max_bytes_per_file=seg_bytes, mem_records=5,
                    max_record_bytes=600)


writes = st.lists(st.tuples(st.integers(1, 40), st.integers(0, 300),
                            st.integers(-50, 100), st.integers(-1, 30)),
                  min_size=1, max_size=25)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(writes=writes, queries=st.lists(st.integers(-10, 3000), min_size=1, max_size=8),
       every=st.sampled_from([64, 300, 2048]), drop=st.booleans())
def test_lookup_is_the_first_offset_at_or_after(writes: list[tuple[int, int, int, int]],
                                                queries: list[int], every: int,
                                                drop: bool) -> None:
    """Writes of n records of some body size; each write's time steps by dt ms from
    the last (negative: the clock stepped back). A write of one append has one time
    for all its records (the index is told it, no scan); with ``split`` >= 0 a second
    append of a few records, ``split - 15`` ms after the first (earlier, perhaps), joins
    the same write (times differ within it: the index scans)."""
    old_every = timeindex.EVERY
    timeindex.EVERY = every
    d = tempfile.mkdtemp(prefix="tix-")
    try:
        log = open_log(d)
        times: list[int] = []
        now = 1000 * MS
        for n, size, dt, split in writes:
            now = max(0, now + dt * MS)
            with log.lock:
                log.append([b"x" * size] * n, now)
                times += [now] * n
                if split >= 0:
                    later = max(0, now + (split - 15) * MS)
                    log.append([b"y" * size] * (split % 7 + 1), later)
                    times += [later] * (split % 7 + 1)
                log.write_pending()
        qs = [q * MS for q in queries] + [times[0], times[-1], max(times), min(times)]
        for t in qs:
            assert log.offset_for_time(t) == brute(log, times, t), t
        if drop and len(log.segments()) > 1:
            log.drop_before(log.segments()[1].base)
        log.close()
        again = open_log(d)     # recovery rebuilds the index from the files
        for t in qs:
            assert again.offset_for_time(t) == brute(again, times, t), t
        again.close()
    finally:
        timeindex.EVERY = old_every
        shutil.rmtree(d, ignore_errors=True)


def test_memory_only_log_is_scanned() -> None:
    log = open_log(None)
    for i, ts in enumerate([5, 3, 9, 9, 12]):
        with log.lock:
            log.append([b"m%d" % i], ts * MS)
            log.write_pending()
    times = [5, 3, 9, 9, 12]
    for t in range(0, 14):
        assert log.offset_for_time(t * MS) == brute(log, [x * MS for x in times], t * MS)


def test_a_lookup_reads_one_small_stretch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 20 MiB segment: the lookup preads at most EVERY bytes plus a record, once."""
    d = tempfile.mkdtemp(prefix="tix-")
    try:
        log = TopicLog(d, max_bytes_per_file=64 << 20, mem_records=5, max_record_bytes=2048)
        t0 = 1_700_000_000_000 * MS
        for k in range(200):                # 200 writes of 100 records of 1 KiB
            with log.lock:
                log.append([b"y" * 1000] * 100, t0 + k * MS)
                log.write_pending()
        assert log.segments()[0].size_bytes > 20 << 20
        reads: list[int] = []
        real = os.pread

        def counting(fd: int, n: int, at: int) -> bytes:
            reads.append(n)
            return real(fd, n, at)

        monkeypatch.setattr(timeindex.os, "pread", counting)
        assert log.offset_for_time(t0 + 150 * MS) == 150 * 100
        assert log.offset_for_time(t0 + 199 * MS + 1) == log.written
        assert log.offset_for_time(t0 - 1) == 0
        assert len(reads) == 2 and max(reads) <= timeindex.EVERY + 2048
        log.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_damage_in_the_stretch_falls_back_to_reading_on() -> None:
    d = tempfile.mkdtemp(prefix="tix-")
    try:
        log = open_log(d, seg_bytes=1 << 20)
        for k in range(50):
            with log.lock:
                log.append([b"z" * 100], (1000 + k) * MS)
                log.write_pending()
        log.close()
        seg = os.path.join(d, sorted(os.listdir(d))[0])
        with open(seg, "r+b") as f:          # damage record 20's body
            f.seek(16 + 20 * (16 + 34 + 100) + 60)
            f.write(b"!")
        again = open_log(d, seg_bytes=1 << 20)
        assert again.offset_for_time(1020 * MS) == 21     # 20 is skipped as damaged
        assert again.offset_for_time(1030 * MS) == 30
        again.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)
