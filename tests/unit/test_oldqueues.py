"""The read-only reader of pybroker's earlier queue format (pybroker.storage.oldqueues),
on files written byte by byte the way that format had them (tests/support/old_queues)."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

from pybroker.storage._fsutil import safe_name
from pybroker.storage.oldqueues import list_queues, pending_records
from tests.support.old_queues import write_queue

RECS = [b"r%d" % i for i in range(6)]


def test_without_meta_every_record_is_pending(tmp_path: Path) -> None:
    q = write_queue(tmp_path, "t:ch", [RECS[:2], RECS[2:]])
    assert list_queues(tmp_path) == {"t:ch": str(q)}
    assert list(pending_records(str(q))) == RECS


def test_meta_decides_what_was_acknowledged(tmp_path: Path) -> None:
    # below the frontier (4) only 1 is un-acked; past it, 5 was acked ahead (skip)
    q = write_queue(tmp_path, "t", [RECS[:3], RECS[3:]],
                    {"frontier": 4, "unacked": [[1, 2]], "skip": [[5, 6]]})
    assert list(pending_records(str(q))) == [b"r1", b"r4"]


def test_a_hashed_long_name_comes_from_meta(tmp_path: Path) -> None:
    name = "t" * 64 + ":" + "c" * 200
    assert "%~" in safe_name(name)
    write_queue(tmp_path, name, [RECS], {})
    assert list(list_queues(tmp_path)) == [name]


def test_missing_root_has_no_queues(tmp_path: Path) -> None:
    assert list_queues(tmp_path / "none") == {}


@pytest.mark.parametrize("tail", [b"\0" * 40, b"\x00\x00\x00\x01\x00\x00"])
def test_a_torn_or_zeroed_tail_ends_the_segment_quietly(
        tmp_path: Path, tail: bytes, caplog: pytest.LogCaptureFixture) -> None:
    q = write_queue(tmp_path, "t", [RECS])
    with open(q / "00000000.seg", "ab") as f:
        f.write(tail)
    with caplog.at_level(logging.ERROR):
        assert list(pending_records(str(q))) == RECS
    assert not caplog.records


def test_damage_costs_the_rest_of_its_segment_only(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    q = write_queue(tmp_path, "t", [RECS[:3], RECS[3:]])
    seg = q / "00000000.seg"
    raw = bytearray(seg.read_bytes())
    second = 32 + 16 + len(RECS[0])
    raw[second + 16] ^= 0xFF          # a byte of record 1's data
    seg.write_bytes(bytes(raw))
    with caplog.at_level(logging.ERROR):
        assert list(pending_records(str(q))) == [RECS[0], *RECS[3:]]
    assert "damaged record" in caplog.text


def test_a_bad_header_skips_the_segment(tmp_path: Path,
                                        caplog: pytest.LogCaptureFixture) -> None:
    q = write_queue(tmp_path, "t", [RECS[:3], RECS[3:]])
    seg = q / "00000001.seg"
    seg.write_bytes(b"XXXX" + seg.read_bytes()[4:])
    with caplog.at_level(logging.ERROR):
        assert list(pending_records(str(q))) == RECS[:3]
    assert "not a segment" in caplog.text
