"""PySpark end to end: a local Spark (local[2]) against a real pybroker process.

The streaming source into Parquet (20,000 messages, read back complete, every message
FIN'd), a query stopped mid-stream and restarted (no loss; duplicates counted), the
batch sink (20,000 rows, all received; a refused MPUB fails the task and Spark's retry
moves to the next nsqd), the streaming sink, the archive reader over files written by
``pybroker to-file``, and the ``pybroker spark archive`` command. Skipped when pyspark
or a Java runtime is missing.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pybroker.client import Consumer
from tests.integration.test_spark_core import channel_stats, publish, write_archive
from tests.support.broker import BrokerProcess, unique_name, wait_until
from tests.support.lookupd import FakeLookupd
from tests.support.programs import missing, require_module

require_module("pyspark", "pip install '.[spark]' in the clone")
require_module("pyarrow", "pip install '.[spark]' in the clone")

from pybroker.spark.pipeline import (  # noqa: E402 (needs pyspark)
    ArchiveJob,
    batch_rows,
    find_java,
    spark_session,
    start_query,
    start_archive,
)

if find_java() is None:
    missing("no Java runtime for Spark (apt-get install openjdk-17-jre-headless)")

pytestmark = pytest.mark.timeout(240)

N = 20_000


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    """One local Spark for the module: 2 cores, tasks retried up to 4 times."""
    session = spark_session("local[2,4]", "pybroker-tests", {
        "spark.ui.enabled": "false", "spark.sql.shuffle.partitions": "2",
        "spark.default.parallelism": "2", "spark.driver.memory": "1g",
        "spark.sql.streaming.noDataMicroBatches.enabled": "false"})
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture(scope="module")
def big_broker(make_module_broker: Callable[..., BrokerProcess]) -> BrokerProcess:
    """A broker that grants RDY up to 10,000, so batches can hold 5,000 messages."""
    return make_module_broker("--max-rdy-count=10000")


def bodies(prefix: str, n: int = N) -> list[bytes]:
    return [b"%s-%05d" % (prefix.encode(), i) for i in range(n)]


def drained(b: BrokerProcess, topic: str, channel: str) -> bool:
    stats = channel_stats(b, topic, channel)
    return stats["depth"] == 0 and stats["in_flight_count"] == 0


def consume(b: BrokerProcess, topic: str, want: int, timeout_s: float = 60) -> list[bytes]:
    got: list[bytes] = []
    c = Consumer(topic, "verify", lambda m: got.append(m.body), max_in_flight=2000)
    c.connect_to_nsqd(b.tcp_hostport)
    try:
        wait_until(lambda: len(got) >= want, timeout_s, interval_s=0.1,
                   what=f"{want} messages")
    finally:
        c.close()
    return got


def job(b: BrokerProcess, topic: str, out: Path, **kw: Any) -> ArchiveJob:
    kw.setdefault("max_in_flight", 10000)
    return ArchiveJob(topic=topic, channel="archive", output=str(out / "lake"),
                      mode="channel", nsqd=[b.tcp_hostport], **kw)


def test_stream_20000_messages_into_parquet(spark: Any, big_broker: BrokerProcess,
                                            tmp_path: Path,
                                            record_property: Callable[[str, object], None]
                                            ) -> None:
    topic = unique_name("sk_stream")
    sent = bodies("s")
    published_at = time.time()
    publish(big_broker, topic, sent)
    days = {time.strftime("date=%Y-%m-%d", time.gmtime(t)) for t in (published_at, time.time())}
    started = time.monotonic()
    query = start_archive(spark, job(big_broker, topic, tmp_path, available_now=True))
    assert query.awaitTermination(180), "the available-now query did not finish"
    took = time.monotonic() - started
    assert query.exception() is None
    record_property("stream_msgs_per_s", round(N / took))
    lake = spark.read.parquet(str(tmp_path / "lake"))
    assert set(lake.columns) == {"id", "body", "timestamp", "attempts", "topic", "offset",
                                 "date", "hour"}
    rows = lake.select("body", "topic", "attempts", "id", "offset").collect()
    assert len(rows) == N
    assert sorted(bytes(r.body) for r in rows) == sent
    assert {r.topic for r in rows} == {topic} and {r.attempts for r in rows} == {1}
    assert len({r.id for r in rows}) == N
    assert {r.offset for r in rows} == {None}        # a channel has no offsets
    parts = sorted(p.name for p in (tmp_path / "lake").iterdir() if p.name.startswith("date="))
    assert parts and set(parts) <= days, parts
    # every message was FIN'd, the last batch too (through the checkpoint's commit log)
    wait_until(lambda: drained(big_broker, topic, "archive"), 10, what="FINs")


def test_stopped_query_restarts_without_loss(spark: Any, big_broker: BrokerProcess,
                                             tmp_path: Path,
                                             record_property: Callable[[str, object], None]
                                             ) -> None:
    topic = unique_name("sk_restart")
    sent = bodies("r")
    publish(big_broker, topic, sent)
    first = start_archive(spark, job(big_broker, topic, tmp_path, max_in_flight=2000,
                                     trigger_s=0.2))
    wait_until(lambda: sum(batch_rows(first).values()) >= 5000, 120, interval_s=0.2,
               what="5,000 rows through the first query")
    first.stop()                                      # mid-stream: batches still to come
    assert first.exception() is None
    done_first = sum(batch_rows(first).values())
    assert done_first < N, "the first query drained the topic before it was stopped"
    second = start_archive(spark, job(big_broker, topic, tmp_path, available_now=True))
    assert second.awaitTermination(180), "the restarted query did not finish"
    assert second.exception() is None
    got = [bytes(r.body) for r in spark.read.parquet(str(tmp_path / "lake"))
           .select("body").collect()]
    counts = Counter(got)
    # a message not archived is lost only if the channel does not hold it either
    assert set(counts) == set(sent), (f"{len(set(sent) - set(counts))} messages not archived; "
                                      f"{channel_stats(big_broker, topic, 'archive')}")
    duplicates = len(got) - len(counts)
    record_property("restart_duplicates", duplicates)
    print(f"restart: {done_first} rows before the stop, {duplicates} duplicates")
    assert duplicates <= 2000                         # at most what was held at the stop
    wait_until(lambda: drained(big_broker, topic, "archive"), 10, what="FINs")


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            return False
    return False


def source_runner_pids() -> list[int]:
    """PIDs of the Python processes our Spark runs stream readers in (our children)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if b"python_streaming_source_runner" in cmdline and _descends_from(int(entry),
                                                                           os.getpid()):
            pids.append(int(entry))
    return pids


def test_crashed_query_leaves_messages_for_the_next(
        spark: Any, make_broker: Callable[..., BrokerProcess], tmp_path: Path) -> None:
    """SIGKILL the process holding the subscription: nothing is FIN'd for the batches
    it had not seen committed, the server redelivers them after msg_timeout, and the
    next query archives every message."""
    b = make_broker("--msg-timeout=2s", "--max-rdy-count=10000")
    topic = unique_name("sk_crash")
    sent = bodies("k", 10_000)
    publish(b, topic, sent)
    first = start_archive(spark, job(b, topic, tmp_path, max_in_flight=2000, trigger_s=0.2))
    wait_until(lambda: sum(batch_rows(first).values()) >= 2000, 120, interval_s=0.2,
               what="2,000 rows through the first query")
    pids = source_runner_pids()
    assert len(pids) == 1, pids
    os.kill(pids[0], signal.SIGKILL)
    from pyspark.errors import StreamingQueryException

    with pytest.raises(StreamingQueryException):      # the query dies with its source
        first.awaitTermination(60)
    assert sum(batch_rows(first).values()) < len(sent)
    wait_until(lambda: channel_stats(b, topic, "archive")["in_flight_count"] == 0, 15,
               what="the crashed run's messages to time out")
    second = start_archive(spark, job(b, topic, tmp_path, available_now=True))
    assert second.awaitTermination(120)
    got = Counter(bytes(r.body) for r in spark.read.parquet(str(tmp_path / "lake"))
                  .select("body").collect())
    assert set(got) == set(sent), f"{len(set(sent) - set(got))} messages lost"
    print(f"crash: {sum(got.values()) - len(got)} duplicates")
    wait_until(lambda: drained(b, topic, "archive"), 10, what="FINs")


def test_sink_publishes_20000_rows(spark: Any, broker: BrokerProcess,
                                   record_property: Callable[[str, object], None]) -> None:
    from pyspark.sql import functions as F

    topic = unique_name("sk_sink")
    df = spark.range(N, numPartitions=4).select(
        F.format_string("k-%05d", "id").cast("binary").alias("body"))
    started = time.monotonic()
    (df.write.format("pybroker").option("nsqd", broker.tcp_hostport)
       .option("topic", topic).mode("append").save())
    record_property("sink_msgs_per_s", round(N / (time.monotonic() - started)))
    got = consume(broker, topic, N)
    assert sorted(got) == bodies("k")


def test_sink_task_fails_on_refusal_and_retries_elsewhere(
        spark: Any, broker: BrokerProcess,
        make_broker: Callable[..., BrokerProcess]) -> None:
    refusing = make_broker("--max-msg-size=8")       # every body below is 10 bytes
    topic = unique_name("sk_retry")
    df = spark.createDataFrame([(f"x-{i:08d}",) for i in range(300)], "body string")
    df = df.coalesce(1)
    # partition 0, attempt 0 -> the refusing broker; Spark's retry -> the next address
    (df.write.format("pybroker").option("nsqd", f"{refusing.tcp_hostport},"
                                                f"{broker.tcp_hostport}")
       .option("topic", topic).mode("append").save())
    assert sorted(consume(broker, topic, 300)) == [b"x-%08d" % i for i in range(300)]
    with pytest.raises(Exception, match="E_BAD_MESSAGE"):
        (df.write.format("pybroker").option("nsqd", refusing.tcp_hostport)
           .option("topic", topic).mode("append").save())


def test_stream_sink_copies_a_topic(spark: Any, big_broker: BrokerProcess,
                                    tmp_path: Path) -> None:
    """Topic to topic: the source finds its nsqd through lookupd, the sink MPUBs."""
    src, dst = unique_name("sk_src"), unique_name("sk_dst")
    sent = bodies("c", 5000)
    publish(big_broker, src, sent)
    with FakeLookupd() as lookupd:
        lookupd.add_producer(src, big_broker)
        df = (spark.readStream.format("pybroker").option("mode", "channel")
              .option("lookupd", lookupd.http_hostport)
              .option("topic", src).option("channel", "copy").option("max_in_flight", "4000")
              .option("checkpoint", str(tmp_path / "ck")).load())
        query = start_query(lambda: df.select("body").writeStream.format("pybroker")
                            .option("nsqd", big_broker.tcp_hostport).option("topic", dst)
                            .option("checkpointLocation", str(tmp_path / "ck"))
                            .trigger(availableNow=True).start())
        assert query.awaitTermination(120)
    assert query.exception() is None
    assert sorted(set(consume(big_broker, dst, 5000))) == sent
    wait_until(lambda: drained(big_broker, src, "copy"), 10, what="FINs")


def test_archive_reader_reads_to_file_output(spark: Any, broker: BrokerProcess,
                                             tmp_path: Path) -> None:
    topic = unique_name("sk_files")
    sent = bodies("f", 4000)
    publish(broker, topic, sent[:2000])
    write_archive(broker, topic, tmp_path, 2000, "--gzip")
    publish(broker, topic, sent[2000:])
    write_archive(broker, topic, tmp_path, 4000)       # a plain file beside the gzip one
    df = spark.read.format("pybroker").option("topic", topic).load(str(tmp_path))
    live = (spark.readStream.format("pybroker").option("mode", "channel")
            .option("nsqd", broker.tcp_hostport)
            .option("topic", topic).option("channel", "schema").load())
    assert df.schema == live.schema                   # the archive and the live topic
    rows = df.collect()
    assert sorted(bytes(r.body) for r in rows) == sent
    assert {r.topic for r in rows} == {topic}
    assert all(r.timestamp is not None and r.id is None for r in rows)
    assert df.rdd.getNumPartitions() == 2             # one task per file


def test_archive_command(spark: Any, big_broker: BrokerProcess, tmp_path: Path) -> None:
    """``spark archive`` in this process: it uses the running session and leaves it up."""
    from typer.testing import CliRunner

    from pybroker.spark.cli import make_app

    topic = unique_name("sk_cli")
    sent = [json.dumps({"user": f"u{i % 7}", "amount": i}).encode() for i in range(3000)]
    publish(big_broker, topic, sent)
    out = tmp_path / "lake"
    result = CliRunner().invoke(make_app(), [
        "archive", f"--topic={topic}", "--channel=cli", f"--output={out}", "--mode=channel",
        f"--nsqd-tcp-address={big_broker.tcp_hostport}", "--available-now",
        "--max-in-flight=4000", "--json-schema=user string, amount int"])
    assert result.exit_code == 0, result.output
    assert "archived 3000 messages" in result.output, result.output
    assert (out / "_checkpoint" / "commits").is_dir()
    assert list(out.glob("date=*/hour=*")), list(out.iterdir())
    lake = spark.read.parquet(str(out))
    assert {"user", "amount", "body", "date", "hour"} <= set(lake.columns)
    rows = lake.select("user", "amount").collect()
    assert sorted(r.amount for r in rows) == list(range(3000))
    assert {r.user for r in rows} == {f"u{i}" for i in range(7)}
    wait_until(lambda: drained(big_broker, topic, "cli"), 10, what="FINs")
    assert spark.range(3).count() == 3                # the session is still up


SLOW_FIRST_READER = """#!/bin/sh
# The first stream reader worker starts after Spark stopped waiting for it (10 s).
case "$*" in *python_streaming_source_runner*)
  if mkdir "$SLOW_MARK" 2>/dev/null; then sleep 12; fi;;
esac
exec "$REAL_PYTHON" "$@"
"""


def test_archive_command_starts_again_when_the_reader_worker_is_late(
        big_broker: BrokerProcess, tmp_path: Path) -> None:
    """Spark ends a query whose stream reader worker misses its 10 s: the command starts
    it again from the checkpoint, and everything is archived once."""
    topic = unique_name("sk_late")
    sent = bodies("l", 2000)
    publish(big_broker, topic, sent)
    python = tmp_path / "python"
    python.write_text(SLOW_FIRST_READER)
    python.chmod(0o755)
    env = {**os.environ, "PYSPARK_PYTHON": str(python), "REAL_PYTHON": sys.executable,
           "SLOW_MARK": str(tmp_path / "slowed")}
    out = tmp_path / "lake"
    proc = subprocess.run(
        [sys.executable, "-m", "pybroker.spark.cli", "archive", f"--topic={topic}",
         "--channel=late", f"--output={out}", "--mode=channel", "--master=local[2]",
         f"--nsqd-tcp-address={big_broker.tcp_hostport}", "--available-now",
         "--max-in-flight=4000", "--conf=spark.ui.enabled=false"],
        capture_output=True, text=True, timeout=200, check=False, env=env)
    assert (tmp_path / "slowed").is_dir(), "the first reader worker was not slowed"
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "query start 1 of 3 failed" in proc.stderr, proc.stderr[-3000:]
    assert "archived 2000 messages" in proc.stderr, proc.stderr[-3000:]
    wait_until(lambda: drained(big_broker, topic, "late"), 10, what="FINs")


def test_archive_command_usage_errors(tmp_path: Path) -> None:
    run = [sys.executable, "-m", "pybroker.spark.cli", "archive", "--topic=t",
           f"--output={tmp_path}"]
    proc = subprocess.run(run, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2 and "--nsqd-http-address" in proc.stderr
    proc = subprocess.run([*run, "--mode=channel"], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 2 and "--nsqd-tcp-address" in proc.stderr
    proc = subprocess.run([*run, "--nsqd-http-address=127.0.0.1:1",
                           "--starting-offsets=yesterday"], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 2 and "--starting-offsets" in proc.stderr
    proc = subprocess.run([*run, "--nsqd-tcp-address=127.0.0.1:1", "--format=csv"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2 and "--format" in proc.stderr
