#!/usr/bin/env python3
"""What max_attempts costs on the redelivery path: deliveries per second of a consumer
that REQs every message until it has been delivered ``--attempts`` times.

    python loadtest/bench_dead_letters.py [--messages 5000] [--attempts 5] [--runs 3]
                                          [--rdy 200] [--fsync] [--nsqd PATH]

Settings, each a broker started here (ephemeral ports, its own temporary data dir,
stopped by PID):

- ``unlimited``: ``max_attempts = 0`` (nsqd's behaviour); the consumer FINs a message
  when it arrives with ``attempts == --attempts`` and REQs it before;
- ``dead-letter``: ``max_attempts = --attempts``; the consumer REQs everything, and the
  broker dead-letters each message instead of its (attempts+1)-th delivery.
- ``nsqd`` (with ``--nsqd PATH``, and without ``--fsync``, which nsqd does not have):
  a real nsqd beside them, as ``unlimited``: the same redelivery path measured against
  nsqd's.

Both see the same deliveries (messages x attempts); the dead-letter setting also
publishes one envelope per message to ``<topic>.dead`` (and syncs it with ``--fsync``).
A run ends when every message is finished on its channel (/stats: depth, in flight and
pending dead letters all 0). Runs are interleaved; the table shows the median (and
min-max) of deliveries per second.
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import struct
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pybroker.bench.brokers import BrokerProcess
from pybroker.bench.wire import mpub_cmd
from pybroker.config import split_hostport as _split


def publish(addr: str, topic: str, n: int) -> None:
    s = socket.create_connection(_split(addr), timeout=30)
    s.sendall(b"  V2")
    batch = 1000
    for i in range(0, n, batch):
        bodies = [b"msg-%d" % k for k in range(i, min(n, i + batch))]
        s.sendall(mpub_cmd(topic, bodies))
        got = b""
        while len(got) < 10:
            chunk = s.recv(10 - len(got))
            if not chunk:
                raise ConnectionError("closed")
            got += chunk
        if got[8:] != b"OK":
            raise RuntimeError(f"MPUB answered {got!r}")
    s.close()


def consume(addr: str, topic: str, attempts: int, fin_at: bool, rdy: int,
            stop: threading.Event, counts: list[int]) -> None:
    """REQ every message (FIN at ``attempts`` if fin_at); counts[0] += deliveries."""
    s = socket.create_connection(_split(addr), timeout=30)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.sendall(b"  V2" + f"SUB {topic} ch\nRDY {rdy}\n".encode())
    s.settimeout(0.2)
    buf = b""
    while not stop.is_set():
        try:
            chunk = s.recv(1 << 16)
        except TimeoutError:
            continue
        if not chunk:
            break
        buf += chunk
        out = []
        pos = 0
        while len(buf) - pos >= 8:
            size, kind = struct.unpack_from(">ii", buf, pos)
            if len(buf) - pos < 4 + size:
                break
            frame = buf[pos + 8:pos + 4 + size]
            pos += 4 + size
            if kind == 2:
                n = struct.unpack_from(">H", frame, 8)[0]
                mid = frame[10:26]
                counts[0] += 1
                out.append(b"FIN " + mid + b"\n" if fin_at and n >= attempts
                           else b"REQ " + mid + b" 0\n")
            elif kind == 0 and frame == b"_heartbeat_":
                out.append(b"NOP\n")
        buf = buf[pos:]
        if out:
            s.sendall(b"".join(out))
    s.close()


def _stats(b: BrokerProcess, topic: str) -> dict[str, int]:
    url = f"http://{b.http_address}/stats?format=json&topic={topic}"
    with urllib.request.urlopen(url, timeout=10) as r:
        d = json.loads(r.read())
    for t in d["topics"]:
        if t["topic_name"] == topic:
            for c in t["channels"]:
                if c["channel_name"] == "ch":
                    return dict(c)
    return {}


def one_run(b: BrokerProcess, name: str, run: int, args: argparse.Namespace) -> float:
    topic = f"bench_dl_{name.replace('-', '_')}_{run}"
    counts = [0]
    stop = threading.Event()
    # the channel first, so it gets every message
    req = urllib.request.Request(f"http://{b.http_address}/topic/create?topic={topic}",
                                 data=b"", method="POST")
    urllib.request.urlopen(req, timeout=10).read()
    req = urllib.request.Request(
        f"http://{b.http_address}/channel/create?topic={topic}&channel=ch", data=b"",
        method="POST")
    urllib.request.urlopen(req, timeout=10).read()
    publish(b.tcp_address, topic, args.messages)
    t = threading.Thread(target=consume, args=(b.tcp_address, topic, args.attempts,
                                               name != "dead-letter", args.rdy, stop, counts),
                         daemon=True)
    t0 = time.monotonic()
    t.start()
    deadline = t0 + 300
    while time.monotonic() < deadline:
        st = _stats(b, topic)
        if st and st["depth"] == 0 and st["in_flight_count"] == 0 and \
                st.get("dead_letter_pending", 0) == 0 and counts[0] >= args.messages:
            break
        time.sleep(0.02)
    elapsed = time.monotonic() - t0
    stop.set()
    t.join(5)
    expected = args.messages * args.attempts
    if counts[0] != expected:
        print(f"  note: {name} run {run}: {counts[0]} deliveries, expected {expected}")
    return counts[0] / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--messages", type=int, default=5000)
    ap.add_argument("--attempts", type=int, default=5)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rdy", type=int, default=200)
    ap.add_argument("--fsync", action="store_true", help="--durability=fsync")
    ap.add_argument("--nsqd", default="", help="an nsqd binary: its unlimited setting beside")
    args = ap.parse_args()
    if args.nsqd and args.fsync:
        ap.error("--nsqd: nsqd has no fsync durability to compare with --fsync")
    common = ["--durability=fsync"] if args.fsync else []
    settings = {"unlimited": common,
                "dead-letter": common + [f"--max-attempts={args.attempts}"]}
    brokers = {name: BrokerProcess("pybroker", flags).start()
               for name, flags in settings.items()}
    if args.nsqd:
        settings["nsqd"] = []
        brokers["nsqd"] = BrokerProcess("nsqd", [], nsqd_path=args.nsqd).start()
    results: dict[str, list[float]] = {name: [] for name in settings}
    try:
        for run in range(args.runs):
            for name, b in brokers.items():
                results[name].append(one_run(b, name, run, args))
    finally:
        for b in brokers.values():
            b.stop()
    print(f"{args.messages} messages x {args.attempts} deliveries, RDY {args.rdy}, "
          f"durability={'fsync' if args.fsync else 'memory'}, {args.runs} runs")
    print(f"{'setting':<12} {'deliveries/s (median)':>22} {'min-max':>20}")
    for name, rates in results.items():
        print(f"{name:<12} {statistics.median(rates):>22,.0f} "
              f"{min(rates):>9,.0f}-{max(rates):<10,.0f}")
    if "nsqd" in results:
        ratios = [u / n for u, n in zip(results["unlimited"], results["nsqd"])]
        print(f"unlimited/nsqd: {statistics.median(ratios):.2f}x (median of the runs' ratios)")


if __name__ == "__main__":
    main()
