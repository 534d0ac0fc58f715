"""pybroker's first start on an nsqd 1.x data directory imports it: topics, channels,
paused flags and every queued message (ids, timestamps and attempts kept), once.

Two sources: a directory written by tests/support/nsqd_data.py (the documented formats,
several files, a read position inside a file, messages in a topic queue that has
channels), and one written by the real nsqd binary (skipped without it).
"""
from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

from tests.support.broker import BrokerProcess, unique_name, wait_until
from tests.support.durability import (
    Received,
    bodies,
    channel_stats,
    consume,
    create_channel,
    http,
    http_pub,
    stats,
)
from tests.support.nsqd_data import (
    FakeGoDiskQueue,
    encode_message,
    msg_id,
    topic_entry,
    write_metadata,
)
from tests.support.wire import WireClient

MakeBroker = Callable[..., BrokerProcess]
TS = 1_700_000_000_000_000_000


def _layout(b: BrokerProcess) -> dict[str, tuple[bool, dict[str, bool]]]:
    return {t["topic_name"]: (t["paused"], {c["channel_name"]: c["paused"]
                                            for c in t["channels"]})
            for t in stats(b)["topics"]}


def _fill(q: FakeGoDiskQueue, first: int, n: int, attempts: int = 0) -> list[bytes]:
    out = []
    for i in range(first, first + n):
        body = f"{q.name}-{i:04d}".encode() * 3
        q.put(encode_message(msg_id(i), TS + i, attempts, body))
        out.append(body)
    return out


def test_import_written_nsqd_data_dir(make_broker: MakeBroker, tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    # topic "ia": two channels (ch1 paused); its own queue still holds 3 messages, which
    # nsqd would hand to both channels after a restart
    ia = FakeGoDiskQueue(data, "ia")
    ia_rest = _fill(ia, 0, 3)
    ia.write_meta()
    ch1 = FakeGoDiskQueue(data, "ia:ch1", max_bytes_per_file=400)
    ch1_all = _fill(ch1, 100, 30, attempts=2)
    ch1.consume(14)                      # a read position in a later file
    ch1.write_meta()
    assert not ch1.path(0).exists() and ch1.read_pos > 0
    ch2 = FakeGoDiskQueue(data, "ia:ch2")
    ch2_all = _fill(ch2, 200, 5)
    ch2.write_meta()
    # topic "ib": paused, no channels, 6 messages waiting in the topic queue
    ib = FakeGoDiskQueue(data, "ib", max_bytes_per_file=200)
    ib_all = _fill(ib, 300, 6)
    ib.write_meta()
    # topic "ic": a channel with an empty queue
    write_metadata(data, [topic_entry("ia", False, [("ch1", True), ("ch2", False)]),
                          topic_entry("ib", True, []),
                          topic_entry("ic", False, [("idle", False)])])

    b = make_broker(data_path=str(data))
    assert any("imported" in ln for ln in b.stderr_lines), b.stderr_text()
    assert _layout(b) == {"ia": (False, {"ch1": True, "ch2": False}),
                          "ib": (True, {}), "ic": (False, {"idle": False})}
    s1 = channel_stats(b, "ia", "ch1")
    assert s1 is not None and s1["depth"] == 16 + 3, s1
    assert http(b, "POST", "/channel/unpause?topic=ia&channel=ch1")[0] == 200
    got1 = consume(b, "ia", "ch1", expect=19)
    assert sorted(bodies(got1)) == sorted(ch1_all[14:] + ia_rest)
    by_body = {r.msg.body: r.msg for r in got1}
    for i, body in enumerate(ch1_all[14:], start=114):
        m = by_body[body]
        # publish time and attempts are kept; the id becomes the message's log offset
        assert (m.ts_ns, m.attempts) == (TS + i, 3), m
        assert m.id == b"%016x" % int(m.id, 16)
    assert len({r.msg.id for r in got1}) == len(got1)
    got2 = consume(b, "ia", "ch2", expect=8)
    assert sorted(bodies(got2)) == sorted(ch2_all + ia_rest)
    assert http(b, "POST", "/topic/unpause?topic=ib")[0] == 200
    got3 = consume(b, "ib", "late", expect=6)
    assert sorted(bodies(got3)) == sorted(ib_all)
    assert consume(b, "ic", "idle", idle_s=0.3) == []

    # the nsqd files were moved aside, and a restart imports nothing twice
    assert not list(data.glob("*.diskqueue.*"))
    assert list((data / "nsqd-imported").glob("*.diskqueue.meta.dat"))
    code = b.stop(signal.SIGTERM)
    assert code == 0, b.stderr_text()
    b.start()
    assert _layout(b)["ia"] == (False, {"ch1": False, "ch2": False})
    for topic, channel in (("ia", "ch1"), ("ia", "ch2"), ("ib", "late")):
        assert consume(b, topic, channel, idle_s=0.3) == [], (topic, channel)


def test_import_data_dir_of_the_real_nsqd(make_broker: MakeBroker, tmp_path: Path) -> None:
    data = tmp_path / "nsqd-data"
    data.mkdir()
    n = make_broker("--mem-queue-size=5", kind="nsqd", data_path=str(data))
    ra, rb, rc = unique_name("ra"), unique_name("rb"), unique_name("rc")
    create_channel(n, ra, "c1")
    create_channel(n, rc, "paused_ch")
    ra_msgs = [f"ra-{i:03d}".encode() for i in range(25)]
    with WireClient.connect(n.tcp_address) as c:  # type: ignore[arg-type]
        c.mpub(ra, ra_msgs[:20])
        for m in ra_msgs[20:]:
            c.pub(ra, m)
        c.dpub(ra, 60_000, b"ra-deferred")
        c.pub(rc, b"rc-1")
    rb_msgs = [f"rb-{i:03d}".encode() for i in range(10)]
    for m in rb_msgs:
        http_pub(n, rb, m)
    assert http(n, "POST", f"/topic/pause?topic={rb}")[0] == 200
    assert http(n, "POST", f"/channel/pause?topic={rc}&channel=paused_ch")[0] == 200
    # two messages in flight (never FIN'd) when nsqd stops
    consumer = WireClient.connect(n.tcp_address)  # type: ignore[arg-type]
    consumer.sub(ra, "c1")
    consumer.rdy(2)
    in_flight = consumer.read_messages(2)
    wait_until(lambda: (channel_stats(n, ra, "c1") or {}).get("in_flight_count") == 2)
    code = n.stop(signal.SIGTERM)
    consumer.close()
    assert code == 0, n.stderr_text()
    assert list(data.glob("*.diskqueue.meta.dat")), sorted(p.name for p in data.iterdir())

    b = make_broker(data_path=str(data))
    layout = _layout(b)
    assert layout[ra] == (False, {"c1": False})
    assert layout[rb] == (True, {})
    assert layout[rc] == (False, {"paused_ch": True})
    expected = ra_msgs + [b"ra-deferred"]   # nsqd forgets the delay when it stops
    got: list[Received] = consume(b, ra, "c1", expect=len(expected))
    assert sorted(bodies(got)) == sorted(expected)
    attempts = {r.msg.body: r.msg.attempts for r in got}
    for flying in in_flight:
        assert attempts[flying.body] == 2, (flying.body, attempts[flying.body])
    assert http(b, "POST", f"/topic/unpause?topic={rb}")[0] == 200
    assert sorted(bodies(consume(b, rb, "x", expect=10))) == sorted(rb_msgs)
    assert http(b, "POST", f"/channel/unpause?topic={rc}&channel=paused_ch")[0] == 200
    assert bodies(consume(b, rc, "paused_ch", expect=1)) == [b"rc-1"]
    assert consume(b, ra, "c1", idle_s=0.3) == []


def test_import_keeps_queues_missing_from_nsqd_dat(make_broker: MakeBroker,
                                                   tmp_path: Path) -> None:
    """A disk queue whose topic or channel nsqd.dat does not list (e.g. deleted from the
    metadata, or a lost nsqd.dat) stays dormant in nsqd: its messages are delivered once
    a topic/channel of that name is created again. The import must not drop them."""
    data = tmp_path / "data"
    data.mkdir()
    q = FakeGoDiskQueue(data, "oa:dormant")
    dormant_ch = _fill(q, 0, 3)
    q.write_meta()
    q = FakeGoDiskQueue(data, "ob")
    dormant_topic = _fill(q, 10, 2)
    q.write_meta()
    write_metadata(data, [topic_entry("oa", False, [])])
    b = make_broker(data_path=str(data))
    assert sorted(bodies(consume(b, "oa", "dormant", idle_s=0.5))) == sorted(dormant_ch)
    assert sorted(bodies(consume(b, "ob", "x", idle_s=0.5))) == sorted(dormant_topic)
