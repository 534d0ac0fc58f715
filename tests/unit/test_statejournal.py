"""pybroker.storage.statejournal: a topic's saved states written as changes. What is
read back is the last state written whole or appended, synced; a journal cut at any
byte (a crash), damaged, or left from a state file written since is read up to where it
stops fitting; a failed append (a full disk, a short write) makes the next save write
the whole file."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pybroker.core.deferred import CHUNK
from pybroker.jsonvalue import Keyed, PartedList, PartTexts, dumps_keyed
from pybroker.storage import statejournal as sj
from pybroker.storage.fileops import Fault, FaultyFileOps, FileOps
from pybroker.storage.statejournal import StateWriter, load
from tests.support.inproc import close_runtime, runtime

Chunk = tuple[tuple[int, int, int], ...]


class _States:
    """A topic's state whose channel holds deferred messages in chunks, changed a
    chunk at a time and encoded as the storage thread does."""

    def __init__(self, chunks: int = 40) -> None:
        self.parts: list[Chunk] = [tuple((k * CHUNK + j, 1, 10**18) for j in range(30))
                                   for k in range(chunks)]
        self.chan = PartTexts()
        self.doc = PartTexts()
        self.cursor = 0

    def change(self, k: int) -> None:
        k %= len(self.parts)
        self.parts[k] = self.parts[k][:-1] or ((k * CHUNK, 2, 10**18),)
        self.cursor += 1

    def encode(self) -> Keyed:
        doc = {"topic": "t", "channels": {"ch": {
            "cursor": self.cursor, "pending": PartedList([], tuple(self.parts), self.chan)}}}
        return dumps_keyed(doc, self.doc)

    def text(self) -> bytes:
        return json.dumps({"topic": "t", "channels": {"ch": {
            "cursor": self.cursor, "pending": [list(d) for p in self.parts for d in p]}}}
        ).encode()


def test_changes_are_appended_and_read_back(tmp_path: Path) -> None:
    path = str(tmp_path / "t.json")
    s, w = _States(), StateWriter(path)
    assert w.save(s.encode()) is False                 # the first: whole
    whole = os.stat(path)
    for k in range(10):
        s.change(k * 7)
        assert w.save(s.encode()) is True              # a change: appended
        assert load(path) == s.text()
    assert os.stat(path).st_ino == whole.st_ino        # the file was not written again
    size = os.path.getsize(path)
    assert os.path.getsize(path + sj.SUFFIX) < size // 2   # ten chunks, not ten files


def test_the_whole_file_is_written_again_when_the_journal_is_full(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Full: MAX_RECORDS records, or more bytes than half the file (at least
    MIN_JOURNAL)."""
    monkeypatch.setattr(sj, "MAX_RECORDS", 8)
    path = str(tmp_path / "t.json")
    s, w = _States(), StateWriter(path)
    w.save(s.encode())
    appended = []
    for k in range(sj.MAX_RECORDS + 3):
        s.change(k)
        appended.append(w.save(s.encode()))
        assert load(path) == s.text()
    assert appended.count(False) == 1 and appended[sj.MAX_RECORDS] is False
    monkeypatch.setattr(sj, "MAX_RECORDS", 1000)
    monkeypatch.setattr(sj, "MIN_JOURNAL", 0)
    appended = []
    for k in range(60):
        s.change(k)
        appended.append(w.save(s.encode()))
        assert os.path.getsize(path + sj.SUFFIX) <= os.path.getsize(path) // 2
        assert load(path) == s.text()
    assert 1 <= appended.count(False) < 30


@settings(max_examples=40, deadline=None)
@given(changes=st.lists(st.integers(0, 1000), min_size=1, max_size=12),
       cut=st.floats(0, 1))
def test_a_journal_cut_anywhere_reads_the_last_change_written_whole(
        tmp_path_factory: pytest.TempPathFactory, changes: list[int], cut: float) -> None:
    """A crash leaves the journal cut at any byte: what is read is the state of the
    last record wholly there (or the file's, if none)."""
    path = str(tmp_path_factory.mktemp("j") / "t.json")
    s, w = _States(8), StateWriter(path)
    w.save(s.encode())
    texts = [s.text()]
    ends = [os.path.getsize(path + sj.SUFFIX)]
    for k in changes:
        s.change(k)
        w.save(s.encode())
        texts.append(s.text())
        ends.append(os.path.getsize(path + sj.SUFFIX))
    at = int(cut * ends[-1])
    with open(path + sj.SUFFIX, "r+b") as f:
        f.truncate(at)
    whole = [i for i, end in enumerate(ends) if end <= at]
    assert load(path) == texts[whole[-1] if whole else 0]


def test_a_damaged_record_keeps_the_ones_before(tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    path = str(tmp_path / "t.json")
    s, w = _States(), StateWriter(path)
    w.save(s.encode())
    texts = []
    ends = []
    for k in range(4):
        s.change(k * 5)
        w.save(s.encode())
        texts.append(s.text())
        ends.append(os.path.getsize(path + sj.SUFFIX))
    with open(path + sj.SUFFIX, "r+b") as f:
        f.seek(ends[2] - 3)                  # the last bytes of the third change's
        f.write(b"\xff\xfe")                 # record: its new pieces
    assert load(path) == texts[1]
    assert "damaged" in caplog.text


def test_a_journal_left_from_an_earlier_file_is_ignored(tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """The whole file written again, then a crash before its new journal: the old
    journal names the old file, and the new file is read alone."""
    path = str(tmp_path / "t.json")
    s, w = _States(), StateWriter(path)
    w.save(s.encode())
    s.change(3)
    w.save(s.encode())
    old = Path(path + sj.SUFFIX).read_bytes()
    s.change(4)
    text = s.text()
    Path(path).write_bytes(text)             # (as a whole write of the next state)
    Path(path + sj.SUFFIX).write_bytes(old)
    assert load(path) == text
    assert "another state file" in caplog.text


@pytest.mark.parametrize("kind", ["ENOSPC", "zero"])
def test_a_failed_append_makes_the_next_save_whole(tmp_path: Path, kind: str) -> None:
    """The disk fills during an append: the save fails (the checkpoint says so), what
    is read is the state before, and the next save writes the whole file and a new
    journal."""
    path = str(tmp_path / "t.json")
    ops = FaultyFileOps()
    s, w = _States(), StateWriter(path, ops)
    w.save(s.encode())
    s.change(1)
    assert w.save(s.encode()) is True
    before = s.text()
    s.change(2)
    ops.faults = [Fault("pwrite", kind, path=sj.SUFFIX)]     # the next append's write
    with pytest.raises(OSError):
        w.save(s.encode())
    assert load(path) == before
    s.change(9)
    assert w.save(s.encode()) is False        # whole
    assert load(path) == s.text()


def test_a_short_append_is_written_on(tmp_path: Path) -> None:
    path = str(tmp_path / "t.json")
    ops = FaultyFileOps()
    s, w = _States(), StateWriter(path, ops)
    w.save(s.encode())
    s.change(1)
    ops.faults = [Fault("pwrite", "short", path=sj.SUFFIX)]   # the append's write
    assert w.save(s.encode()) is True and ops.faults[0].fired == 1
    assert load(path) == s.text()


def test_a_state_of_more_pieces_than_a_journal_keeps_is_written_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sj, "MAX_PIECES", 10)
    path = str(tmp_path / "t.json")
    s, w = _States(), StateWriter(path)
    assert w.save(s.encode()) is False
    assert not os.path.exists(path + sj.SUFFIX)
    s.change(1)
    assert w.save(s.encode()) is False
    assert load(path) == s.text()


def test_an_encoding_not_saved_makes_the_next_save_whole(tmp_path: Path) -> None:
    """The journal's changes are from the encoding before: one made but not saved
    (the checkpoint skipped it) breaks the chain, and the next is written whole."""
    path = str(tmp_path / "t.json")
    s, w = _States(), StateWriter(path)
    w.save(s.encode())
    s.change(1)
    s.encode()                               # not saved
    s.change(2)
    assert w.save(s.encode()) is False
    assert load(path) == s.text()


class _DeletedMeanwhile(FileOps):
    """The disk as a topic deletion leaves it, racing a checkpoint: the journal is
    gone when the storage thread opens it to append."""

    def __init__(self) -> None:
        self.topic: Any = None

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        if path.endswith(sj.SUFFIX) and self.topic is not None:
            self.topic.deleted = True
            os.unlink(path)
        return super().open(path, flags, mode)


def test_a_topic_deleted_while_its_state_is_saved_is_no_storage_failure(
        tmp_path: Path) -> None:
    """A checkpoint appending to the journal of a topic deleted meanwhile fails to open
    it: that is the deletion, not a failing disk, and /ping stays OK."""
    rt = runtime(tmp_path, durability="memory")
    try:
        ops = _DeletedMeanwhile()
        rt.storage.fileops = ops
        topic = rt.broker.get_topic("t")
        state: dict[str, Any] = {"topic": "t", "orphan_start": 0, "released": 0,
                                 "channels": {}, "floor": 0, "min_cursor": 0}
        rt.storage.checkpoint({topic: state})          # whole, and its journal
        assert os.path.exists(str(tmp_path / "state" / "t.json") + sj.SUFFIX)
        ops.topic = topic
        rt.storage.checkpoint({topic: {**state, "orphan_start": 5}})   # an append
        assert topic.deleted and rt.health is None, rt.health
    finally:
        close_runtime(rt)


@pytest.mark.parametrize("op,kind", [("pwrite", "ENOSPC"), ("pwrite", "zero"),
                                     ("fsync", "EIO"), ("open", "EDQUOT")])
def test_a_whole_write_goes_through_the_fault_seam_and_leaves_the_state_before(
        tmp_path: Path, op: str, kind: str) -> None:
    """The file's whole writes (temporary file, fsync, rename) use the storage fault
    seam too: a failing disk fails the save, leaves the state before readable and no
    temporary file, and the next save works once the disk does."""
    path = str(tmp_path / "t.json")
    ops = FaultyFileOps()
    s = _States()
    StateWriter(path, ops).save(s.encode())
    before = s.text()
    s.change(3)
    w = StateWriter(path, ops)                # a new writer's first save: whole
    ops.faults = [Fault(op, kind, count=0, path=".json.")]
    with pytest.raises(OSError):
        w.save(s.encode())
    assert load(path) == before
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
    ops.faults = []
    assert w.save(s.encode()) is False
    assert load(path) == s.text()
