"""The partitioned Spark source (mode log) on local[2] against a real pybroker process.

200,000 messages archived to Parquet by ``pybroker spark archive`` while the query's
process group is SIGKILLed at random points three times, then run to the end: Spark
reads back exactly the 200,000 (no loss, no duplicate). Starting from a time and from an
offset, and a range read again by a second query. Skipped without pyspark or Java.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_spark_core import publish
from tests.support.broker import BrokerProcess, project_root, unique_name, wait_until
from tests.support.programs import missing, require_module

require_module("pyspark", "pip install '.[spark]' in the clone")
require_module("pyarrow", "pip install '.[spark]' in the clone")

from pybroker.spark.pipeline import find_java, spark_session  # noqa: E402 (needs pyspark)

if find_java() is None:
    missing("no Java runtime for Spark (apt-get install openjdk-17-jre-headless)")

pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    session = spark_session("local[2]", "pybroker-log-tests", {
        "spark.ui.enabled": "false", "spark.sql.shuffle.partitions": "2",
        "spark.driver.memory": "1g"})
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


def body(i: int) -> bytes:
    return b"msg-%07d" % i


def cursor(b: BrokerProcess, topic: str, channel: str) -> int:
    url = f"http://{b.http_hostport}/stats?format=json&topic={topic}&channel={channel}"
    with urllib.request.urlopen(url, timeout=5) as resp:
        stats = json.loads(resp.read())
    for t in stats["topics"]:
        for c in t["channels"]:
            if t["topic_name"] == topic and c["channel_name"] == channel:
                return int(c["cursor"])
    return -1


def committed_batches(checkpoint: Path) -> int:
    commits = checkpoint / "commits"
    if not commits.is_dir():
        return 0
    return sum(1 for p in commits.iterdir() if p.name.isdigit())


def archive_cmd(b: BrokerProcess, topic: str, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "pybroker.spark.cli", "archive", f"--topic={topic}",
            f"--output={out}", f"--nsqd-http-address={b.http_hostport}",
            "--master=local[2]", "--conf=spark.ui.enabled=false",
            "--conf=spark.sql.shuffle.partitions=2", *extra]


@pytest.mark.timeout(900)   # four Spark start-ups: about 3 minutes, more on a busy machine
def test_archive_200000_exactly_once_through_three_kills(
        spark: Any, broker: BrokerProcess, tmp_path: Path) -> None:
    topic = unique_name("sl_kill")
    n = 200_000
    publish(broker, topic, [body(i) for i in range(n)])
    out = tmp_path / "lake"
    ck = out / "_checkpoint"
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    env = dict(os.environ, PYTHONPATH=str(project_root()))
    cmd = archive_cmd(broker, topic, out, "--trigger=1s")
    capped = [*cmd, "--max-offsets-per-trigger=8000"]
    round_ = 0
    while round_ < 3:
        # a new session each time: the kill takes the JVM (same process group) with it.
        # Its stderr goes to a file, never to a pipe nobody reads while it runs (a full
        # pipe would stop it mid-batch); the file's tail is in any failure's message.
        log_path = tmp_path / f"archive{round_}.log"
        with open(log_path, "w") as log_file:
            proc = subprocess.Popen(capped, stdout=subprocess.DEVNULL, stderr=log_file,
                                    env=env, start_new_session=True)
        try:
            before = committed_batches(ck)

            def progressed(p: subprocess.Popen[bytes] = proc, n0: int = before) -> bool:
                return committed_batches(ck) > n0 or p.poll() is not None

            def log_tail(path: Path = log_path) -> str:
                return path.read_text(errors="replace")[-3000:]

            try:
                wait_until(progressed, 240,
                           what=f"a committed batch in round {round_} (seed {seed})")
            except AssertionError as e:
                raise AssertionError(f"{e}; its log ends:\n{log_tail()}") from None
            assert proc.poll() is None, log_tail()
            round_ += 1
            time.sleep(rng.uniform(0.0, 2.5))   # somewhere in the next batch(es)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    assert committed_batches(ck) < n // 8000, f"the kills came too late (seed {seed})"
    # the batch planned at the last kill runs again as planned, then the rest in one
    done = subprocess.run([*cmd, "--available-now"], capture_output=True, text=True,
                          env=env, timeout=300, check=False, start_new_session=True)
    assert done.returncode == 0, done.stderr[-3000:]
    lake = spark.read.parquet(str(out))
    # checked in Spark, not by collecting 200,000 rows into Python: n rows, n distinct
    # offsets from 0 to n-1 (so each offset exactly once), and each row's body the one
    # published at its offset (body(i) is "msg-%07d" % i)
    summary = lake.selectExpr(
        "count(*) AS rows", "count(DISTINCT offset) AS offsets", "min(offset) AS lo",
        "max(offset) AS hi",
        "sum(CASE WHEN cast(body AS string) = format_string('msg-%07d', offset) "
        "THEN 0 ELSE 1 END) AS wrong").collect()[0]
    assert summary.rows == n, f"{summary.rows} rows for {n} messages (seed {seed})"
    assert (summary.offsets, summary.lo, summary.hi) == (n, 0, n - 1), f"seed {seed}"
    assert summary.wrong == 0, f"{summary.wrong} rows with another body (seed {seed})"
    # the source's channel follows what Spark committed, so retention may delete it
    wait_until(lambda: cursor(broker, topic, "spark_archive") == n, 10,
               what="the channel cursor at the end")


def _run_once(spark: Any, b: BrokerProcess, topic: str, ck: Path, **opts: str) -> Any:
    reader = (spark.readStream.format("pybroker").option("nsqd_http", b.http_hostport)
              .option("topic", topic).option("channel", ck.name)
              .option("checkpoint", str(ck)))
    for k, v in opts.items():
        reader = reader.option(k, v)
    out = ck.parent / (ck.name + "_out")
    query = (reader.load().writeStream.format("parquet").option("path", str(out))
             .option("checkpointLocation", str(ck)).trigger(availableNow=True).start())
    assert query.awaitTermination(120)
    assert query.exception() is None, query.exception()
    return spark.read.parquet(str(out))


def test_start_at_a_time_an_offset_and_read_a_range_again(
        spark: Any, broker: BrokerProcess, tmp_path: Path) -> None:
    topic = unique_name("sl_start")
    publish(broker, topic, [body(i) for i in range(3000)])
    time.sleep(0.05)
    mark_ms = int(time.time() * 1000)
    time.sleep(0.05)
    publish(broker, topic, [body(i) for i in range(3000, 5000)])

    by_ts = _run_once(spark, broker, topic, tmp_path / "ts",
                      startingOffsets=json.dumps({"ts": mark_ms}))
    assert sorted(r.offset for r in by_ts.select("offset").collect()) == \
        list(range(3000, 5000))
    iso = datetime.fromtimestamp(mark_ms / 1000, timezone.utc).isoformat()
    by_iso = _run_once(spark, broker, topic, tmp_path / "iso", startingOffsets=iso)
    assert by_iso.count() == 2000

    everything = _run_once(spark, broker, topic, tmp_path / "all", numPartitions="3",
                           maxOffsetsPerTrigger="1500")
    rows = {r.offset: bytes(r.body) for r in everything.select("offset", "body").collect()}
    assert sorted(rows) == list(range(5000))
    assert all(rows[i] == body(i) for i in range(5000))
    # the same range again, from an offset, by a second query: the same rows
    again = _run_once(spark, broker, topic, tmp_path / "again", startingOffsets="1234")
    got = {r.offset: bytes(r.body) for r in again.select("offset", "body").collect()}
    assert sorted(got) == list(range(1234, 5000))
    assert all(got[i] == rows[i] for i in got)
    one = again.where("offset = 1234").collect()[0]
    assert one.id == "%016x" % 1234 and one.topic == topic and one.attempts == 0
    assert one.timestamp is not None


def test_latest_then_a_restart_reads_only_what_came_after(
        spark: Any, broker: BrokerProcess, tmp_path: Path) -> None:
    topic = unique_name("sl_latest")
    publish(broker, topic, [body(i) for i in range(100)])
    ck = tmp_path / "latest"
    out = tmp_path / "latest_out"
    for _ in range(2):
        query = (spark.readStream.format("pybroker").option("nsqd_http", broker.http_hostport)
                 .option("topic", topic).option("channel", "latest")
                 .option("startingOffsets", "latest").option("checkpoint", str(ck)).load()
                 .writeStream.format("parquet").option("path", str(out))
                 .option("checkpointLocation", str(ck)).trigger(availableNow=True).start())
        assert query.awaitTermination(120)
        assert query.exception() is None
        # the channel is pinned where the query starts, then follows its commits
        assert cursor(broker, topic, "latest") == 100 + (50 if _ else 0)
        if not _:
            publish(broker, topic, [body(i) for i in range(100, 150)])
    got = sorted(r.offset for r in spark.read.parquet(str(out)).select("offset").collect())
    assert got == list(range(100, 150))


def test_bad_options_are_refused(broker: BrokerProcess) -> None:
    from pybroker.spark.options import LogSourceOptions, OptionError, source_mode

    base = {"topic": "t", "nsqd_http": broker.http_hostport}
    assert LogSourceOptions.parse(base).starting_offsets == "earliest"
    assert LogSourceOptions.parse({**base, "startingOffsets": "42"}).starting_offsets == 42
    for bad in ("yesterday", "{\"ts\": -1}", "-5"):
        with pytest.raises(OptionError, match="startingOffsets"):
            LogSourceOptions.parse({**base, "startingOffsets": bad})
    with pytest.raises(OptionError, match="nsqd_http"):
        LogSourceOptions.parse({"topic": "t", "nsqd": "127.0.0.1:4150"})
    with pytest.raises(OptionError, match="mode"):
        source_mode({"mode": "kafka"})
    assert source_mode({}) == "log" and source_mode({"mode": "Channel"}) == "channel"


def test_lost_offsets_fail_the_query_unless_told_to_go_on(
        spark: Any, make_broker: Any, tmp_path: Path) -> None:
    """Retention deleted part of the range the checkpoint says comes next (the source's
    channel was deleted, the only other channel is past it all): the restarted query
    fails naming the lost offsets; with failOnDataLoss=false it reads what is left."""
    # small segments, deleted as soon as every channel is past them
    b = make_broker("--max-bytes-per-file=4096", "--sync-timeout=100ms")
    topic = unique_name("sl_lost")
    for i in range(0, 300, 20):
        publish(b, topic, [body(j) + b"y" * 100 for j in range(i, i + 20)])
    ck = tmp_path / "lost"
    first = _run_once(spark, b, topic, ck)
    assert first.count() == 300
    for i in range(300, 600, 20):
        publish(b, topic, [body(j) + b"y" * 100 for j in range(i, i + 20)])
    req = urllib.request.Request(
        f"http://{b.http_hostport}/channel/delete?topic={topic}&channel=lost",
        data=b"", method="POST")
    urllib.request.urlopen(req, timeout=5).close()
    from pybroker.spark.log_client import LogClient

    with LogClient(b.http_hostport) as c:
        c.commit(topic, "other", 600)       # a channel that has consumed everything
        wait_until(lambda: c.offsets(topic).oldest > 300, 15, what="segments deleted")
        oldest = c.offsets(topic).oldest
    with pytest.raises(Exception, match=r"no longer in the log"):
        _run_once(spark, b, topic, ck)
    rest = _run_once(spark, b, topic, ck, failOnDataLoss="false")
    got = sorted(r.offset for r in rest.select("offset").collect())
    assert got == list(range(300)) + list(range(oldest, 600))
