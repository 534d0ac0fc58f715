#!/usr/bin/env python3
"""/ping latency while clients look up times on a big segment (issue 22).

    python loadtest/bench_time_lookup.py [--size-mib 100] [--clients 8] [--seconds 5]
                                         [--runs 3] [--nsqd PATH] [--topics N]

One pybroker (and, when an nsqd binary is found, one nsqd beside it), each started here
on ephemeral ports with its own temporary data dir, stopped by PID. Each gets one topic
of ``--size-mib`` MiB (1 KiB messages, HTTP /mpub of 4 MiB each, one segment). Then,
per run, ``--clients`` keep-alive HTTP clients send requests without pause while one
more client sends ``GET /ping`` every 5 ms and times each answer:

- ``lookup`` (pybroker): ``GET /topic/offsets?ts=`` at times spread over the last tenth
  of the segment (the worst case for a scan: the answer is near its end);
- ``stats`` (both): ``GET /stats?format=json&topic=``, a plain HTTP load with no log
  read, for a baseline; nsqd has no lookup by time, so this is the side by side.
- ``all`` (both, with ``--topics N``): ``GET /stats?format=json`` with N more topics
  of a channel each: the largest document the HTTP server makes, side by side.

The table shows, per broker and load, the median over runs of /ping p50, p99 and max
(ms), of requests per second of the load, and of the broker's CPU (user+sys, from
/proc/PID/stat) per load request in microseconds.
"""
from __future__ import annotations

import argparse
import http.client
import json
import shutil
import statistics
import struct
import sys
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pybroker.bench.brokers import BrokerProcess, proc_cpu_s
from pybroker.config import split_hostport

MS = 1_000_000


def _conn(b: BrokerProcess) -> http.client.HTTPConnection:
    host, port = split_hostport(b.http_address)
    return http.client.HTTPConnection(host, port, timeout=60)


def _get(c: http.client.HTTPConnection, path: str, **q: Any) -> tuple[int, bytes]:
    c.request("GET", f"{path}?{urllib.parse.urlencode(q)}")
    r = c.getresponse()
    return r.status, r.read()


def fill(b: BrokerProcess, topic: str, size_mib: int) -> tuple[int, int]:
    """Publish about size_mib MiB; returns the first and last publish times (ns)."""
    c = _conn(b)
    body = b"\n".join(b"%07d" % i + b"y" * 1017 for i in range(4000))
    for _ in range(max(1, size_mib * 1024 * 1024 // len(body))):
        c.request("POST", f"/mpub?topic={topic}", body=body)
        r = c.getresponse()
        if r.status != 200:
            raise RuntimeError(f"{b.kind}: /mpub answered {r.status} {r.read()!r}")
        r.read()
        time.sleep(0.002)
    if b.kind != "pybroker":
        return 0, 0

    def ts_at(off: int) -> int:
        status, raw = _get(c, "/topic/read", topic=topic, offset=off, max_messages=1)
        return int(struct.unpack_from(">q", raw, 24)[0])

    status, raw = _get(c, "/topic/offsets", topic=topic)
    end = json.loads(raw)["end_offset"]
    return ts_at(0), ts_at(end - 1)


def make_topics(b: BrokerProcess, n: int) -> None:
    """n more topics, each with one channel (what a /stats of every topic reports)."""
    c = _conn(b)
    for i in range(n):
        for path in (f"/topic/create?topic=bench_tl_{i}",
                     f"/channel/create?topic=bench_tl_{i}&channel=ch"):
            c.request("POST", path, body=b"")
            r = c.getresponse()
            r.read()
            if r.status != 200:
                raise RuntimeError(f"{b.kind}: {path} answered {r.status}")


def one_run(b: BrokerProcess, topic: str, load: str, times: tuple[int, int],
            args: argparse.Namespace) -> dict[str, float]:
    stop = threading.Event()
    done = [0] * args.clients
    first, last = times
    span = max(1, last - first)

    def client(i: int) -> None:
        c = _conn(b)
        ts_ms = (last - span * (i + 1) // (10 * args.clients)) // MS
        while not stop.is_set():
            if load == "lookup":
                status, _ = _get(c, "/topic/offsets", topic=topic, ts=ts_ms)
            elif load == "stats":
                status, _ = _get(c, "/stats", format="json", topic=topic)
            else:       # "all": every topic's stats (--topics)
                status, _ = _get(c, "/stats", format="json")
            if status != 200:
                raise RuntimeError(f"{load}: {status}")
            done[i] += 1
        c.close()

    threads = [threading.Thread(target=client, args=(i,), daemon=True)
               for i in range(args.clients)]
    cpu0 = proc_cpu_s(b.pid) if b.pid else 0.0
    t0 = time.monotonic()
    for t in threads:
        t.start()
    ping = _conn(b)
    lat = []
    while time.monotonic() - t0 < args.seconds:
        p0 = time.perf_counter()
        _get(ping, "/ping")
        lat.append((time.perf_counter() - p0) * 1000)
        time.sleep(0.005)
    stop.set()
    for t in threads:
        t.join(60)
    elapsed = time.monotonic() - t0
    cpu = (proc_cpu_s(b.pid) if b.pid else 0.0) - cpu0
    lat.sort()
    n = sum(done)
    return {"p50": statistics.median(lat), "p99": lat[max(0, int(len(lat) * 0.99) - 1)],
            "max": lat[-1], "rate": n / elapsed, "cpu_us": cpu / max(1, n) * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=100)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--nsqd", default=shutil.which("nsqd") or "")
    ap.add_argument("--topics", type=int, default=0,
                    help="make this many more topics (a channel each) and add the load "
                         "'all': /stats of every topic, on both brokers")
    args = ap.parse_args()
    seg = f"--max-bytes-per-file={(args.size_mib + 16) * 1024 * 1024}"
    brokers = [BrokerProcess("pybroker", [seg, "--mem-queue-size=10000"]).start()]
    if args.nsqd:
        brokers.append(BrokerProcess("nsqd", [seg], nsqd_path=args.nsqd).start())
    rows: dict[tuple[str, str], list[dict[str, float]]] = {}
    try:
        times = {b.kind: fill(b, "bench_tl", args.size_mib) for b in brokers}
        for b in brokers:
            make_topics(b, args.topics)
        extra = ["all"] if args.topics else []
        for _ in range(args.runs):
            for b in brokers:
                for load in (["lookup", "stats"] if b.kind == "pybroker" else ["stats"]) + extra:
                    rows.setdefault((b.kind, load), []).append(
                        one_run(b, "bench_tl", load, times[b.kind], args))
    finally:
        for b in brokers:
            b.stop()
    print(f"{args.size_mib} MiB segment, {args.clients} clients, {args.seconds:.0f} s per "
          f"run, {args.runs} runs (medians)")
    print(f"{'broker':<9} {'load':<7} {'ping p50 ms':>11} {'p99 ms':>8} {'max ms':>8} "
          f"{'req/s':>9} {'CPU us/req':>11}")
    for (kind, load), runs in rows.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"{kind:<9} {load:<7} {med['p50']:>11.2f} {med['p99']:>8.2f} "
              f"{med['max']:>8.2f} {med['rate']:>9,.0f} {med['cpu_us']:>11.0f}")


if __name__ == "__main__":
    main()
