"""The topic log's write side when the disk fails (docs/storage.md, "When a write
fails"), driven through the fault seam (pybroker.storage.fileops): ENOSPC and EIO on a
write, short writes, a write of nothing, a cut-back that fails, a failed fsync (never
retried; the next write rolls to a new segment), a segment that cannot be created, a
directory fsync that fails. After each, what the log holds is what it reported written,
in memory and after reopening."""
from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from pybroker.storage import DiskFullError, StorageError, StorageIOError
from pybroker.storage.fileops import Fault, FaultyFileOps, FileOps
from pybroker.storage.topiclog import TopicLog

TS = 1_700_000_000 * 10**9


def open_log(path: Path, ops: FileOps, seg: int = 1 << 20) -> TopicLog:
    return TopicLog(str(path), max_bytes_per_file=seg, mem_records=1000,
                    max_record_bytes=1 << 16, fileops=ops)


def put(log: TopicLog, bodies: list[bytes]) -> int:
    """Append and write; returns the epoch written. On failure the records are
    discarded (as Topic.write does) and the error re-raised."""
    with log.lock:
        log.append(bodies, TS)
        try:
            return log.write_pending()
        except StorageError:
            log.discard_pending()
            raise


def bodies_of(log: TopicLog) -> list[bytes]:
    out = []
    off = log.oldest
    while off < log.written:
        b = log.read(off, 100, 1 << 20)
        out += [b.payload(i)[34:] for i in range(b.n)]
        off = b.first + b.n
    return out


def reopened(path: Path) -> list[bytes]:
    return bodies_of(open_log(path, FileOps()))


def segs(path: Path) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.endswith(".log"))


@pytest.mark.parametrize("kind, cls", [("ENOSPC", DiskFullError), ("EIO", StorageIOError)])
def test_failed_write_names_its_epoch_and_leaves_nothing(tmp_path: Path, kind: str,
                                                         cls: type[StorageError]) -> None:
    ops = FaultyFileOps([Fault("pwrite", kind, nth=3)])   # 1: header, 2: first write
    log = open_log(tmp_path / "t", ops)
    assert put(log, [b"a", b"b"]) == 1
    seg = tmp_path / "t" / segs(tmp_path / "t")[0]
    size = seg.stat().st_size
    with pytest.raises(cls) as e:
        put(log, [b"lost"])
    assert e.value.epoch == 2 and kind in str(e.value)
    assert seg.stat().st_size == size and (log.head, log.written) == (2, 2)
    assert put(log, [b"c"]) == 3          # an epoch is used up by the failed write
    assert bodies_of(log) == [b"a", b"b", b"c"]
    log.close()
    assert reopened(tmp_path / "t") == [b"a", b"b", b"c"]


def test_short_write_goes_on_where_it_stopped(tmp_path: Path) -> None:
    ops = FaultyFileOps([Fault("pwrite", "short", nth=2), Fault("pwrite", "short", nth=3)])
    log = open_log(tmp_path / "t", ops)
    assert put(log, [b"x" * 100, b"y" * 100]) == 1     # written in three pwrites
    log.close()
    assert reopened(tmp_path / "t") == [b"x" * 100, b"y" * 100]


@pytest.mark.parametrize("then", ["ENOSPC", "zero"])
def test_short_write_then_nothing_more_is_cut_back(tmp_path: Path, then: str) -> None:
    ops = FaultyFileOps([Fault("pwrite", "short", nth=3), Fault("pwrite", then, nth=4)])
    log = open_log(tmp_path / "t", ops)
    put(log, [b"first"])
    seg = tmp_path / "t" / segs(tmp_path / "t")[0]
    size = seg.stat().st_size
    with pytest.raises(StorageError) as e:
        put(log, [b"z" * 300])
    assert ("short write" in str(e.value)) == (then == "zero")
    assert seg.stat().st_size == size        # the half written is cut off
    put(log, [b"next"])
    log.close()
    assert reopened(tmp_path / "t") == [b"first", b"next"]


def test_failed_cut_back_is_done_before_the_next_write(tmp_path: Path) -> None:
    """A failed write whose cut-back fails too leaves bytes of failed records in the
    file: no later record may be written behind them, so the next write cuts them off
    first, and fails (writing nothing) while it cannot."""
    ops = FaultyFileOps([Fault("pwrite", "short", nth=3), Fault("pwrite", "EIO", nth=4),
                         Fault("ftruncate", "EIO", nth=1, count=2)])
    log = open_log(tmp_path / "t", ops)
    put(log, [b"first"])
    seg = tmp_path / "t" / segs(tmp_path / "t")[0]
    size = seg.stat().st_size
    with pytest.raises(StorageError):
        put(log, [b"f" * 400])
    assert seg.stat().st_size > size              # half of the failed record is there
    with pytest.raises(StorageError) as e:        # the cut-back fails again: no write
        put(log, [b"not written"])
    assert e.value.epoch == 3
    assert seg.stat().st_size > size
    assert put(log, [b"second"]) == 4             # cut back, then written
    log.close()
    assert reopened(tmp_path / "t") == [b"first", b"second"]


def test_failed_fsync_is_never_retried_and_the_next_write_rolls(tmp_path: Path) -> None:
    ops = FaultyFileOps([Fault("fsync", "EIO", nth=3)], record=True)   # 1, 2: file, dir
    log = open_log(tmp_path / "t", ops)
    put(log, [b"a"])
    assert log.sync() == 1 and log.durable_epoch == 1
    put(log, [b"b"])
    put(log, [b"c"])
    with pytest.raises(StorageIOError) as e:
        log.sync()
    assert e.value.epoch == 3             # epochs 2 and 3 are not known to be on disk
    assert log.durable_epoch == 1
    n_fsyncs = sum(op == "fsync" for op, _ in ops.calls)
    assert log.sync() == 1                # nothing new can be made durable ...
    assert sum(op == "fsync" for op, _ in ops.calls) == n_fsyncs   # ... and no fsync
    assert len(segs(tmp_path / "t")) == 1
    assert put(log, [b"d"]) == 4          # rolls: a new segment from offset 3
    assert segs(tmp_path / "t") == ["%020d.log" % 0, "%020d.log" % 3]
    assert log.sync() == 4 and log.durable_epoch == 4
    # the new segment and the directory were synced, the failed segment never again
    first_seg = str(tmp_path / "t" / ("%020d.log" % 0))
    after = [(op, p) for op, p in ops.calls[ops.calls.index(("open", str(
        tmp_path / "t" / ("%020d.log" % 3)))):] if op == "fsync"]
    assert ("fsync", first_seg) not in after
    assert ("fsync", str(tmp_path / "t")) in after
    assert bodies_of(log) == [b"a", b"b", b"c", b"d"]
    log.close()
    assert reopened(tmp_path / "t") == [b"a", b"b", b"c", b"d"]


class _WriteDuringFsync(FaultyFileOps):
    """An fsync that fails while the owner writes to the same file meanwhile (the write
    happens between the fsync's start and its error)."""

    def __init__(self, log_box: list[TopicLog]) -> None:
        super().__init__([Fault("fsync", "EIO")])
        self.box = log_box

    def fsync(self, fd: int) -> None:
        if self.box:
            log = self.box.pop()
            put(log, [b"during"])          # epoch 2, into the segment being synced
        super().fsync(fd)


def test_write_racing_a_failed_fsync_is_lost_with_it(tmp_path: Path) -> None:
    box: list[TopicLog] = []
    ops = _WriteDuringFsync(box)
    log = open_log(tmp_path / "t", ops)
    put(log, [b"before"])
    box.append(log)
    with pytest.raises(StorageError) as e:
        log.sync()
    assert e.value.epoch == 2 and log.last_written_epoch == 2
    assert put(log, [b"after"]) == 3 and len(segs(tmp_path / "t")) == 2


def test_segment_that_cannot_be_created(tmp_path: Path) -> None:
    ops = FaultyFileOps([Fault("open", "ENOSPC", nth=2), Fault("pwrite", "short", nth=3)])
    log = open_log(tmp_path / "t", ops, seg=200)
    put(log, [b"a" * 150])
    with pytest.raises(DiskFullError):         # roll: the new file cannot be created
        put(log, [b"b" * 150])
    assert segs(tmp_path / "t") == ["%020d.log" % 0]
    with pytest.raises(StorageError):          # roll: its header is written short
        put(log, [b"c" * 150])
    assert segs(tmp_path / "t") == ["%020d.log" % 0]
    put(log, [b"d" * 150])
    assert segs(tmp_path / "t") == ["%020d.log" % 0, "%020d.log" % 1]
    log.close()
    assert reopened(tmp_path / "t") == [b"a" * 150, b"d" * 150]


class _DirectoryFsyncFails(FaultyFileOps):
    """fsync fails on the log's directory only (a path rule matches its files too)."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        self.directory = str(directory)

    def fsync(self, fd: int) -> None:
        if self._paths.get(fd) == self.directory:
            raise OSError(errno.EIO, "EIO on the directory")
        super().fsync(fd)


def test_failed_directory_fsync(tmp_path: Path) -> None:
    log = open_log(tmp_path / "t", _DirectoryFsyncFails(tmp_path / "t"))
    put(log, [b"a"])
    with pytest.raises(StorageIOError) as e:
        log.sync()
    assert e.value.epoch == 1 and log.durable_epoch == 0
    put(log, [b"b"])                         # a new segment, and the directory again
    with pytest.raises(StorageIOError):
        log.sync()


def test_memory_log_is_durable_when_written(tmp_path: Path) -> None:
    log = TopicLog(None, max_bytes_per_file=1 << 20, mem_records=10,
                   max_record_bytes=4096)
    assert put(log, [b"a"]) == 1 and log.durable_epoch == 1
    assert log.sync() == 1


def test_lost_epochs_stay_lost_after_later_fsyncs(tmp_path: Path) -> None:
    """A later successful fsync (of a new segment) never makes a lost epoch durable:
    the log keeps the ranges a failed fsync lost, merged while no success separates
    them, and bounded (the oldest merge, counting more as lost, never fewer)."""
    fail = Fault("fsync", "EIO", count=0)
    ops = FaultyFileOps([])
    log = open_log(tmp_path / "t", ops)
    put(log, [b"1"])
    log.sync()                                # epoch 1 durable
    ops.faults = [fail]
    put(log, [b"2"])
    with pytest.raises(StorageError):
        log.sync()                            # 2 lost
    put(log, [b"3"])                          # rolls
    with pytest.raises(StorageError):
        log.sync()                            # 3 lost: one range 2..3
    assert log.sync() == 1                    # poisoned: nothing, and no fsync
    ops.faults = []
    put(log, [b"4"])
    log.sync()                                # 4 durable
    assert log.durable_epoch == 4
    assert [log.lost_by(e) is not None for e in range(1, 6)] == [False, True, True,
                                                                  False, False]
    assert log._lost[0][:2] == (2, 3)
    e5 = 5
    for _ in range(70):                       # alternate failure and success
        ops.faults = [fail]
        put(log, [b"x"])
        with pytest.raises(StorageError):
            log.sync()
        ops.faults = []
        put(log, [b"y"])
        log.sync()
    assert len(log._lost) == 64
    assert log.lost_by(2) is not None and log.lost_by(e5) is not None   # merged: lost
    assert log.lost_by(log.durable_epoch) is None and log.lost_by(log.epoch - 2)
    log.close()
    assert reopened(tmp_path / "t")[:4] == [b"1", b"2", b"3", b"4"]


class CountingOps(FileOps):
    """The real file operations, counting fsyncs."""

    def __init__(self) -> None:
        self.fsyncs = 0

    def fsync(self, fd: int) -> None:
        self.fsyncs += 1
        super().fsync(fd)


def test_a_sync_with_nothing_new_does_no_fsync(tmp_path: Path) -> None:
    """An idle topic is synced at every checkpoint: with nothing written, rolled, cut
    or created since its last fsync, a sync costs no system call; anything new is
    fsynced as before."""
    ops = CountingOps()
    log = open_log(tmp_path / "t", ops, seg=4096)
    epoch = put(log, [b"a" * 100])
    log.sync()
    assert ops.fsyncs >= 1 and log.durable_epoch == epoch
    before = ops.fsyncs
    for _ in range(3):
        assert log.sync() == log.written
    assert ops.fsyncs == before                  # idle: nothing to do
    put(log, [b"b" * 100])
    log.sync()
    assert ops.fsyncs > before
    before = ops.fsyncs
    with log.lock:
        log.truncate(1)                          # a cut: its file and directory
    log.sync()
    assert ops.fsyncs > before
    before = ops.fsyncs
    put(log, [b"c" * 3000, b"d" * 3000])          # rolls a segment
    log.sync()
    assert ops.fsyncs >= before + 2
    assert reopened(tmp_path / "t") == [b"a" * 100, b"c" * 3000, b"d" * 3000]
