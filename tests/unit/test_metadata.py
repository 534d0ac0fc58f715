"""Broker metadata: nsqd-compatible JSON, atomic save with .bak, damage recovery."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from pybroker.storage import MetadataError
from pybroker.storage.metadata import (
    BrokerMetadata,
    ChannelMeta,
    TopicMeta,
    from_json,
    load_metadata,
    save_metadata,
    to_json,
)

NSQD_DAT = (b'{"topics":[{"channels":[{"name":"c1","paused":false},'
            b'{"name":"c2","paused":true}],"name":"t1","paused":false},'
            b'{"channels":null,"name":"t2","paused":true}],"version":"1.3.0"}')


def sample() -> BrokerMetadata:
    return BrokerMetadata(
        topics=[TopicMeta("t1", False, [ChannelMeta("c1"), ChannelMeta("c2", True,
                                                                         {"max_attempts": 5})]),
                TopicMeta("t2", True, [], {"retention_s": 60})],
        extra={"pybroker": {"format": 1, "deferred": {"t1:c1": 3}}})


def test_reads_nsqd_file_as_written_by_nsqd() -> None:
    meta = from_json(NSQD_DAT)
    assert meta.version == "1.3.0"
    assert [(t.name, t.paused) for t in meta.topics] == [("t1", False), ("t2", True)]
    assert [(c.name, c.paused) for c in meta.topics[0].channels] == [("c1", False),
                                                                      ("c2", True)]
    assert meta.topics[1].channels == []
    assert from_json(b'{"topics":null,"version":"1.2.1"}').topics == []


def test_written_file_follows_the_nsqd_schema_plus_extra_keys() -> None:
    doc = json.loads(to_json(sample()))
    assert doc["version"] == "1.3.0"
    assert doc["topics"][0] == {"name": "t1", "paused": False, "channels": [
        {"name": "c1", "paused": False}, {"name": "c2", "paused": True, "max_attempts": 5}]}
    assert doc["topics"][1] == {"name": "t2", "paused": True, "channels": [],
                                "retention_s": 60}
    assert doc["pybroker"] == {"format": 1, "deferred": {"t1:c1": 3}}


def test_round_trip_keeps_extras(tmp_path: Path) -> None:
    path = tmp_path / "nsqd.dat"
    save_metadata(path, sample())
    res = load_metadata(path)
    assert res.source == "primary" and res.problems == []
    assert res.metadata == sample()


def test_extra_keys_may_not_shadow_the_schema(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        to_json(BrokerMetadata([TopicMeta("t", extra={"paused": True})]))
    with pytest.raises(ValueError):
        to_json(BrokerMetadata(extra={"topics": []}))


def test_fresh_dir_gives_empty_metadata(tmp_path: Path) -> None:
    res = load_metadata(tmp_path / "nsqd.dat")
    assert res.source == "empty" and res.problems == [] and res.metadata.topics == []


def test_save_is_atomic_and_keeps_previous_copy(tmp_path: Path) -> None:
    path = tmp_path / "nsqd.dat"
    first = BrokerMetadata([TopicMeta("a")])
    save_metadata(path, first)
    assert not (tmp_path / "nsqd.dat.bak").exists()
    save_metadata(path, sample())
    assert from_json((tmp_path / "nsqd.dat.bak").read_bytes()) == first
    assert from_json(path.read_bytes()) == sample()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nsqd.dat", "nsqd.dat.bak"]


@pytest.mark.parametrize("garbage", [b"", b"{\"topics\": [", b"\x00" * 64,
                                     b'{"topics":[{"paused":true}]}',
                                     b'{"topics":[{"name":"t","paused":"yes"}]}',
                                     b"[1, 2]"])
def test_damaged_file_is_moved_aside_and_backup_used(
        tmp_path: Path, garbage: bytes, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "nsqd.dat"
    save_metadata(path, BrokerMetadata([TopicMeta("old")]))
    save_metadata(path, sample())
    path.write_bytes(garbage)
    with caplog.at_level(logging.ERROR, "pybroker.storage"):
        res = load_metadata(path)
    assert res.source == "backup"
    assert [t.name for t in res.metadata.topics] == ["old"]
    assert len(res.problems) == 1 and "nsqd.dat.bad" in res.problems[0]
    assert (tmp_path / "nsqd.dat.bad").read_bytes() == garbage
    assert "damaged metadata" in caplog.text
    save_metadata(path, res.metadata)                  # damaged copy never becomes .bak
    assert [t.name for t in from_json((tmp_path / "nsqd.dat.bak").read_bytes()).topics] \
        == ["old"]


def test_both_copies_damaged_gives_empty_with_problems(tmp_path: Path) -> None:
    path = tmp_path / "nsqd.dat"
    path.write_bytes(b"{")
    (tmp_path / "nsqd.dat.bak").write_bytes(b"}")
    res = load_metadata(path)
    assert res.source == "empty" and len(res.problems) == 2
    assert (tmp_path / "nsqd.dat.bad").exists() and (tmp_path / "nsqd.dat.bak.bad").exists()


def test_missing_primary_uses_backup(tmp_path: Path) -> None:
    path = tmp_path / "nsqd.dat"
    save_metadata(path, BrokerMetadata([TopicMeta("a")]))
    save_metadata(path, sample())
    path.unlink()
    res = load_metadata(path)
    assert res.source == "backup" and res.problems


def test_unreadable_file_raises_instead_of_falling_back(tmp_path: Path) -> None:
    path = tmp_path / "nsqd.dat"
    path.mkdir()                                        # EISDIR on read
    with pytest.raises(MetadataError):
        load_metadata(path)


def test_write_failure_raises_and_keeps_old_file(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "nsqd.dat"
    with pytest.raises(MetadataError):
        save_metadata(path, sample())                   # directory does not exist
    path.parent.mkdir()
    save_metadata(path, sample())
    assert load_metadata(path).metadata == sample()
