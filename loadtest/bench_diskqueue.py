"""Bench DiskQueue appends under each sync policy, side by side (medians of 3 runs).

    python loadtest/bench_diskqueue.py [--seconds 1.0] [--size 200] [--dir /tmp]

Each run appends records of --size bytes to a fresh queue for about --seconds and
reports appends/s and fsyncs/s (fsyncs counted by the queue, meta writes included).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pybroker.storage import DiskQueue

Run = Callable[[DiskQueue, bytes, float], int]   # -> records appended


def _until(deadline: float) -> bool:
    return time.monotonic() < deadline


def no_sync_put(q: DiskQueue, rec: bytes, deadline: float) -> int:
    n = 0
    while _until(deadline):
        for _ in range(1000):
            q.put(rec)
        n += 1000
    return n


def no_sync_put_many(q: DiskQueue, rec: bytes, deadline: float) -> int:
    batch, n = [rec] * 200, 0
    while _until(deadline):
        q.put_many(batch)
        n += 200
    return n


def nsqd_policy(q: DiskQueue, rec: bytes, deadline: float) -> int:
    """nsqd's default: checkpoint every 2500 writes or 2 s (caller drives time)."""
    n = 0
    while _until(deadline):
        for _ in range(100):
            q.put(rec)
            q.maybe_sync(time.monotonic_ns())
        n += 100
    return n


def fsync_every_put(q: DiskQueue, rec: bytes, deadline: float) -> int:
    n = 0
    while _until(deadline):
        q.put(rec)
        q.sync()
        n += 1
    return n


def group_commit_batch(q: DiskQueue, rec: bytes, deadline: float) -> int:
    """Durable mode: 200 publishes gathered in one loop turn share one fsync."""
    batch, n = [rec] * 200, 0
    while _until(deadline):
        q.put_many(batch)
        q.sync()
        n += 200
    return n


def group_commit_threads(q: DiskQueue, rec: bytes, deadline: float) -> int:
    """Durable mode: 8 publisher threads each put then wait for sync; fsyncs shared."""
    counts = [0] * 8

    def publisher(i: int) -> None:
        while _until(deadline):
            q.sync(q.put(rec))
            counts[i] += 1

    threads = [threading.Thread(target=publisher, args=(i,), name=f"pub-{i}")
               for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts)


POLICIES: list[tuple[str, Run, dict[str, object]]] = [
    ("no fsync, put", no_sync_put, {}),
    ("no fsync, put_many(200)", no_sync_put_many, {}),
    ("nsqd 2500/2s, put", nsqd_policy, {"sync_every": 2500, "sync_timeout_s": 2.0}),
    ("fsync every put", fsync_every_put, {}),
    ("group commit put_many(200)+sync", group_commit_batch, {}),
    ("group commit 8 threads put+sync", group_commit_threads, {}),
]


def one_run(run: Run, kw: dict[str, object], rec: bytes, seconds: float,
            root: str) -> tuple[float, float]:
    with tempfile.TemporaryDirectory(dir=root, prefix="bench-dq-") as d:
        q = DiskQueue(d, "bench", max_bytes_per_file=64 * 1024 * 1024, **kw)  # type: ignore[arg-type]
        start = time.monotonic()
        n = run(q, rec, start + seconds)
        elapsed = time.monotonic() - start
        fsyncs = q.stats()["fsyncs"]
        q.delete()
    return n / elapsed, fsyncs / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--size", type=int, default=200)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    args = ap.parse_args()
    rec = os.urandom(args.size)
    print(f"DiskQueue bench: {args.size}-byte records, {args.seconds}s per run, "
          f"median of {args.runs}, dir {args.dir}")
    print(f"{'policy':<34} {'appends/s':>12} {'fsyncs/s':>10} {'appends/fsync':>14}")
    for name, run, kw in POLICIES:
        results = [one_run(run, kw, rec, args.seconds, args.dir) for _ in range(args.runs)]
        aps = statistics.median(r[0] for r in results)
        fps = statistics.median(r[1] for r in results)
        per = f"{aps / fps:,.0f}" if fps else "-"
        print(f"{name:<34} {aps:>12,.0f} {fps:>10,.1f} {per:>14}", flush=True)


if __name__ == "__main__":
    main()
