"""Bench the PySpark integration: messages/s through the streaming source and the sink.

    python loadtest/bench_spark.py [--messages 100000] [--size 100] [--master local[2]]
                                   [--max-in-flight 10000] [--json results.json]

Starts a pybroker (``--max-rdy-count`` raised to --max-in-flight) and a local Spark.
After a warm-up run of each, it measures:

* source -> noop: a preloaded topic drained by an available-now query into Spark's
  ``noop`` sink (the source alone: planning, partitions, FIN on commit);
* source -> parquet: the same into Parquet partitioned by date/hour (the archive
  pipeline, ``pybroker spark archive --available-now``);
* sink: a cached DataFrame of --messages rows MPUB'd by ``df.write.format("pybroker")``.

Each figure is messages / wall-clock seconds of the whole query or job, start to end.
"""
from __future__ import annotations

import argparse
import json
import os
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


def run_source(spark: Any, b: BrokerProcess, n: int, size: int, fmt: str,
               max_in_flight: int, tag: str) -> float:
    topic = f"bench_{tag}_{fmt}_{int(time.time() * 1000) % 10**8}"
    preload(b.tcp_hostport, topic, n, size)
    with tempfile.TemporaryDirectory(prefix="bench-spark-") as d:
        job = ArchiveJob(topic=topic, channel="bench", output=os.path.join(d, "out"),
                         nsqd=[b.tcp_hostport], available_now=True,
                         max_in_flight=max_in_flight, drain_timeout="500ms")
        started = time.monotonic()
        if fmt == "noop":
            df = spark.readStream.format("pybroker")
            for key, value in job.source_options().items():
                df = df.option(key, value)
            query = (df.load().writeStream.format("noop")
                     .option("checkpointLocation", job.checkpoint_dir)
                     .trigger(availableNow=True).start())
        else:
            query = start_archive(spark, job)
        query.awaitTermination()
        took = time.monotonic() - started
        if query.exception() is not None:
            raise RuntimeError(str(query.exception()))
        rows = sum(int(p["numInputRows"]) for p in query.recentProgress)
    if rows < n:
        raise RuntimeError(f"source bench read {rows} of {n} messages")
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
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--messages", type=int, default=100_000)
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--max-in-flight", type=int, default=10_000)
    ap.add_argument("--json", default="")
    args = ap.parse_args()

    broker = BrokerProcess("pybroker", [f"--max-rdy-count={args.max_in_flight}",
                                        "--mem-queue-size=1000000"]).start()
    spark = spark_session(args.master, "pybroker-bench", {
        "spark.ui.enabled": "false", "spark.sql.shuffle.partitions": "2"})
    spark.sparkContext.setLogLevel("ERROR")
    results: dict[str, Any] = {"messages": args.messages, "size": args.size,
                               "master": args.master, "max_in_flight": args.max_in_flight,
                               "cpus": os.cpu_count()}
    try:
        warm = min(args.messages, 10_000)
        for fmt in ("noop", "parquet"):
            run_source(spark, broker, warm, args.size, fmt, args.max_in_flight, "warm")
            rate = run_source(spark, broker, args.messages, args.size, fmt,
                              args.max_in_flight, "run")
            results[f"source_{fmt}_msgs_s"] = round(rate)
            print(f"source -> {fmt:8s} {rate:10,.0f} msg/s", flush=True)
        run_sink(spark, broker, warm, args.size, "warm")
        rate = run_sink(spark, broker, args.messages, args.size, "run")
        results["sink_msgs_s"] = round(rate)
        print(f"sink (MPUB)        {rate:10,.0f} msg/s", flush=True)
    finally:
        spark.stop()
        broker.stop()
        broker.cleanup()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
