"""The fault seam of the topic log's file operations (pybroker.storage.fileops): plans
parse or are refused with the word at fault, and each rule fails exactly the calls it
names (the nth and count after it, on a path, while a file exists)."""
from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest

from pybroker.storage.fileops import (
    REAL,
    Fault,
    FaultPlanError,
    FaultyFileOps,
    from_environment,
    parse_plan,
)


def test_parse_plan() -> None:
    plan = parse_plan("op=pwrite kind=ENOSPC nth=3 count=2 path=/topics/a/ ;"
                      " op=fsync kind=EIO while=/tmp/flag;")
    assert plan == [Fault("pwrite", "ENOSPC", 3, 2, "/topics/a/", ""),
                    Fault("fsync", "EIO", 1, 1, "", "/tmp/flag")]
    assert parse_plan("  ") == []


@pytest.mark.parametrize("text, why", [
    ("op=pwrite", "op= and kind= are required"),
    ("op=read kind=EIO", "op 'read'"),
    ("op=pwrite kind=EPERM", "kind 'EPERM'"),
    ("op=fsync kind=short", "pwrite only"),
    ("op=pwrite kind=EIO nth=x", "integers"),
    ("op=pwrite kind=EIO nth=0", "nth must be >= 1"),
    ("op=pwrite kind=EIO when=/x", "'when=/x'"),
    ("op=pwrite kind=EIO junk", "'junk'"),
    ("op=pwrite kind=slow ms=5", "fsync only"),
    ("op=fsync kind=slow ms=-1", "ms must be between"),
    ("op=fsync kind=slow ms=10001", "ms must be between"),
    ("op=fsync kind=slow ms=x", "integers"),
    (";".join(["op=fsync kind=EIO"] * 33), "more than 32"),
])
def test_bad_plans_say_why(text: str, why: str) -> None:
    with pytest.raises(FaultPlanError, match=why.replace("(", r"\(")):
        parse_plan(text)


def test_environment() -> None:
    assert from_environment({}) is REAL
    ops = from_environment({"PYBROKER_FAULTS": "op=fsync kind=EIO"})
    assert isinstance(ops, FaultyFileOps) and ops.describe() == "fsync EIO nth=1 count=1"
    with pytest.raises(FaultPlanError):
        from_environment({"PYBROKER_FAULTS": "op=fsync"})


def _writes(ops: FaultyFileOps, path: Path, n: int) -> list[str]:
    fd = ops.open(str(path), os.O_WRONLY | os.O_CREAT)
    out = []
    try:
        for i in range(n):
            try:
                out.append(f"wrote {ops.pwrite(fd, b'abcd', i * 4)}")
            except OSError as e:
                out.append(errno.errorcode[e.errno or 0])
    finally:
        ops.close(fd)
    return out


def test_nth_and_count(tmp_path: Path) -> None:
    ops = FaultyFileOps([Fault("pwrite", "ENOSPC", nth=2, count=2)])
    assert _writes(ops, tmp_path / "f", 5) == ["wrote 4", "ENOSPC", "ENOSPC", "wrote 4",
                                               "wrote 4"]
    ops = FaultyFileOps([Fault("pwrite", "EIO", nth=3, count=0)])
    assert _writes(ops, tmp_path / "g", 5) == ["wrote 4", "wrote 4", "EIO", "EIO", "EIO"]


def test_short_and_zero_writes(tmp_path: Path) -> None:
    ops = FaultyFileOps([Fault("pwrite", "short"), Fault("pwrite", "zero", nth=2)])
    assert _writes(ops, tmp_path / "f", 3) == ["wrote 2", "wrote 0", "wrote 4"]
    assert (tmp_path / "f").read_bytes() == b"ab\0\0\0\0\0\0abcd"


def test_path_and_while(tmp_path: Path) -> None:
    flag = tmp_path / "full"
    ops = FaultyFileOps([Fault("pwrite", "ENOSPC", count=0, path="/a/",
                               while_exists=str(flag))], record=True)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert _writes(ops, tmp_path / "a" / "f", 1) == ["wrote 4"]       # no flag yet
    flag.touch()
    assert _writes(ops, tmp_path / "a" / "f", 2) == ["ENOSPC", "ENOSPC"]
    assert _writes(ops, tmp_path / "b" / "f", 1) == ["wrote 4"]       # another path
    flag.unlink()
    assert _writes(ops, tmp_path / "a" / "f", 1) == ["wrote 4"]
    assert [op for op, _ in ops.calls] == ["open", "pwrite"] * 2 + ["pwrite", "open",
                                                                     "pwrite"] * 1 + [
        "open", "pwrite"]
    # a dup'd descriptor keeps its path (the log syncs on dup'd descriptors)
    fd = ops.open(str(tmp_path / "a" / "f"), os.O_WRONLY)
    dup = ops.dup(fd)
    flag.touch()
    with pytest.raises(OSError):
        ops.pwrite(dup, b"x", 0)
    ops.close(dup)
    ops.close(fd)


def test_fsync_ftruncate_open(tmp_path: Path) -> None:
    ops = FaultyFileOps([Fault("fsync", "EIO"), Fault("ftruncate", "EIO"),
                         Fault("open", "EROFS", path="nope")])
    fd = ops.open(str(tmp_path / "f"), os.O_WRONLY | os.O_CREAT)
    with pytest.raises(OSError) as e1:
        ops.fsync(fd)
    ops.fsync(fd)
    with pytest.raises(OSError) as e2:
        ops.ftruncate(fd, 0)
    ops.ftruncate(fd, 0)
    ops.close(fd)
    with pytest.raises(OSError) as e3:
        ops.open(str(tmp_path / "nope"), os.O_WRONLY | os.O_CREAT)
    assert (e1.value.errno, e2.value.errno, e3.value.errno) == (errno.EIO, errno.EIO,
                                                                errno.EROFS)
    assert not (tmp_path / "nope").exists()


def test_a_slow_fsync_waits_then_syncs(tmp_path: Path) -> None:
    """kind=slow: the matched fsync calls take ms longer and work; the others do not
    wait; nothing raises."""
    flag = tmp_path / "slow"
    ops = FaultyFileOps(parse_plan(f"op=fsync kind=slow ms=40 count=0 while={flag}"),
                        record=True)
    assert ops.describe() == f"fsync slow nth=1 count=0 while={flag} ms=40"
    fd = ops.open(str(tmp_path / "f"), os.O_WRONLY | os.O_CREAT)
    try:
        def timed() -> float:
            t0 = time.monotonic()
            ops.fsync(fd)
            return time.monotonic() - t0

        assert timed() < 0.03          # no flag: not matched
        flag.touch()
        assert [timed() >= 0.04 for _ in range(2)] == [True, True]
        flag.unlink()
        assert timed() < 0.03
    finally:
        ops.close(fd)
    assert [op for op, _ in ops.calls] == ["open"] + ["fsync"] * 4
