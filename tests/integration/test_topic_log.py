"""The topic log (docs/storage.md): big backlogs without stalls, one copy for many
channels, replay (rewind by offset and by time), retention, and the guarantees of the
default durability against kill -9. All against the real server process."""
from __future__ import annotations

import json
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pybroker.bench.brokers import proc_cpu_s
from pybroker.storage.statejournal import load as load_state
from tests.support.broker import BrokerProcess, unique_name, wait_until
from tests.support.durability import (
    FinningConsumer,
    HttpPublisher,
    Publisher,
    bodies,
    channel_stats,
    consume,
    create_channel,
    topic_stats,
)
from tests.support.http import broker_json
from tests.support.wire import WireClient

MakeBroker = Callable[..., BrokerProcess]


def _post(b: BrokerProcess, path: str) -> tuple[int, Any]:
    return broker_json(b, "POST", path)


def _fill(b: BrokerProcess, topic: str, n: int, size: int = 100, batch: int = 5000) -> None:
    body = b"x" * size
    with WireClient.connect(b.tcp_address) as c:  # type: ignore[arg-type]
        for i in range(0, n, batch):
            c.mpub(topic, [body] * min(batch, n - i))


# -- no stalls ---------------------------------------------------------------------------------


def test_sub_to_a_million_message_backlog_does_not_stall_other_clients(
        make_broker: MakeBroker) -> None:
    """SUB on a topic holding 1,000,000 messages creates a cursor, not a copy: a client
    publishing on another topic meanwhile keeps getting prompt answers (the bound is
    generous here; loadtest/bench_topic_log.py reports the real figure)."""
    b = make_broker("--mem-queue-size=10000")
    big, other = unique_name("big"), unique_name("other")
    _fill(b, big, 1_000_000)
    rtts: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        with WireClient.connect(b.tcp_address) as p:  # type: ignore[arg-type]
            while not stop.is_set():
                t0 = time.perf_counter()
                p.pub(other, b"probe")
                rtts.append(time.perf_counter() - t0)

    th = threading.Thread(target=probe, daemon=True)
    th.start()
    wait_until(lambda: len(rtts) > 50, what="probe round trips")
    before = len(rtts)
    assert b.proc is not None
    cpu_before = proc_cpu_s(b.proc.pid)
    with WireClient.connect(b.tcp_address) as c:  # type: ignore[arg-type]
        c.sub(big, "new")
        c.rdy(100)
        got = c.read_messages(100, timeout=10)
        assert len(got) == 100
        wait_until(lambda: len(rtts) > before + 200, what="probe round trips after SUB")
        st = channel_stats(b, big, "new")
        assert st is not None and st["depth"] == 1_000_000 - 100
        assert st["in_flight_count"] == 100
    cpu = proc_cpu_s(b.proc.pid) - cpu_before
    stop.set()
    th.join(5)
    during = rtts[before:]
    print(f"probe round trips around the SUB: n={len(during)}, max {max(during) * 1e3:.1f} ms"
          f", broker CPU meanwhile {cpu * 1e3:.0f} ms")
    # a stall is the loop busy with the backlog, and costs the broker that CPU; a long
    # round trip while the broker was not busy is a probe or broker thread waiting for a
    # core (the suite runs on parallel workers: 580 ms once in CI; the window costs the
    # broker about 60 ms of CPU here)
    assert max(during) < 0.5 or cpu < 0.3, \
        f"a probe round trip took {max(during) * 1e3:.0f} ms, the broker {cpu:.2f} s of CPU"


@pytest.mark.parametrize("changing", [False, True], ids=["idle", "changing"])
def test_checkpoints_of_150000_deferred_messages_do_not_stall_other_clients(
        make_broker: MakeBroker, changing: bool) -> None:
    """Every checkpoint saves each channel's state, deferred messages included (a REQ
    with a delay survives a restart). With 150,000 of them the snapshot (built on the
    loop) and its JSON (on the storage thread, holding the GIL) held a publisher on
    another topic 47-51 ms at each checkpoint with 100,000; the snapshot now rebuilds
    only the chunks that changed, the JSON is made in slices, and a state unchanged
    since the last write is not encoded again. The bound here is wide of what was
    measured here (15-16 ms with 150,000 and a checkpoint every 100 ms;
    docs/storage.md), and narrow of what it was (78 ms), and it holds for all but
    two of the probe's round trips, not for the longest alone. ``changing``: a message is
    deferred every 20 ms meanwhile, so that every checkpoint encodes and writes the
    whole state again."""
    b = make_broker("--sync-timeout=100ms", "--max-req-timeout=2h")
    topic, other = unique_name("later"), unique_name("other")
    n = 150_000
    _fill(b, topic, n, size=20)
    with WireClient.connect(b.tcp_address) as c:  # type: ignore[arg-type]
        c.sub(topic, "ch")
        c.rdy(2500)
        for _ in range(n):
            c.req(c.read_message(10).id, 3_600_000)
        wait_until(lambda: (channel_stats(b, topic, "ch") or {}).get("deferred_count") == n,
                   30, 0.2, what="every message deferred")
        rtts: list[float] = []
        c.rdy(1)       # each new one flushed at once (not at the output buffer's 250 ms)
        with WireClient.connect(b.tcp_address) as p:  # type: ignore[arg-type]
            end = time.monotonic() + 2.0          # about 20 checkpoints
            nxt = time.monotonic()
            added = 0
            while time.monotonic() < end:
                if changing and time.monotonic() >= nxt:
                    p.pub(topic, b"later")        # delivered to c, deferred in turn
                    c.req(c.read_message(10).id, 3_600_000)
                    added += 1
                    nxt += 0.02
                t0 = time.perf_counter()
                p.pub(other, b"probe")
                rtts.append(time.perf_counter() - t0)
        if changing:
            wait_until(lambda: (channel_stats(b, topic, "ch") or {}).get("deferred_count")
                       == n + added, 10, 0.1, what="the new ones deferred too")
            path = Path(b.data_path) / "state" / f"{topic}.json"
            # the saved state lists every deferred message, the new ones among them
            wait_until(lambda: sorted(p[0] for p in json.loads(load_state(str(path)) or b"{}")
                                      ["channels"]["ch"]["pending"]) == list(range(n + added)),
                       10, 0.1, what="a checkpoint with every one")
            assert added >= 50, (added, max(rtts))
    slow = sorted(r for r in rtts if r >= 0.06)
    print(f"probe round trips over 2 s of checkpoints: n={len(rtts)}, "
          f"max {max(rtts) * 1e3:.1f} ms, {len(slow)} of 60 ms or more")
    # About 20 checkpoints fall in the 2 s, and a stall at each is what this guards
    # against; one or two slow round trips are this process's own scheduling when
    # the suite runs beside it (one of 143 ms was seen under 6 workers on 2 cores).
    assert len(slow) <= 2, f"{len(slow)} probe round trips of 60 ms or more: " \
        f"{[round(r * 1e3) for r in slow]} ms"


def test_many_channels_share_one_copy(make_broker: MakeBroker) -> None:
    """Publishing to a topic with 16 channels writes each message once: every channel
    gets every message, and the log's size does not grow with the channel count."""
    b = make_broker()
    topic = unique_name("fan")
    for i in range(16):
        create_channel(b, topic, f"c{i}")
    _fill(b, topic, 2000, size=200)
    for i in (0, 7, 15):
        assert len(consume(b, topic, f"c{i}", expect=2000)) == 2000
    segs = list((Path(b.data_path) / "topics").glob(f"{topic}/*.log"))
    assert segs and sum(p.stat().st_size for p in segs) < 2000 * 300


# -- replay ------------------------------------------------------------------------------------


def test_rewind_by_offset_and_by_time(make_broker: MakeBroker) -> None:
    b = make_broker("--retention-time=1h")
    topic = unique_name("rw")
    create_channel(b, topic, "ch")
    with WireClient.connect(b.tcp_address) as c:  # type: ignore[arg-type]
        c.mpub(topic, [b"a%d" % i for i in range(10)])
        time.sleep(0.05)   # a clear gap between the two batches' publish times
        t_mid_ms = int(time.time() * 1000)
        time.sleep(0.05)
        c.mpub(topic, [b"b%d" % i for i in range(10)])
    first = consume(b, topic, "ch", expect=20)
    offsets = [int(r.msg.id, 16) for r in first]
    assert offsets == list(range(offsets[0], offsets[0] + 20)), "ids are log offsets"
    ts = topic_stats(b, topic)
    assert ts is not None and ts["oldest_offset"] <= offsets[0]
    assert ts["newest_offset"] == offsets[-1]

    status, ans = _post(b, f"/channel/rewind?topic={topic}&channel=ch&offset={offsets[5]}")
    assert status == 200, ans
    again = consume(b, topic, "ch", expect=15)
    assert bodies(again) == [b"a%d" % i for i in range(5, 10)] + [b"b%d" % i for i in range(10)]
    assert all(r.msg.attempts == 1 for r in again)

    status, ans = _post(b, f"/channel/rewind?topic={topic}&channel=ch&ts={t_mid_ms}")
    assert status == 200, ans
    assert bodies(consume(b, topic, "ch", expect=10)) == [b"b%d" % i for i in range(10)]
    assert consume(b, topic, "ch", idle_s=0.3) == []


def test_rewind_errors(make_broker: MakeBroker) -> None:
    b = make_broker()
    topic = unique_name("rwerr")
    create_channel(b, topic, "ch")
    with WireClient.connect(b.tcp_address) as c:  # type: ignore[arg-type]
        c.mpub(topic, [b"m"] * 3)
    base = f"/channel/rewind?topic={topic}&channel=ch"
    assert _post(b, base + "&offset=999999") == (400, {"message": "OFFSET_OUT_OF_RANGE"})
    assert _post(b, base) == (400, {"message": "MISSING_ARG_OFFSET_OR_TS"})
    assert _post(b, base + "&offset=1&ts=5") == (400, {"message": "MISSING_ARG_OFFSET_OR_TS"})
    assert _post(b, base + "&offset=-1") == (400, {"message": "INVALID_ARG_OFFSET"})
    assert _post(b, f"/channel/rewind?topic={topic}&channel=nope&offset=0") == \
        (404, {"message": "CHANNEL_NOT_FOUND"})
    assert _post(b, "/channel/rewind?topic=nope_t&channel=ch&offset=0") == \
        (404, {"message": "TOPIC_NOT_FOUND"})


def _segments(b: BrokerProcess, topic: str) -> list[Path]:
    return sorted((Path(b.data_path) / "topics" / topic).glob("*.log"))


def _wait_checkpoints(b: BrokerProcess, topic: str, n: int = 2) -> None:
    """Wait until n checkpoints ran after this call, each of them whole (retention of
    ``topic`` included). A checkpoint writes a topic's state only when it changed, so
    the proof is a ticker topic changed before each: a message published to it moves
    its ``released``, and the next checkpoint saves its state again (the file written
    again, atomically: a new inode; or the change appended to its journal). After two,
    one whole checkpoint ran after this call."""
    ticker = f"{topic}_tick"
    path = Path(b.data_path) / "state" / f"{ticker}.json"

    def version() -> tuple[int, ...] | None:
        out: tuple[int, ...] = ()
        for p in (path, Path(f"{path}.journal")):
            try:
                st = p.stat()
            except FileNotFoundError:
                return None
            out += (st.st_ino, st.st_mtime_ns, st.st_size)
        return out

    for k in range(n):
        before = version()
        _fill(b, ticker, 1, size=10)
        wait_until(lambda before=before: version() not in (None, before), 10,
                   interval_s=0.005, what=f"checkpoint {k + 1} of {n} after {topic}")


def test_without_retention_consumed_segments_go(make_broker: MakeBroker) -> None:
    b = make_broker("--max-bytes-per-file=4096", "--sync-timeout=100ms")
    topic = unique_name("ret0")
    create_channel(b, topic, "ch")
    _fill(b, topic, 400, size=100, batch=20)
    assert len(_segments(b, topic)) > 5
    consume(b, topic, "ch", expect=400)
    wait_until(lambda: len(_segments(b, topic)) <= 1, what="consumed segments deleted")
    status, ans = _post(b, f"/channel/rewind?topic={topic}&channel=ch&offset=0")
    assert (status, ans) == (400, {"message": "OFFSET_OUT_OF_RANGE"})


def test_retention_by_bytes_keeps_consumed_segments_for_replay(make_broker: MakeBroker) -> None:
    b = make_broker("--max-bytes-per-file=4096", "--sync-timeout=100ms",
                    "--retention-bytes=20000")
    topic = unique_name("retb")
    create_channel(b, topic, "ch")
    _fill(b, topic, 800, size=100, batch=20)
    consume(b, topic, "ch", expect=800)

    def settled() -> bool:
        try:   # retention may delete a segment between the listing and the stat
            size = sum(p.stat().st_size for p in _segments(b, topic))
        except FileNotFoundError:
            return False
        return 20000 - 4096 <= size <= 20000 + 4096
    wait_until(settled, what="the log trimmed to about retention_bytes")
    ts = topic_stats(b, topic)
    assert ts is not None and ts["oldest_offset"] > 0
    status, _ = _post(b, f"/channel/rewind?topic={topic}&channel=ch&offset={ts['oldest_offset']}")
    assert status == 200
    again = consume(b, topic, "ch", expect=800 - ts["oldest_offset"])
    assert len(again) == 800 - ts["oldest_offset"]
    assert _post(b, f"/channel/rewind?topic={topic}&channel=ch&offset=0")[0] == 400


def test_retention_by_time(make_broker: MakeBroker) -> None:
    b = make_broker("--max-bytes-per-file=4096", "--sync-timeout=100ms", "--retention-time=2s")
    topic = unique_name("rett")
    create_channel(b, topic, "ch")
    _fill(b, topic, 400, size=100, batch=20)
    consume(b, topic, "ch", expect=400)
    _wait_checkpoints(b, topic)
    # within the retention time everything can be replayed
    assert _post(b, f"/channel/rewind?topic={topic}&channel=ch&offset=0")[0] == 200
    assert len(consume(b, topic, "ch", expect=400)) == 400
    wait_until(lambda: len(_segments(b, topic)) <= 1, timeout_s=10,
               what="segments older than retention_time deleted")
    assert _post(b, f"/channel/rewind?topic={topic}&channel=ch&offset=0")[0] == 400


def test_retention_never_drops_unconsumed_messages(make_broker: MakeBroker) -> None:
    b = make_broker("--max-bytes-per-file=4096", "--sync-timeout=100ms", "--retention-bytes=4096")
    topic = unique_name("retu")
    create_channel(b, topic, "ch")
    _fill(b, topic, 500, size=100, batch=20)
    _wait_checkpoints(b, topic)           # retention ran over the full log
    assert len(_segments(b, topic)) > 1, "the log should span segments beyond 4096 bytes"
    assert len(consume(b, topic, "ch", expect=500)) == 500


def test_rewind_command(make_broker: MakeBroker) -> None:
    import subprocess
    import sys

    b = make_broker("--retention-time=1h")
    topic = unique_name("rwcli")
    create_channel(b, topic, "ch")
    with WireClient.connect(b.tcp_address) as c:  # type: ignore[arg-type]
        c.mpub(topic, [b"m%d" % i for i in range(5)])
    consume(b, topic, "ch", expect=5)
    out = subprocess.run([sys.executable, "-m", "pybroker", "rewind", "--topic", topic,
                          "--channel", "ch", "--offset", "2", "--nsqd-http-address",
                          b.http_hostport], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert "rewound to offset 2" in out.stdout
    assert bodies(consume(b, topic, "ch", expect=3)) == [b"m2", b"m3", b"m4"]
    bad = subprocess.run([sys.executable, "-m", "pybroker", "rewind", "--topic", topic,
                          "--channel", "ch", "--offset", "99", "--nsqd-http-address",
                          b.http_hostport], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 1 and "OFFSET_OUT_OF_RANGE" in bad.stderr


# -- the default durability and kill -9 -------------------------------------------------------


@pytest.mark.parametrize("durability", ["memory", "fsync"])
def test_kill9_loses_no_acknowledged_message(make_broker: MakeBroker, durability: str) -> None:
    """Three kill -9 cycles under publishers (PUB/MPUB/DPUB over TCP, /pub over HTTP) and
    a consumer FINing every other message: every message answered OK is delivered, in the
    default memory mode too (its records were handed to the kernel before the OK)."""
    b = make_broker(f"--durability={durability}", "--mem-queue-size=50",
                    "--max-bytes-per-file=65536")
    topic = unique_name("k9")
    create_channel(b, topic, "ch")
    acked: set[bytes] = set()
    seen: set[bytes] = set()
    for cycle in range(3):
        consumer = FinningConsumer(b.tcp_address, topic, "ch", fin_every=2,  # type: ignore[arg-type]
                                   rdy_count=500).start()
        pubs: list[Publisher | HttpPublisher] = [
            Publisher(b.tcp_address, topic, f"c{cycle}p{i}", batch=5,  # type: ignore[arg-type]
                      defer_ms=200 if i == 0 else 0) for i in range(2)]
        pubs.append(HttpPublisher(b.http_address, topic, f"c{cycle}h"))  # type: ignore[arg-type]
        for p in pubs:
            p.start()
        wait_until(lambda ps=pubs: all(len(p.acked) >= 50 for p in ps),  # type: ignore[misc]
                   timeout_s=15, what="every publisher to get OKs")
        b.kill9()
        for p in pubs:
            p.stop()
        consumer.stop()
        for p in pubs:
            acked |= p.acked
        seen |= consumer.seen.keys()
        b.start()
    seen |= set(bodies(consume(b, topic, "ch", idle_s=2.0, timeout_s=60)))
    lost = acked - seen
    print(f"{durability}: {len(acked)} acknowledged, {len(lost)} never delivered")
    assert not lost, f"{len(lost)} acknowledged messages lost, e.g. {sorted(lost)[:5]}"


# -- the earlier storage format ----------------------------------------------------------------


def _old_record(body: bytes, ts: int, attempts: int = 0, deliver_at: int = 0) -> bytes:
    """A message record of pybroker's earlier per-queue format."""
    return struct.pack(">qqH", deliver_at, ts, attempts) + b"0123456789abcdef" + body


def test_queues_of_the_earlier_format_move_into_topic_logs(make_broker: MakeBroker,
                                                           tmp_path: Path) -> None:
    """A data_path written by the earlier storage (a disk queue per topic and per
    channel under queues/) is moved into topic logs on start: every queued message is
    delivered to its channel, with its publish time and attempts; nothing twice."""
    from tests.support.nsqd_data import topic_entry, write_metadata
    from tests.support.old_queues import write_queue

    data = tmp_path / "data"
    (data / "queues").mkdir(parents=True)
    ts = 1_700_000_000 * 10**9
    queues = {"old:a": [b"a%d" % i for i in range(5)], "old:b": [b"b%d" % i for i in range(3)],
              "lonely": [b"t%d" % i for i in range(4)]}
    for name, msgs in queues.items():
        recs = [_old_record(m, ts + i, attempts=1) for i, m in enumerate(msgs)]
        write_queue(data / "queues", name, [recs[:2], recs[2:]])
    # a queue with a checkpoint: seq 0 still un-acked, 1 acked, 2 and on never read
    done = [_old_record(b"c%d" % i, ts + i) for i in range(4)]
    write_queue(data / "queues", "old:c", [done], {"frontier": 2, "unacked": [[0, 1]]})
    queues["old:c"] = [b"c0", b"c2", b"c3"]
    write_metadata(data, [topic_entry("old", False, [("a", False), ("b", False), ("c", False)]),
                          topic_entry("lonely", False, [])])
    b = make_broker(data_path=str(data))
    assert any("earlier queue format" in ln for ln in b.stderr_lines), b.stderr_text()
    got_a = consume(b, "old", "a", expect=5)
    assert bodies(got_a) == queues["old:a"]
    assert [(r.msg.ts_ns, r.msg.attempts) for r in got_a] == [(ts + i, 2) for i in range(5)]
    assert sorted(bodies(consume(b, "old", "b", expect=3))) == sorted(queues["old:b"])
    assert bodies(consume(b, "lonely", "first", expect=4)) == queues["lonely"]
    assert bodies(consume(b, "old", "c", expect=3)) == queues["old:c"]
    b.stop()
    b.start()
    for topic, ch in (("old", "a"), ("old", "b"), ("old", "c"), ("lonely", "first")):
        assert consume(b, topic, ch, idle_s=0.3) == []
    assert not (data / "queues").exists() and (data / "queues-migrated").is_dir()


def test_huge_mpubs_do_not_stall_other_clients(make_broker: MakeBroker) -> None:
    """Four MPUBs of ~1,000,000 one-byte messages at once (5 MiB bodies, legal): they
    are appended a slice per loop turn, so another client's PUB round trips stay short,
    and every message arrives."""
    b = make_broker()
    n = 1_000_000
    payload = struct.pack(">i", n) + (struct.pack(">i", 1) + b"x") * n
    cmd = b"MPUB huge\n" + struct.pack(">i", len(payload)) + payload
    rtts: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        with WireClient.connect(b.tcp_address) as p:  # type: ignore[arg-type]
            while not stop.is_set():
                t0 = time.perf_counter()
                p.pub("huge_probe", b"p")
                rtts.append(time.perf_counter() - t0)

    def big() -> None:
        with WireClient.connect(b.tcp_address) as c:  # type: ignore[arg-type]
            c.send(cmd)
            c.expect_response(b"OK", timeout=60)

    th = threading.Thread(target=probe, daemon=True)
    th.start()
    wait_until(lambda: len(rtts) > 50, what="probe round trips")
    before = len(rtts)
    pubs = [threading.Thread(target=big) for _ in range(4)]
    t0 = time.perf_counter()
    for p in pubs:
        p.start()
    for p in pubs:
        p.join(120)
    phase = time.perf_counter() - t0
    stop.set()
    th.join(5)
    during = rtts[before:]
    blocked = sum(r for r in during if r > 0.1)
    print(f"probe round trips during 4 huge MPUBs: n={len(during)}, "
          f"max {max(during) * 1e3:.1f} ms, over 100 ms {blocked:.2f} s of {phase:.2f} s")
    # A loop that appends each MPUB whole holds the probe for almost all of the phase
    # (96-97% measured with SLICE above an MPUB's count: round trips of 0.14-0.96 s);
    # appended a slice a turn, the round trips over 100 ms add up to little of it (none
    # on this 2-core machine idle or beside three busy processes; 0.55 s under the
    # suite's parallel workers, where single round trips met a descheduled thread), so
    # the share of the phase is the measure, not one round trip
    assert blocked < 0.5 * phase, \
        f"the probe waited {blocked:.2f} s of {phase:.2f} s: {sorted(during)[-4:]}"
    assert (topic_stats(b, "huge") or {}).get("depth") == 4 * n
