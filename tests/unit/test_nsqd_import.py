"""Import of nsqd 1.x data directories: metadata, go-diskqueue files, damage."""
from __future__ import annotations

import json
import logging
import signal
import urllib.request
from pathlib import Path

import pytest

from pybroker.storage.nsqd_import import (
    NsqdDataDir,
    NsqdMessage,
    decode_message,
    parse_diskqueue_meta,
)
from tests.support.broker import BrokerProcess, wait_until
from tests.support.nsqd_data import (
    FakeGoDiskQueue,
    corrupt_size,
    encode_message,
    msg_id,
    topic_entry,
    truncate_by,
    write_metadata,
)
from tests.support.programs import require_program

TS = 1_700_000_000_123_456_789


def fill(q: FakeGoDiskQueue, n: int, tag: str, start: int = 0) -> list[NsqdMessage]:
    out = []
    for i in range(start, start + n):
        m = NsqdMessage(msg_id(i), TS + i, i % 3, f"{tag}-{i}".encode() * 3)
        q.put(encode_message(m.id, m.ts_ns, m.attempts, m.body))
        out.append(m)
    return out


def test_decode_message() -> None:
    rec = encode_message(msg_id(0xABC), -5, 7, b"body")
    assert decode_message(rec) == NsqdMessage(b"0000000000000abc", -5, 7, b"body")
    assert decode_message(rec[:26]).body == b""
    with pytest.raises(ValueError):
        decode_message(rec[:25])


def test_parse_diskqueue_meta() -> None:
    m = parse_diskqueue_meta("12\n3,456\n5,78\n")
    assert (m.depth, m.read_file, m.read_pos, m.write_file, m.write_pos) == (12, 3, 456, 5, 78)
    with pytest.raises(ValueError):
        parse_diskqueue_meta("12\n3;4\n")


def test_topics_channels_paused_and_pending_messages(tmp_path: Path) -> None:
    write_metadata(tmp_path, [topic_entry("orders", False, [("billing", True), ("ship", False)]),
                              topic_entry("idle", True, None)])
    topic = FakeGoDiskQueue(tmp_path, "orders", max_bytes_per_file=300)
    billing = FakeGoDiskQueue(tmp_path, "orders:billing", max_bytes_per_file=300)
    t_msgs = fill(topic, 5, "t")
    b_msgs = fill(billing, 20, "b")
    billing.consume(7)                      # crosses a file boundary: files deleted
    assert not billing.path(0).exists()
    for q in (topic, billing):
        q.write_meta()
    data = NsqdDataDir(tmp_path)
    assert data.metadata_file == str(tmp_path / "nsqd.dat")
    assert data.problems == []
    topics = {t.name: t for t in data.topics()}
    assert set(topics) == {"orders", "idle"}
    assert topics["idle"].paused and topics["idle"].channels == []
    assert list(topics["idle"].queue.records()) == []
    orders = topics["orders"]
    assert not orders.paused
    assert list(orders.queue.messages()) == t_msgs
    chans = {c.name: c for c in orders.channels}
    assert chans["billing"].paused and not chans["ship"].paused
    assert chans["billing"].queue.depth == 13
    assert list(chans["billing"].queue.messages()) == b_msgs[7:]
    assert list(chans["ship"].queue.messages()) == []
    assert data.orphan_queues() == []


def test_read_position_in_the_middle_of_the_write_file(tmp_path: Path) -> None:
    write_metadata(tmp_path, [topic_entry("t", channels=[])])
    q = FakeGoDiskQueue(tmp_path, "t")
    msgs = fill(q, 10, "x")
    q.consume(4)
    q.write_meta()
    assert list(NsqdDataDir(tmp_path).queue("t").messages()) == msgs[4:]


def test_old_style_metadata_file(tmp_path: Path) -> None:
    write_metadata(tmp_path, [topic_entry("a", True, [("c", False)])], "nsqd.517.dat",
                   version="1.1.0")
    data = NsqdDataDir(tmp_path)
    assert data.metadata_file == str(tmp_path / "nsqd.517.dat")
    [t] = list(data.topics())
    assert t.name == "a" and t.paused and [c.name for c in t.channels] == ["c"]


def test_new_metadata_file_wins_over_old(tmp_path: Path,
                                         caplog: pytest.LogCaptureFixture) -> None:
    write_metadata(tmp_path, [topic_entry("old")], "nsqd.1.dat")
    write_metadata(tmp_path, [topic_entry("new")])
    with caplog.at_level(logging.WARNING, "pybroker.storage"):
        data = NsqdDataDir(tmp_path)
    assert [t.name for t in data.topics()] == ["new"]
    assert "differ" in caplog.text


def test_bad_record_skips_the_rest_of_that_file(tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    write_metadata(tmp_path, [topic_entry("t", channels=[])])
    q = FakeGoDiskQueue(tmp_path, "t", max_bytes_per_file=400)
    msgs = fill(q, 12, "m")                               # several files of ~5 records
    q.write_meta()
    per_file = [i for i, (f, _) in enumerate(q._ends) if f == 0]
    path, off = q.record_offset(2)
    corrupt_size(path, off, 5)                            # below nsqd's minimum (26)
    with caplog.at_level(logging.ERROR, "pybroker.storage"):
        got = list(NsqdDataDir(tmp_path).queue("t").messages())
    assert got == msgs[:2] + msgs[len(per_file):]
    assert "invalid message size 5" in caplog.text
    corrupt_size(path, off, 2_000_000)                    # above max_msg_size + 26
    assert list(NsqdDataDir(tmp_path).queue("t").messages()) == got
    got_big = list(NsqdDataDir(tmp_path, max_msg_size=4_000_000).queue("t").records())
    assert len(got_big) == 2 + len(msgs) - len(per_file)  # truncated read: still skipped


def test_torn_tail_and_bytes_past_write_pos(tmp_path: Path) -> None:
    write_metadata(tmp_path, [topic_entry("t", channels=[])])
    q = FakeGoDiskQueue(tmp_path, "t")
    msgs = fill(q, 6, "m")
    q.write_meta()                                        # meta written before 2 more
    more = fill(q, 2, "late", start=6)
    truncate_by(q.path(0), 10)                            # the last one is torn
    got = list(NsqdDataDir(tmp_path).queue("t").messages())
    assert got == msgs + more[:1]                         # salvaged like nsqd 1.3


def test_missing_or_damaged_metadata_derives_topics_from_files(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    for name in ("t1", "t1:c1", "t2:c9"):
        q = FakeGoDiskQueue(tmp_path, name)
        fill(q, 2, name)
        q.write_meta()
    data = NsqdDataDir(tmp_path)
    assert data.metadata_file is None and data.problems == ["no metadata file"]
    assert [(t.name, [c.name for c in t.channels]) for t in data.topics()] == [
        ("t1", ["c1"]), ("t2", ["c9"])]
    (tmp_path / "nsqd.dat").write_text('{"topics": [')
    with caplog.at_level(logging.ERROR, "pybroker.storage"):
        data = NsqdDataDir(tmp_path)
    assert data.problems and "cannot use nsqd metadata" in caplog.text
    assert len(list(data.topics())) == 2
    assert (tmp_path / "nsqd.dat").read_text() == '{"topics": ['   # never modified


def test_missing_queue_meta_reads_all_files_and_orphans_listed(tmp_path: Path) -> None:
    write_metadata(tmp_path, [topic_entry("t", channels=[])])
    q = FakeGoDiskQueue(tmp_path, "t", max_bytes_per_file=200)
    msgs = fill(q, 6, "m")
    orphan = FakeGoDiskQueue(tmp_path, "gone:chan")
    fill(orphan, 1, "o")
    orphan.write_meta()
    data = NsqdDataDir(tmp_path)
    assert data.queue("t").depth is None
    assert list(data.queue("t").messages()) == msgs
    assert data.orphan_queues() == ["gone:chan"]


# -- a real nsqd ------------------------------------------------------------------------
def _http(b: BrokerProcess, path: str, body: bytes | None = None) -> bytes:
    req = urllib.request.Request(f"http://{b.http_hostport}{path}", data=body,
                                 method="POST" if body is not None else "GET")
    with urllib.request.urlopen(req, timeout=5) as resp:
        return bytes(resp.read())


def test_import_data_written_by_a_real_nsqd(tmp_path: Path) -> None:
    nsqd_path = require_program("nsqd", "to write a real nsqd data directory")
    b = BrokerProcess("nsqd", ["--mem-queue-size=0", "--max-bytes-per-file=2048"],
                      data_path=str(tmp_path), nsqd_path=nsqd_path).start()
    try:
        _http(b, "/topic/create?topic=imp_a", b"")
        _http(b, "/channel/create?topic=imp_a&channel=c1", b"")
        _http(b, "/channel/create?topic=imp_a&channel=c2", b"")
        _http(b, "/channel/pause?topic=imp_a&channel=c1", b"")
        _http(b, "/topic/create?topic=imp_b", b"")
        _http(b, "/topic/pause?topic=imp_b", b"")
        bodies_a = [f"a-{i}".encode() * 10 for i in range(40)]
        bodies_b = [f"b-{i}".encode() for i in range(5)]
        for body in bodies_a:
            assert _http(b, "/pub?topic=imp_a", body) == b"OK"
        for body in bodies_b:
            assert _http(b, "/pub?topic=imp_b", body) == b"OK"

        def settled() -> bool:
            stats = json.loads(_http(b, "/stats?format=json"))
            topics = {t["topic_name"]: t for t in stats["topics"]}
            return topics["imp_a"]["depth"] == 0 and all(
                c["depth"] == 40 for c in topics["imp_a"]["channels"])

        wait_until(settled, timeout_s=10, what="nsqd to copy messages to channels")
    finally:
        code = b.stop(signal.SIGTERM)
    assert code == 0, b.stderr_text()
    data = NsqdDataDir(tmp_path)
    assert data.problems == [] and data.metadata_file == str(tmp_path / "nsqd.dat")
    topics = {t.name: t for t in data.topics()}
    assert topics["imp_b"].paused and not topics["imp_a"].paused
    assert [m.body for m in topics["imp_b"].queue.messages()] == bodies_b
    chans = {c.name: c for c in topics["imp_a"].channels}
    assert chans["c1"].paused and not chans["c2"].paused
    for c in chans.values():
        msgs = list(c.queue.messages())
        assert [m.body for m in msgs] == bodies_a
        assert all(len(m.id) == 16 and m.attempts == 0 and m.ts_ns > 0 for m in msgs)
        assert len({m.id for m in msgs}) == 40
    assert len(list((tmp_path).glob("imp_a:c1.diskqueue.*.dat"))) > 2   # rolled files
