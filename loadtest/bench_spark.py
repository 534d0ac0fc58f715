"""Bench the PySpark integration: messages/s from a topic into Parquet, and the sink.

    python loadtest/bench_spark.py [--messages 1000000] [--size 200] [--master local[2]]
                                   [--partitions 1,2,4] [--runs 3] [--channel-messages 0]
                                   [--json results.json]

Starts a pybroker and a local Spark, fills one topic with --messages messages of --size
bytes, then measures (medians of --runs, after one warm-up run):

* log source -> parquet, for each --partitions count: an available-now query of the
  partitioned source (mode log: offset ranges read by the executors) writing the whole
  topic into Parquet partitioned by date/hour (``pybroker spark archive``'s pipeline),
  each run with a new checkpoint and output;
* channel source -> parquet (only with --channel-messages N): the FIN-after-commit source
  on N messages, for comparison;
* sink: a cached DataFrame of --messages rows MPUB'd by ``df.write.format("pybroker")``.

Each figure is messages / wall-clock seconds of the whole query or job, start to end.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pybroker.client import Producer
from pybroker.spark.pipeline import ArchiveJob, spark_session, start_archive
from tests.support.broker import BrokerProcess


def preload(address: str, topic: str, n: int, size: int) -> None:
    pad = b"x" * max(0, size - 8)
    with Producer(address) as p:
        futs = []
        for i in range(0, n, 1000):
            futs.append(p.multi_publish_async(
                topic, [b"%08d" % j + pad for j in range(i, min(n, i + 1000))]))
            if len(futs) >= 8:
                futs.pop(0).result(30)
        for f in futs:
            f.result(30)


def topic_count(b: BrokerProcess, topic: str) -> int:
    url = f"http://{b.http_hostport}/stats?format=json&topic={topic}"
    with urllib.request.urlopen(url, timeout=5) as resp:
        stats = json.loads(resp.read())
    return sum(t["message_count"] for t in stats["topics"] if t["topic_name"] == topic)


def run_log_source(spark: Any, b: BrokerProcess, topic: str, n: int,
                   partitions: int) -> float:
    with tempfile.TemporaryDirectory(prefix="bench-spark-") as d:
        job = ArchiveJob(topic=topic, channel=f"bench{partitions}",
                         output=os.path.join(d, "out"), mode="log",
                         nsqd_http=b.http_hostport, available_now=True,
                         num_partitions=partitions)
        started = time.monotonic()
        query = start_archive(spark, job)
        query.awaitTermination()
        took = time.monotonic() - started
        if query.exception() is not None:
            raise RuntimeError(str(query.exception()))
        rows = sum(int(p["numInputRows"]) for p in query.recentProgress)
    if rows != n:
        raise RuntimeError(f"log source bench read {rows} of {n} messages")
    return n / took


def run_channel_source(spark: Any, b: BrokerProcess, n: int, size: int) -> float:
    topic = f"bench_chan_{int(time.time() * 1000) % 10**8}"
    preload(b.tcp_hostport, topic, n, size)
    with tempfile.TemporaryDirectory(prefix="bench-spark-") as d:
        job = ArchiveJob(topic=topic, channel="bench", output=os.path.join(d, "out"),
                         mode="channel", nsqd=[b.tcp_hostport], available_now=True,
                         max_in_flight=10_000, drain_timeout="500ms")
        started = time.monotonic()
        query = start_archive(spark, job)
        query.awaitTermination()
        took = time.monotonic() - started
        if query.exception() is not None:
            raise RuntimeError(str(query.exception()))
        rows = sum(int(p["numInputRows"]) for p in query.recentProgress)
    if rows < n:
        raise RuntimeError(f"channel source bench read {rows} of {n} messages")
    return n / took


def run_sink(spark: Any, b: BrokerProcess, n: int, size: int, tag: str) -> float:
    from pyspark.sql import functions as F

    topic = f"bench_{tag}_sink_{int(time.time() * 1000) % 10**8}"
    df = spark.range(n, numPartitions=4).select(
        F.rpad(F.format_string("%08d", "id"), size, "x").cast("binary").alias("body"))
    df = df.cache()
    df.count()
    started = time.monotonic()
    df.write.format("pybroker").option("nsqd", b.tcp_hostport).option("topic", topic) \
        .mode("append").save()
    took = time.monotonic() - started
    df.unpersist()
    if topic_count(b, topic) != n:
        raise RuntimeError("the sink bench lost messages")
    return n / took


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--messages", type=int, default=1_000_000)
    ap.add_argument("--size", type=int, default=200)
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--partitions", default="1,2,4")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--channel-messages", type=int, default=0)
    ap.add_argument("--json", default="")
    args = ap.parse_args()

    # retention keeps the topic after each run's channel has consumed it, for the next run
    broker = BrokerProcess("pybroker", ["--max-rdy-count=10000",
                                        "--retention-time=24h"]).start()
    spark = spark_session(args.master, "pybroker-bench", {
        "spark.ui.enabled": "false", "spark.sql.shuffle.partitions": "2"})
    spark.sparkContext.setLogLevel("ERROR")
    results: dict[str, Any] = {"messages": args.messages, "size": args.size,
                               "master": args.master, "runs": args.runs,
                               "cpus": os.cpu_count()}
    try:
        topic = f"bench_log_{int(time.time() * 1000) % 10**8}"
        started = time.monotonic()
        preload(broker.tcp_hostport, topic, args.messages, args.size)
        print(f"filled {topic} with {args.messages:,} x {args.size} B in "
              f"{time.monotonic() - started:.1f}s", flush=True)
        run_log_source(spark, broker, topic, args.messages, 2)     # warm-up
        for parts in (int(p) for p in args.partitions.split(",")):
            rates = [run_log_source(spark, broker, topic, args.messages, parts)
                     for _ in range(args.runs)]
            rate = statistics.median(rates)
            results[f"log_source_parquet_{parts}p_msgs_s"] = round(rate)
            print(f"log source -> parquet, {parts} partition(s): {rate:10,.0f} msg/s "
                  f"(runs: {', '.join(f'{r:,.0f}' for r in rates)})", flush=True)
        if args.channel_messages:
            rate = run_channel_source(spark, broker, args.channel_messages, args.size)
            results["channel_source_parquet_msgs_s"] = round(rate)
            print(f"channel source -> parquet ({args.channel_messages:,} msgs): "
                  f"{rate:10,.0f} msg/s", flush=True)
        run_sink(spark, broker, min(args.messages, 10_000), args.size, "warm")
        rates = [run_sink(spark, broker, args.messages, args.size, "run")
                 for _ in range(args.runs)]
        rate = statistics.median(rates)
        results["sink_msgs_s"] = round(rate)
        print(f"sink (df.write MPUB):                  {rate:10,.0f} msg/s "
              f"(runs: {', '.join(f'{r:,.0f}' for r in rates)})", flush=True)
    finally:
        spark.stop()
        broker.stop()
        broker.cleanup()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
