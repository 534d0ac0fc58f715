"""DiskQueue: FIFO, roll-over, reopen, acks, torn and damaged data, OS write errors."""
from __future__ import annotations

import json
import logging
import os
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import zlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pybroker.storage import (
    Backend,
    DiskFullError,
    DiskQueue,
    NullBackend,
    QueueClosedError,
    StorageError,
    UnsupportedFormatError,
    list_queues,
)
from pybroker.storage.diskqueue import DEFAULT_MAX_BYTES_PER_FILE

ROOT = Path(__file__).resolve().parents[2]
HDR, REC = 32, 16                      # segment header, record header sizes (format 1)


def recs(n: int, size: int = 40, tag: str = "r") -> list[bytes]:
    return [f"{tag}{i:06d}".encode().ljust(size, b".") for i in range(n)]


def segments(q: DiskQueue) -> list[Path]:
    return sorted(Path(q.path).glob("*.seg"))


def drain(q: DiskQueue, ack: bool = True) -> list[tuple[int, bytes]]:
    out = q.read_many(1_000_000)
    if ack:
        q.ack_many(s for s, _ in out)
    return out


def reopen(q: DiskQueue, **kw: object) -> DiskQueue:
    q.close()
    return DiskQueue(q.root, q.name, **kw)  # type: ignore[arg-type]


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


# -- basics ---------------------------------------------------------------------------
def test_fifo_and_consecutive_seqs(tmp_path: Path) -> None:
    q = DiskQueue(tmp_path, "t")
    assert q.is_empty() and q.read_many(10) == []
    assert q.put(b"a") == 0
    assert q.put_many([b"b", b"c", b""]) == 1
    assert q.put_many([]) == 4
    assert q.depth() == 4
    assert q.read_many(2) == [(0, b"a"), (1, b"b")]
    assert q.depth() == 2 and q.unacked_count() == 2
    assert q.read_many(10) == [(2, b"c"), (3, b"")]
    assert q.is_empty()
    q.close()


def test_put_many_is_one_write(tmp_path: Path) -> None:
    q = DiskQueue(tmp_path, "t")
    before = q.stats()["writes"]
    q.put_many(recs(200, 200))
    assert q.stats()["writes"] == before + 1
    q.close()


def test_record_size_limit(tmp_path: Path) -> None:
    q = DiskQueue(tmp_path, "t", max_record_bytes=100)
    q.put(b"x" * 100)
    with pytest.raises(ValueError):
        q.put_many([b"ok", b"x" * 101])
    assert [d for _, d in q.read_many(10)] == [b"x" * 100]
    q.close()


def test_roll_over_keeps_order_and_survives_reopen(tmp_path: Path) -> None:
    q = DiskQueue(tmp_path, "t", max_bytes_per_file=1024)
    data = recs(100)
    for i in range(0, 100, 7):
        q.put_many(data[i:i + 7])
    segs = segments(q)
    assert len(segs) > 5
    assert all(p.stat().st_size <= 1024 for p in segs)
    q = reopen(q, max_bytes_per_file=1024)
    assert [d for _, d in drain(q)] == data
    q.close()


def test_oversized_batch_gets_its_own_segment(tmp_path: Path) -> None:
    q = DiskQueue(tmp_path, "t", max_bytes_per_file=1024)
    q.put(b"small")
    q.put_many(recs(50))                 # ~2.8 KB in one batch
    q.put(b"after")
    assert len(segments(q)) == 3
    assert [d for _, d in drain(q)] == [b"small", *recs(50), b"after"]
    q.close()


# -- acks and reopen ------------------------------------------------------------------
def test_unacked_records_come_back_after_reopen(tmp_path: Path) -> None:
    q = DiskQueue(tmp_path, "t", max_bytes_per_file=512)
    data = recs(30)
    q.put_many(data[:10])
    q.put_many(data[10:20])
    q.put_many(data[20:])
    got = q.read_many(20)
    q.ack_many(s for s, _ in got if s % 3 == 0)          # out of order acks
    q = reopen(q, max_bytes_per_file=512)
    assert q.depth() == 30 - 7
    again = drain(q)
    assert [s for s, _ in again] == [s for s in range(30) if not (s < 20 and s % 3 == 0)]
    assert all(d == data[s] for s, d in again)
    q = reopen(q, max_bytes_per_file=512)
    assert q.depth() == 0 and q.read_many(10) == []
    q.close()


def test_acks_after_last_checkpoint_only_cause_duplicates(tmp_path: Path) -> None:
    q = DiskQueue(tmp_path, "t")
    q.put_many(recs(10))
    got = q.read_many(10)
    q.ack_many(s for s, _ in got[:5])
    q.checkpoint()
    q.ack_many(s for s, _ in got[5:])                    # lost: no checkpoint follows
    q2 = DiskQueue(tmp_path, "t")                        # as after a crash
    assert [s for s, _ in q2.read_many(100)] == [5, 6, 7, 8, 9]
    q2.close()
    q.close()


def test_claimed_records_are_not_read_back_but_survive_a_crash(tmp_path: Path) -> None:
    q = DiskQueue(tmp_path, "t")
    first = q.put_many([b"m0", b"m1", b"m2"], claim=True)
    assert first == 0 and q.depth() == 0 and q.unacked_count() == 3
    assert q.read_many(10) == []
    q.ack(1)
    q.put(b"disk-only")
    q.put_many([b"ahead-1", b"ahead-2"], claim=True)     # overtakes the backlog
    q.put(b"disk-2")
    assert q.depth() == 2 and q.unacked_count() == 4
    assert q.ack(5) is True and q.ack(5) is False
    assert q.read_many(10) == [(3, b"disk-only"), (6, b"disk-2")]
    assert q.unacked_count() == 5
    q.checkpoint()
    q2 = DiskQueue(tmp_path, "t")                       # as after a crash
    assert q2.read_many(10) == [(0, b"m0"), (2, b"m2"), (3, b"disk-only"),
                                (4, b"ahead-1"), (6, b"disk-2")]
    q2.close()
    q.close()


def test_claim_ahead_acked_before_the_reader_passes_it(tmp_path: Path) -> None:
    q = DiskQueue(tmp_path, "t")
    q.put_many([b"a", b"b"])
    q.put(b"deferred", claim=True)
    q.ack(2)
    q.checkpoint()
    assert q.read_many(10) == [(0, b"a"), (1, b"b")]
    q.put(b"c", claim=True)                             # caught up: cursor jumps
    q = reopen(q)
    assert q.read_many(10) == [(0, b"a"), (1, b"b"), (3, b"c")]
    q.close()


def test_auto_ack_reads_advance_for_good(tmp_path: Path) -> None:
    q = DiskQueue(tmp_path, "t")
    q.put_many(recs(5))
    assert len(q.read_many(3, auto_ack=True)) == 3
    assert q.unacked_count() == 0
    q = reopen(q)
    assert [s for s, _ in q.read_many(10)] == [3, 4]
    q.close()


def test_ack_unknown_seq_is_a_noop(tmp_path: Path) -> None:
    q = DiskQueue(tmp_path, "t")
    q.put(b"a")
    assert q.ack(0) is False                              # not handed out yet
    q.read_many(1)
    assert q.ack(0) is True and q.ack(0) is False
    assert q.ack_many([0, 99]) == 0
    q.close()


def test_kill9_at_least_once(tmp_path: Path) -> None:
    """A real SIGKILL: every put record not acked before the last checkpoint returns."""
    script = textwrap.dedent(f"""
        import os, signal, sys, json
        sys.path.insert(0, {str(ROOT)!r})
        from pybroker.storage import DiskQueue
        q = DiskQueue({str(tmp_path)!r}, "t:c", max_bytes_per_file=2048)
        q.put_many([b"a%d" % i for i in range(50)])
        got = q.read_many(30)
        q.ack_many(s for s, _ in got[:20])
        q.checkpoint()
        q.ack_many(s for s, _ in got[20:])        # after the checkpoint: may come back
        q.put_many([b"b%d" % i for i in range(20)], claim=False)
        q.read_many(100)
        first = q.put_many([b"c%d" % i for i in range(10)], claim=True)  # durable mode
        assert q.sync(first + 9) == first + 9     # "OK" may be sent to the publisher
        q.ack_many(range(first, first + 5))       # FIN'd, but no checkpoint after
        print(json.dumps([s for s, _ in got[:20]]), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60,
                          check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    acked = set(json.loads(proc.stdout))
    q = DiskQueue(tmp_path, "t:c", max_bytes_per_file=2048)
    seqs = [s for s, _ in drain(q)]
    assert seqs == sorted(seqs)
    assert set(seqs) == set(range(80)) - acked
    q.close()


def test_meta_position_not_on_a_record_boundary_is_rescanned(tmp_path: Path) -> None:
    q = DiskQueue(tmp_path, "t")
    q.put_many(recs(10))
    got = q.read_many(4)
    q.ack_many(s for s, _ in got)
    q.close()
    meta_path = Path(q.path) / "meta"
    meta = json.loads(meta_path.read_text())
    meta["start"][1] += 3                                 # not a record boundary
    meta_path.write_text(json.dumps(meta))
    q = DiskQueue(tmp_path, "t")
    assert [s for s, _ in q.read_many(100)] == [4, 5, 6, 7, 8, 9]
    q.close()


def test_fully_acked_segments_are_deleted_but_pinned_ones_kept(tmp_path: Path) -> None:
    q = DiskQueue(tmp_path, "t", max_bytes_per_file=400)
    for i in range(6):
        q.put_many(recs(5, tag=f"s{i}-"))                 # one segment per batch
    assert len(segments(q)) == 6
    got = q.read_many(30)
    q.ack_many(s for s, _ in got if s != 7)               # seq 7 lives in segment 1
    q.checkpoint()
    names = [p.name for p in segments(q)]
    assert names == ["00000001.seg", "00000005.seg"]
    q.ack(7)
    q.checkpoint()
    assert [p.name for p in segments(q)] == ["00000005.seg"]
    q = reopen(q, max_bytes_per_file=400)
    assert q.read_many(10) == []
    assert q.put(b"next") == 30
    q.close()


def test_empty_and_delete(tmp_path: Path) -> None:
    q = DiskQueue(tmp_path, "t", max_bytes_per_file=400)
    q.put_many(recs(20))
    q.read_many(5)
    q.empty()
    assert q.depth() == 0 and q.unacked_count() == 0 and segments(q) == []
    assert q.ack(0) is False
    assert q.put(b"x") == 20                               # seqs never go back
    q = reopen(q, max_bytes_per_file=400)
    assert q.read_many(10) == [(20, b"x")]
    q.empty()
    q = reopen(q, max_bytes_per_file=400)
    assert q.put(b"y") == 21
    path = q.path
    q.delete()
    assert not os.path.exists(path)
    assert not any(p.name.startswith(".deleted") for p in tmp_path.iterdir())
    with pytest.raises(QueueClosedError):
        q.put(b"z")


def test_backends_satisfy_the_protocol(tmp_path: Path) -> None:
    q = DiskQueue(tmp_path, "t")
    assert isinstance(q, Backend)
    q.close()
    null = NullBackend("t#ephemeral")
    assert isinstance(null, Backend)
    assert null.put_many([b"a", b"b"]) == 0 and null.put(b"c", claim=True) == 2
    assert null.depth() == 0 and null.read_many(10) == [] and null.sync(2) == 2


# -- sync policy and group commit -----------------------------------------------------
def test_maybe_sync_policy_with_injected_time(tmp_path: Path) -> None:
    q = DiskQueue(tmp_path, "t", sync_every=10, sync_timeout_s=2.0)
    assert q.maybe_sync(0) is False
    q.put_many(recs(3))
    assert q.maybe_sync(1_000_000_000) is False            # 1 s, 3 ops
    assert q.maybe_sync(2_000_000_000) is True             # timeout with activity
    assert q.synced_seq == 2
    assert q.maybe_sync(9_000_000_000) is False            # no activity, no sync
    q.put_many(recs(10))
    assert q.maybe_sync(9_000_000_001) is True             # sync_every reached
    assert (Path(q.path) / "meta").exists()
    q.close()


def test_group_commit_many_publishers_share_fsyncs(tmp_path: Path) -> None:
    q = DiskQueue(tmp_path, "t", max_bytes_per_file=64 * 1024)
    n_threads, per_thread = 4, 200
    acked: list[int] = []
    lock = threading.Lock()

    def publisher(k: int) -> None:
        for i in range(per_thread):
            seq = q.put(b"p%d-%d" % (k, i))
            synced = q.sync(seq)              # acknowledged only once on disk
            assert synced >= seq
            with lock:
                acked.append(seq)

    threads = [threading.Thread(target=publisher, args=(k,)) for k in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(acked) == list(range(n_threads * per_thread))
    stats = q.stats()
    assert stats["synced_seq"] == n_threads * per_thread - 1
    assert 0 < stats["fsyncs"] <= n_threads * per_thread + 10   # rolls add a few
    assert len(drain(q)) == n_threads * per_thread
    q.close()


def test_sync_with_a_covered_seq_does_not_fsync_again(tmp_path: Path) -> None:
    q = DiskQueue(tmp_path, "t")
    a = q.put(b"a")
    b = q.put(b"b")
    assert q.sync(a) == b                     # one fsync covers both
    fsyncs = q.stats()["fsyncs"]
    assert q.sync(a) == b and q.sync(b) == b and q.sync() == b
    assert q.stats()["fsyncs"] == fsyncs
    c = q.put(b"c")
    assert q.sync(c) == c and q.stats()["fsyncs"] > fsyncs
    q.close()


def test_producer_consumer_and_checkpointer_threads(tmp_path: Path) -> None:
    q = DiskQueue(tmp_path, "t", max_bytes_per_file=4096, sync_every=50)
    total, seen = 3000, []
    stop = threading.Event()

    def producer() -> None:
        for i in range(0, total, 30):
            q.put_many([b"%d" % j for j in range(i, i + 30)])

    def consumer() -> None:
        while len(seen) < total:
            got = q.read_many(64)
            seen.extend(int(d) for _, d in got)
            q.ack_many(s for s, _ in got)

    def checkpointer() -> None:
        now = 0
        while not stop.is_set():
            now += 10_000_000
            q.maybe_sync(now)

    threads = [threading.Thread(target=f) for f in (producer, consumer, checkpointer)]
    for t in threads:
        t.start()
    for t in threads[:2]:
        t.join(60)
    stop.set()
    threads[2].join(10)
    assert seen == list(range(total))
    q = reopen(q, max_bytes_per_file=4096)
    assert q.read_many(10) == [] and len(segments(q)) == 1
    q.close()


def test_os_errors_map_to_storage_errors() -> None:
    import errno

    from pybroker.storage import StorageAccessError, StorageIOError
    from pybroker.storage.errors import from_oserror
    for num, cls in [(errno.ENOSPC, DiskFullError), (errno.EDQUOT, DiskFullError),
                     (errno.EFBIG, DiskFullError), (errno.EACCES, StorageAccessError),
                     (errno.EROFS, StorageAccessError), (errno.EIO, StorageIOError)]:
        err = from_oserror("cannot write to", "/x", OSError(num, os.strerror(num)))
        assert type(err) is cls and err.errno == num and err.path == "/x"
        assert errno.errorcode[num] in str(err)


# -- torn writes and damage -----------------------------------------------------------
@pytest.mark.parametrize("tail", [b"\x00" * 4096, None, "partial-header"])
def test_torn_tail_is_cut_off(tmp_path: Path, tail: bytes | str | None,
                              caplog: pytest.LogCaptureFixture) -> None:
    q = DiskQueue(tmp_path, "t")
    q.put_many(recs(10))
    q.close()
    seg = segments(q)[-1]
    size = seg.stat().st_size
    with open(seg, "ab") as f:
        if tail is None:        # a whole record header + half the data
            data = b"y" * 100
            ls = struct.pack(">IQ", len(data), 10)
            f.write(struct.pack(">I", zlib.crc32(data, zlib.crc32(ls))) + ls + data[:50])
        elif tail == "partial-header":
            f.write(b"\x01\x02\x03")
        else:
            assert isinstance(tail, bytes)
            f.write(tail)
    with caplog.at_level(logging.WARNING, "pybroker.storage"):
        q = DiskQueue(tmp_path, "t")
    assert "torn" in caplog.text
    assert seg.stat().st_size == size
    assert q.put(b"after") == 10
    q = reopen(q)
    assert [d for _, d in drain(q)] == [*recs(10), b"after"]
    assert not list(Path(q.path).glob("*.bad"))
    q.close()


def test_bad_crc_in_sealed_segment_keeps_intact_records(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    q = DiskQueue(tmp_path, "t", max_bytes_per_file=1024)
    for i in range(3):
        q.put_many(recs(10, 40, tag=f"s{i}-"))            # 560 B: one batch/segment
    q.close()
    first = segments(q)[0]
    flip_byte(first, HDR + 4 * (REC + 40) + REC + 5)      # data of record 4
    q = DiskQueue(tmp_path, "t", max_bytes_per_file=1024)
    with caplog.at_level(logging.ERROR, "pybroker.storage"):
        got = q.read_many(100)
    # one bad record costs only itself: reading resyncs on the next intact record
    assert [s for s, _ in got] == [0, 1, 2, 3, *range(5, 30)]
    assert "checksum mismatch" in caplog.text and "seqs 4..4 lost" in caplog.text
    bad = Path(str(first) + ".bad")
    assert bad.exists() and bad.stat().st_size == HDR + 10 * (REC + 40)   # a copy
    assert first.stat().st_size == HDR + 10 * (REC + 40)
    q.close()
    q = DiskQueue(tmp_path, "t", max_bytes_per_file=1024)  # nothing was acked
    assert [s for s, _ in q.read_many(100)] == [0, 1, 2, 3, *range(5, 30)]
    q.close()


def test_impossible_length_is_damage(tmp_path: Path) -> None:
    q = DiskQueue(tmp_path, "t", max_bytes_per_file=1024, max_record_bytes=1000)
    q.put_many(recs(10))
    q.put_many(recs(10, tag="second"))
    q.close()
    first = segments(q)[0]
    with open(first, "r+b") as f:
        f.seek(HDR + 2 * (REC + 40) + 4)
        f.write(struct.pack(">I", 0x7FFFFFF0))
    q = DiskQueue(tmp_path, "t", max_bytes_per_file=1024, max_record_bytes=1000)
    assert [s for s, _ in q.read_many(100)] == [0, 1, *range(3, 20)]
    assert Path(str(first) + ".bad").exists()
    q.close()


@pytest.mark.parametrize("checkpointed", [False, True])
def test_damage_in_last_segment(tmp_path: Path, checkpointed: bool) -> None:
    """Without a checkpoint, open verifies the whole last segment and finds the damage;
    with one, open verifies only past the checkpoint and the read finds it."""
    q = DiskQueue(tmp_path, "t")
    q.put_many(recs(10))
    q.close()
    if not checkpointed:
        (Path(q.path) / "meta").unlink()                 # as a crash before any
    seg = segments(q)[0]
    flip_byte(seg, HDR + 3 * (REC + 40) + REC)           # record 3 of 10: not a tail
    q = DiskQueue(tmp_path, "t")
    assert Path(str(seg) + ".bad").exists() is not checkpointed
    # open-time recovery keeps the intact prefix; a read skips just the bad record
    kept = [0, 1, 2] if not checkpointed else [0, 1, 2, *range(4, 10)]
    assert [s for s, _ in q.read_many(100)] == kept
    assert Path(str(seg) + ".bad").exists()
    new = q.put(b"new")
    assert new >= 10                                     # seqs are never reused
    assert len(segments(q)) == (2 if not checkpointed else 1)
    assert q.read_many(10) == [(new, b"new")]
    q = reopen(q)
    assert [s for s, _ in q.read_many(100)] == [*kept, new]
    q.close()


def test_damage_in_live_segment_found_on_read(tmp_path: Path) -> None:
    q = DiskQueue(tmp_path, "t")
    q.put_many(recs(10))
    flip_byte(segments(q)[0], HDR + 6 * (REC + 40) + REC)  # bit rot under a live queue
    assert [s for s, _ in q.read_many(100)] == [0, 1, 2, 3, 4, 5, 7, 8, 9]
    assert q.depth() == 0
    assert q.put(b"new") == 10
    assert q.read_many(10) == [(10, b"new")]
    q.close()


def test_bad_header_is_moved_aside_and_future_version_refused(tmp_path: Path) -> None:
    q = DiskQueue(tmp_path, "t", max_bytes_per_file=400)
    q.put_many(recs(5))
    q.put_many(recs(5, tag="b"))
    q.close()
    first, second = segments(q)
    flip_byte(first, 0)                                   # magic
    q = DiskQueue(tmp_path, "t", max_bytes_per_file=400)
    assert Path(str(first) + ".bad").exists()
    assert [d for _, d in q.read_many(100)] == recs(5, tag="b")
    q.close()
    hdr = bytearray(second.read_bytes()[:HDR])
    hdr[4:6] = struct.pack(">H", 2)                       # a future format version
    hdr[28:32] = struct.pack(">I", zlib.crc32(bytes(hdr[:28])))
    with open(second, "r+b") as f:
        f.write(hdr)
    before = second.read_bytes()
    with pytest.raises(UnsupportedFormatError):
        DiskQueue(tmp_path, "t", max_bytes_per_file=400)
    assert second.read_bytes() == before


def test_damaged_meta_means_redelivery_not_loss(tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    q = DiskQueue(tmp_path, "t")
    q.put_many(recs(10))
    drain(q)
    q.close()
    (Path(q.path) / "meta").write_bytes(b'{"format": 1, "name": "t", "next_')
    with caplog.at_level(logging.ERROR, "pybroker.storage"):
        q = DiskQueue(tmp_path, "t")
    assert "damaged meta" in caplog.text
    assert (Path(q.path) / "meta.bad").exists()
    assert [s for s, _ in q.read_many(100)] == list(range(10))
    q.close()


# -- names and OS errors --------------------------------------------------------------
def test_names_are_made_safe_and_listed(tmp_path: Path) -> None:
    names = ["topic", "topic:chan", "../evil", ".hidden", "a/b", "x#ephemeral", "é" * 150]
    for n in names:
        DiskQueue(tmp_path, n).close()
    for entry in tmp_path.iterdir():
        assert entry.parent == tmp_path and not entry.name.startswith(".")
        assert "/" not in entry.name and ":" not in entry.name and len(entry.name) <= 200
    assert sorted(list_queues(tmp_path)) == sorted(names)


def test_missing_directory_is_created(tmp_path: Path) -> None:
    q = DiskQueue(tmp_path / "a" / "b", "t")
    q.put(b"x")
    assert [d for _, d in q.read_many(1)] == [b"x"]
    q.close()


def test_root_that_is_a_file_raises_storage_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a dir")
    with pytest.raises(StorageError) as ei:
        DiskQueue(tmp_path / "file", "t")
    assert ei.value.errno is not None


def test_segment_creation_failure_raises_and_keeps_data(tmp_path: Path) -> None:
    q = DiskQueue(tmp_path, "t", max_bytes_per_file=400)
    q.put_many(recs(5))
    q.sync()
    os.rename(q.path, q.path + ".moved")                  # the next roll cannot create
    try:
        with pytest.raises(StorageError):
            q.put_many(recs(5, tag="b"))
    finally:
        os.rename(q.path + ".moved", q.path)
    q.close()
    q = DiskQueue(tmp_path, "t", max_bytes_per_file=400)
    assert [d for _, d in q.read_many(100)] == recs(5)
    q.close()


def test_file_size_limit_gives_disk_full_without_corruption(tmp_path: Path) -> None:
    """RLIMIT_FSIZE with SIGXFSZ ignored makes write() fail with EFBIG, like a full disk."""
    script = textwrap.dedent(f"""
        import errno, json, resource, signal, sys
        sys.path.insert(0, {str(ROOT)!r})
        from pybroker.storage import DiskQueue, DiskFullError
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        q = DiskQueue({str(tmp_path)!r}, "t", max_bytes_per_file={DEFAULT_MAX_BYTES_PER_FILE})
        q.put_many([b"a" * 100] * 10)
        q.sync()
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
        ok, err = 0, None
        for i in range(20):
            try:
                q.put_many([b"b" * 100] * 5)
                ok += 1
            except DiskFullError as e:
                err = e.errno
                break
        try:
            q.put(b"c" * 100)                  # still full: raises again, no damage
        except DiskFullError:
            pass
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
        q.put(b"after")
        q.close()
        print(json.dumps({{"ok": ok, "errno": err}}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60,
                          check=False)
    assert proc.returncode == 0, proc.stderr.decode()
    res = json.loads(proc.stdout)
    assert res["errno"] == 27                                 # EFBIG
    q = DiskQueue(tmp_path, "t")
    got = [d for _, d in q.read_many(1000)]
    assert got == [b"a" * 100] * 10 + [b"b" * 100] * (5 * res["ok"]) + [b"after"]
    assert not list(Path(q.path).glob("*.bad"))
    q.close()


# -- model-based: random operations against a simple model ---------------------------

OPS = st.lists(st.one_of(
    st.tuples(st.just("put"), st.integers(1, 12), st.booleans()),
    st.tuples(st.just("read"), st.integers(1, 15), st.booleans()),
    st.tuples(st.just("ack"), st.floats(0, 1), st.booleans()),
    st.tuples(st.just("checkpoint"), st.just(0), st.just(False)),
    st.tuples(st.just("reopen"), st.just(0), st.booleans()),     # True: as after kill -9
    st.tuples(st.just("empty"), st.just(0), st.just(False)),
), max_size=40)


def _crash(q: DiskQueue) -> None:
    """Drop the queue without a checkpoint (what kill -9 leaves: written bytes only)."""
    q._cursor.close_reader()
    q._segs.close()


@settings(max_examples=60, deadline=None)
@given(ops=OPS)
def test_model(ops: list[tuple[str, float, bool]]) -> None:
    import random
    import tempfile
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as d:
        q = DiskQueue(d, "m:c", max_bytes_per_file=300)
        data: dict[int, bytes] = {}
        done: set[int] = set()           # acked and checkpointed
        acked: set[int] = set()          # acked since the last checkpoint
        out: set[int] = set()            # handed out (read or claimed), not acked
        for op, arg, flag in ops:
            pending = sorted(set(data) - done - acked - out)
            if op == "put":
                recs_ = [os.urandom(rng.randrange(0, 40)) for _ in range(int(arg))]
                first = q.put_many(recs_, claim=flag)
                assert first > max(data, default=-1)
                for i, r in enumerate(recs_):
                    data[first + i] = r
                    if flag:
                        out.add(first + i)
            elif op == "read":
                got = q.read_many(int(arg), auto_ack=flag)
                assert [s for s, _ in got] == pending[:int(arg)]
                assert all(data[s] == r for s, r in got)
                (acked if flag else out).update(s for s, _ in got)
            elif op == "ack":
                chosen = {s for s in sorted(out) if rng.random() < arg}
                assert q.ack_many(chosen) == len(chosen)
                out -= chosen
                acked |= chosen
            elif op == "checkpoint":
                q.checkpoint()
                done |= acked
                acked = set()
            elif op == "reopen":
                if flag:
                    _crash(q)
                    acked = set()
                else:
                    q.close()
                    done |= acked
                    acked = set()
                out = set()
                q = DiskQueue(d, "m:c", max_bytes_per_file=300)
            elif op == "empty":
                q.empty()
                done |= set(data)
                acked, out = set(), set()
            assert q.depth() == len(set(data) - done - acked - out)
            assert q.unacked_count() == len(out)
        q.close()
        q = DiskQueue(d, "m:c", max_bytes_per_file=300)
        expect = sorted(set(data) - done - acked)
        got = q.read_many(10_000)
        assert [s for s, _ in got] == expect
        assert all(data[s] == r for s, r in got)
        q.close()
