#!/usr/bin/env python3
"""What a broker's garbage collections cost its loops while it holds many deferred
messages: a single pybroker node is given ``--deferred`` messages, each delivered once
and requeued for an hour (the channel keeps them as deferred messages), while another
connection sends one PUB every 2 ms to an ephemeral topic and times each round trip.
Printed: the longest round trip while the deferred messages were made and for
``--after`` seconds of steady publishing after, and the longest garbage collection
/stats reports (``memory.gc_pause_usec_100``, the longest of the last 256).

    python loadtest/bench_gc.py [--deferred 1000000] [--runs 3] [--after 10]

Budget (docs/storage.md, "Deferred messages and the garbage collector"): no loop held
over 20 ms.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_durability import build_command  # noqa: E402
from bench_takeover import _answer, _connect, defer_all  # noqa: E402

from pybroker.bench.brokers import BrokerProcess  # noqa: E402

PING = "gc_ping#ephemeral"


def one_run(args: argparse.Namespace) -> tuple[float, float, float]:
    """(longest round trip while deferring, ms; after, ms; longest gc pause, ms)."""
    b = BrokerProcess("pybroker").start()
    try:
        worst = [0.0, 0.0]
        phase = [0]
        stop = threading.Event()

        def ping() -> None:
            with _connect(b.tcp_address) as s:
                cmd, _ = build_command("PUB", PING, 100, 1)
                while not stop.is_set():
                    t0 = time.perf_counter()
                    s.sendall(cmd)
                    assert _answer(s) == (0, b"OK")
                    k = phase[0]
                    worst[k] = max(worst[k], time.perf_counter() - t0)
                    stop.wait(0.002)

        t = threading.Thread(target=ping)
        t.start()
        try:
            defer_all(b.tcp_address, args.deferred)
            phase[0] = 1
            time.sleep(args.after)
        finally:
            stop.set()
            t.join(30)
        with urllib.request.urlopen(f"http://{b.http_address}/stats?format=json",
                                    timeout=30) as r:
            mem = json.load(r)["memory"]
        return 1000 * worst[0], 1000 * worst[1], mem["gc_pause_usec_100"] / 1000
    finally:
        b.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--deferred", type=int, default=1_000_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--after", type=float, default=10.0)
    args = ap.parse_args()
    during, after, pause = [], [], []
    for k in range(args.runs):
        d, a, p = one_run(args)
        during.append(d)
        after.append(a)
        pause.append(p)
        print(f"run {k + 1}: longest PUB round trip {d:.1f} ms while deferring, "
              f"{a:.1f} ms after; longest gc pause {p:.1f} ms", flush=True)
    print(f"{args.deferred:,} deferred, medians: round trip {statistics.median(during):.1f} ms "
          f"while deferring, {statistics.median(after):.1f} ms after; gc pause "
          f"{statistics.median(pause):.1f} ms")


if __name__ == "__main__":
    main()
