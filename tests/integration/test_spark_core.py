"""The Spark integration's broker side, without Spark: real broker, real files.

These run whether or not pyspark is installed: the subscription and its ledger (FIN
only on commit, TOUCH keep-alive, REQ on stop, batch cap), the checkpoint reader,
the MPUB publisher and the archive file reader over files the real tools wrote.
"""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pybroker.client import Consumer, Producer
from pybroker.client.errors import ProtocolError
from pybroker.spark.archive_files import find_archives, parse_name, read_bodies
from pybroker.spark.checkpoint import committed_offset, committed_seq
from pybroker.spark.options import OptionError, SinkOptions, SourceOptions
from pybroker.spark.subscription import Subscription
from tests.support.broker import BrokerProcess, project_root, unique_name, wait_until
from tests.support.lookupd import FakeLookupd
from tests.support.programs import require_module, require_program

pytestmark = pytest.mark.timeout(90)


def publish(b: BrokerProcess, topic: str, bodies: list[bytes]) -> None:
    with Producer(b.tcp_hostport) as p:
        for i in range(0, len(bodies), 500):
            p.multi_publish(topic, bodies[i:i + 500])


def channel_stats(b: BrokerProcess, topic: str, channel: str) -> dict[str, Any]:
    url = f"http://{b.http_hostport}/stats?format=json&topic={topic}&channel={channel}"
    with urllib.request.urlopen(url, timeout=5) as resp:
        stats = json.loads(resp.read())
    for t in stats["topics"]:
        if t["topic_name"] == topic:
            for c in t["channels"]:
                if c["channel_name"] == channel:
                    return dict(c)
    raise AssertionError(f"no channel {topic}/{channel} in /stats")


def source_opts(b: BrokerProcess, topic: str, **kw: str) -> SourceOptions:
    return SourceOptions.parse({"nsqd": b.tcp_hostport, "topic": topic,
                                "channel": "spark", **kw})


@pytest.fixture
def subscriptions() -> Iterator[Callable[[SourceOptions], Subscription]]:
    made: list[Subscription] = []

    def make(opts: SourceOptions) -> Subscription:
        sub = Subscription(opts).start()
        made.append(sub)
        return sub

    yield make
    for sub in made:
        sub.close(timeout_s=5)


def test_options_refuse_a_batch_that_fills_the_window() -> None:
    base = {"nsqd": "127.0.0.1:4150", "topic": "t", "channel": "c", "max_in_flight": "100"}
    assert SourceOptions.parse(base).max_batch_size == 50
    with pytest.raises(OptionError, match="max_batch_size"):
        SourceOptions.parse({**base, "max_batch_size": "51"})
    with pytest.raises(OptionError, match="channel"):
        SourceOptions.parse({"nsqd": "127.0.0.1:4150", "topic": "t"})
    with pytest.raises(OptionError, match="nsqd"):
        SourceOptions.parse({"topic": "t", "channel": "c"})
    with pytest.raises(OptionError, match="topic"):
        SinkOptions.parse({"nsqd": "127.0.0.1:4150", "topic": "bad topic"})


def test_fin_only_on_commit_and_touch_outlives_msg_timeout(
        make_broker: Callable[..., BrokerProcess],
        subscriptions: Callable[[SourceOptions], Subscription]) -> None:
    b = make_broker("--msg-timeout=1s")
    topic = unique_name("sp_touch")
    publish(b, topic, [b"t-%03d" % i for i in range(40)])
    sub = subscriptions(source_opts(b, topic, max_in_flight="100"))
    ledger = sub.ledger
    wait_until(lambda: ledger.counts()["received"] == 40, 10, what="40 deliveries")
    end = ledger.latest(ledger.offset(0))
    assert end == ledger.offset(40)
    assert len(ledger.planned(ledger.offset(0), end)) == 40
    assert sub.touch_interval_s() == pytest.approx(1 / 3, rel=0.01)
    # Held for three msg_timeouts: only TOUCH keeps them from timing out.
    time.sleep(3.0)
    stats = channel_stats(b, topic, "spark")
    assert stats["timeout_count"] == 0 and stats["in_flight_count"] == 40, stats
    assert ledger.counts()["received"] == 40            # nothing was redelivered
    assert ledger.commit(end) == 40
    wait_until(lambda: channel_stats(b, topic, "spark")["in_flight_count"] == 0, 5,
               what="FINs to land")
    assert channel_stats(b, topic, "spark")["depth"] == 0


def test_without_touch_held_messages_time_out(
        make_broker: Callable[..., BrokerProcess],
        subscriptions: Callable[[SourceOptions], Subscription]) -> None:
    """The contrast: with no TOUCH in time, the server redelivers held messages."""
    b = make_broker("--msg-timeout=1s")
    topic = unique_name("sp_notouch")
    publish(b, topic, [b"n-%03d" % i for i in range(10)])
    sub = subscriptions(source_opts(b, topic, max_in_flight="100", touch_interval="1h"))
    wait_until(lambda: sub.ledger.counts()["received"] >= 20, 10,
               what="redeliveries after msg_timeout")
    assert channel_stats(b, topic, "spark")["timeout_count"] >= 10


def test_batches_never_fill_the_window_and_commit_frees_it(
        broker: BrokerProcess,
        subscriptions: Callable[[SourceOptions], Subscription]) -> None:
    topic = unique_name("sp_window")
    publish(broker, topic, [b"w-%04d" % i for i in range(500)])
    sub = subscriptions(source_opts(broker, topic, max_in_flight="100"))
    ledger = sub.ledger
    wait_until(lambda: ledger.counts()["received"] == 100, 10, what="a full window")
    first = ledger.latest(ledger.offset(0))
    assert first == ledger.offset(50)                    # half the window, not all of it
    seen = [m.body for m in ledger.planned(ledger.offset(0), first)]
    second = ledger.latest(first)                        # batch 2 planned before 1 commits
    assert second == ledger.offset(100)
    seen += [m.body for m in ledger.planned(first, second)]
    assert ledger.latest(second) is None                 # window full until a commit
    assert ledger.commit(first) == 50                    # Spark commits batch 1 ...
    wait_until(lambda: ledger.counts()["received"] >= 150, 10, what="the window to refill")
    third = ledger.latest(second)                        # ... and batch 3 can be planned
    assert third == ledger.offset(150)
    seen += [m.body for m in ledger.planned(second, third)]
    assert len(seen) == len(set(seen)) == 150


def test_batch_cap_follows_the_rdy_the_server_grants(
        make_broker: Callable[..., BrokerProcess],
        subscriptions: Callable[[SourceOptions], Subscription]) -> None:
    """max_in_flight 1000 on a server granting RDY 100: batches of 50, not 500."""
    b = make_broker("--max-rdy-count=100")
    topic = unique_name("sp_rdycap")
    publish(b, topic, [b"c-%03d" % i for i in range(300)])
    sub = subscriptions(source_opts(b, topic, max_in_flight="1000"))
    wait_until(lambda: sub.ledger.counts()["received"] == 100, 10, what="RDY 100 in flight")
    assert sub.batch_cap() == 50
    assert sub.ledger.latest(None, sub.batch_cap()) == sub.ledger.offset(50)


def test_close_requeues_uncommitted_for_the_next_run(
        broker: BrokerProcess,
        subscriptions: Callable[[SourceOptions], Subscription]) -> None:
    topic = unique_name("sp_requeue")
    bodies = [b"r-%03d" % i for i in range(60)]
    publish(broker, topic, bodies)
    opts = source_opts(broker, topic, max_in_flight="100")
    first = Subscription(opts).start()
    wait_until(lambda: first.ledger.counts()["received"] == 60, 10, what="60 deliveries")
    end = first.ledger.latest(None)
    assert end == first.ledger.offset(50)
    held_ids = {m.id for m in first.ledger.planned(first.ledger.offset(30), end)}
    first.ledger.commit(first.ledger.offset(20))
    finished, requeued = first.close(done_seq=30)       # the checkpoint proved 21..30 done
    assert (finished, requeued) == (10, 30)
    second = subscriptions(opts)
    wait_until(lambda: second.ledger.counts()["received"] == 30, 10, what="redelivery")
    got = second.ledger.planned(None, second.ledger.latest(None) or {})
    assert sorted(m.body for m in got) == bodies[30:]
    assert all(m.attempts == 2 for m in got)
    assert held_ids <= {m.id for m in got}              # redelivery keeps the id
    # another run's offsets name messages this run never held: planned empty
    assert second.ledger.planned(first.ledger.offset(30), first.ledger.offset(50)) == []


def test_lookupd_discovery(broker: BrokerProcess,
                           subscriptions: Callable[[SourceOptions], Subscription]) -> None:
    topic = unique_name("sp_lookup")
    publish(broker, topic, [b"l-%02d" % i for i in range(20)])
    with FakeLookupd() as lookupd:
        lookupd.add_producer(topic, broker)
        sub = subscriptions(SourceOptions.parse({"lookupd": lookupd.http_hostport,
                                                 "topic": topic, "channel": "spark"}))
        wait_until(lambda: sub.ledger.counts()["received"] == 20, 10,
                   what="messages from the nsqd lookupd named")
        assert lookupd.lookups


def test_without_pyspark_the_cli_still_loads_and_says_what_to_install() -> None:
    """pyspark stays optional: the command group loads, and the command names the extra."""
    code = (
        "import sys\n"
        "sys.modules['pyspark'] = None; sys.modules['pyarrow'] = None\n"
        "import typer, pybroker, pybroker.spark, pybroker.spark.cli as cli\n"
        "app = typer.Typer(); cli.register(app)\n"
        "@app.callback()\n"
        "def main() -> None: pass\n"
        "app()\n")
    base = [sys.executable, "-c", code]
    helped = subprocess.run([*base, "spark", "--help"], capture_output=True, text=True,
                            timeout=60, check=False, cwd=project_root())
    assert helped.returncode == 0 and "archive" in helped.stdout, helped.stderr
    ran = subprocess.run([*base, "spark", "archive", "--topic=t", "--output=/nonexistent",
                          "--nsqd-http-address=127.0.0.1:1"], capture_output=True, text=True,
                         timeout=60, check=False, cwd=project_root())
    assert ran.returncode == 1, ran.stderr
    assert "pip install '.[spark]' in the clone" in ran.stderr
    assert "Traceback" not in ran.stderr


def test_checkpoint_commit_log_is_read_for_this_run_only(tmp_path: Path) -> None:
    (tmp_path / "offsets").mkdir()
    (tmp_path / "commits").mkdir()
    meta = '{"batchWatermarkMs":0,"batchTimestampMs":1}'
    for batch, offset in [(0, {"run": "old", "seq": 9}), (1, {"run": "new", "seq": 5}),
                          (2, {"run": "new", "seq": 12})]:
        (tmp_path / "offsets" / str(batch)).write_text(f"v1\n{meta}\n{json.dumps(offset)}\n")
    (tmp_path / "commits" / "0").write_text("v1\n{}\n")
    assert committed_seq(str(tmp_path), "new") is None   # batch 1 not committed yet
    (tmp_path / "commits" / "1").write_text("v1\n{}\n")
    assert committed_seq(str(tmp_path), "new") == 5
    assert committed_seq(f"file://{tmp_path}", "new") == 5
    assert committed_seq(str(tmp_path), "old") is None
    assert committed_seq("hdfs://nn/ck", "new") is None


def test_publisher_mpub_batches_and_refusals(make_broker: Callable[..., BrokerProcess]) -> None:
    pa = require_module("pyarrow", "the spark extra: pip install '.[spark]' in the clone")
    from pybroker.spark.publisher import PublishError
    from pybroker.spark.publisher import publish as mpub

    b = make_broker("--max-msg-size=100")
    topic = unique_name("sp_pub")
    rows = pa.record_batch([pa.array([f"p-{i:04d}" for i in range(1234)])], names=["body"])
    opts = SinkOptions.parse({"nsqd": b.tcp_hostport, "topic": topic, "batch_size": "100"})
    got: list[bytes] = []
    c = Consumer(topic, "check", lambda m: got.append(m.body), max_in_flight=500)
    c.connect_to_nsqd(b.tcp_hostport)
    try:
        assert mpub([rows], opts, b.tcp_hostport) == 1234
        wait_until(lambda: len(got) == 1234, 10, what="1234 messages")
    finally:
        c.close()
    assert sorted(got) == [f"p-{i:04d}".encode() for i in range(1234)]
    big = pa.record_batch([pa.array([b"x" * 200], pa.binary())], names=["body"])
    with pytest.raises(ProtocolError, match="E_BAD_MESSAGE"):
        mpub([big], opts, b.tcp_hostport)
    empty = pa.record_batch([pa.array([b""], pa.binary())], names=["body"])
    with pytest.raises(PublishError, match="empty"):
        mpub([empty], opts, b.tcp_hostport)


# -- archives ---------------------------------------------------------------------------
def to_file_prefix() -> list[str]:
    probe = subprocess.run([sys.executable, "-m", "pybroker", "to-file", "--version"],
                           capture_output=True, text=True, timeout=30, cwd=project_root(),
                           check=False)
    if probe.returncode == 0 and "to-file" in probe.stdout:
        return [sys.executable, "-m", "pybroker"]
    return [sys.executable, "-m", "pybroker.tools"]


def write_archive(b: BrokerProcess, topic: str, out: Path, count: int, *args: str,
                  tool: str = "pybroker") -> None:
    """Run pybroker to-file (or nsq_to_file) until ``count`` lines are on disk."""
    argv = ([*to_file_prefix(), "to-file"] if tool == "pybroker"
            else [require_program("nsq_to_file", "to write reference archives")])
    proc = subprocess.Popen([*argv, f"--nsqd-tcp-address={b.tcp_hostport}",
                             f"--topic={topic}", f"--output-dir={out}", "--channel=archive",
                             "--sync-interval=200ms", *args],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, cwd=project_root())
    try:
        wait_until(lambda: sum(1 for f in find_archives([str(out)])
                               for _ in read_bodies(f.path)) >= count, 30,
                   interval_s=0.2, what=f"{count} archived lines")
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err


@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gzip"])
def test_archive_reader_reads_pybroker_to_file(broker: BrokerProcess, tmp_path: Path,
                                               gz: bool) -> None:
    topic = unique_name("sp.arch")                      # a dot in the topic name, too
    bodies = [b"a-%05d" % i for i in range(3000)]
    publish(broker, topic, bodies)
    write_archive(broker, topic, tmp_path, 3000, *(["--gzip"] if gz else []))
    files = find_archives([str(tmp_path)], topic)
    assert files and all(f.topic == topic and f.timestamp_us for f in files)
    got = [body for f in files for body in read_bodies(f.path)]
    assert sorted(got) == bodies
    assert find_archives([str(tmp_path)], "other") == []


def test_archive_reader_reads_nsq_to_file(broker: BrokerProcess, tmp_path: Path) -> None:
    require_program("nsq_to_file", "to write reference archives")
    topic = unique_name("sp_nsqarch")
    bodies = [b"n-%05d" % i for i in range(2000)]
    publish(broker, topic, bodies)
    write_archive(broker, topic, tmp_path, 2000, "--gzip", tool="nsq_to_file")
    files = find_archives([str(tmp_path)], topic)
    assert [f.path.endswith(".log.gz") for f in files] == [True] * len(files)
    assert sorted(body for f in files for body in read_bodies(f.path)) == bodies


def test_archive_reader_skips_an_unsynced_tail(tmp_path: Path) -> None:
    """A gzip member with no end or a line with no newline was never FIN'd: skipped."""
    gz_path = tmp_path / "t.host-000000.2026-01-02_03.log.gz"
    complete = gzip.compress(b"one\ntwo\n") + gzip.compress(b"three\n")
    gz_path.write_bytes(complete + gzip.compress(b"four\nfive\n")[:-6])
    assert list(read_bodies(str(gz_path))) == [b"one", b"two", b"three"]
    plain = tmp_path / "t.host.2026-01-02_03.log"
    plain.write_bytes(b"one\ntwo\nthr")
    assert list(read_bodies(str(plain))) == [b"one", b"two"]
    topic, ts = parse_name(plain.name) or ("", None)
    assert topic == "t" and ts == int(time.mktime((2026, 1, 2, 3, 0, 0, 0, 0, -1))) * 10**6
    assert parse_name("notes.txt") is None
    assert {f.topic for f in find_archives([str(tmp_path)])} == {"t"}
    with pytest.raises(FileNotFoundError):
        find_archives([os.path.join(str(tmp_path), "missing")])


def test_checkpoint_commit_log_gives_the_log_sources_committed_end(tmp_path: Path) -> None:
    (tmp_path / "offsets").mkdir()
    (tmp_path / "commits").mkdir()
    meta = '{"batchWatermarkMs":0,"batchTimestampMs":1}'
    for batch, end in [(0, 1000), (1, 2500)]:
        lines = [json.dumps({"topic": "other", "offset": 7}), "not json",
                 json.dumps({"topic": "t", "offset": end})]
        (tmp_path / "offsets" / str(batch)).write_text(f"v1\n{meta}\n" + "\n".join(lines))
    assert committed_offset(str(tmp_path), "t") is None       # nothing committed yet
    (tmp_path / "commits" / "0").write_text("v1\n{}\n")
    assert committed_offset(str(tmp_path), "t") == 1000
    (tmp_path / "commits" / "1").write_text("v1\n{}\n")
    assert committed_offset(f"file://{tmp_path}", "t") == 2500
    assert committed_offset(str(tmp_path), "other") == 7
    assert committed_offset(str(tmp_path), "missing") is None
    assert committed_offset("hdfs://nn/ck", "t") is None
