#!/usr/bin/env python3
"""How long a takeover holds the new leader's loop: a three-node cluster (replication
factor 3, min-insync 2, a real etcd) with a channel holding ``--deferred`` deferred
messages; the leader is killed with SIGKILL while each other node answers a stream of
PUBs to an ephemeral topic (never replicated: each is one trip through that node's
loop), and the longest of those round trips around the takeover is printed, with the
time the new leader took to build its channels (its log) and how many turns of the
surviving nodes' loops took over 20 ms meanwhile (their /metrics). A round trip also
waits for a core (three nodes and the pings share two), a turn only for its work.

    python loadtest/bench_takeover.py [--deferred 100000] [--runs 3]

Budget (docs/replication.md, "A new leader's channels"): no loop held over 20 ms.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import socket
import statistics
import struct
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_durability import build_command  # noqa: E402
from bench_replication import ClusterSetting, Etcd, wait  # noqa: E402

from pybroker.bench.brokers import BrokerProcess  # noqa: E402
from pybroker.config import split_hostport  # noqa: E402

TOPIC, PING = "takeover_t", "ping#ephemeral"


def _frame(s: socket.socket) -> tuple[int, bytes]:
    def exact(n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            got = s.recv(n - len(buf))
            if not got:
                raise ConnectionError("closed")
            buf += got
        return bytes(buf)
    size, = struct.unpack(">i", exact(4))
    body = exact(size)
    return struct.unpack(">i", body[:4])[0], body[4:]


def _answer(s: socket.socket) -> tuple[int, bytes]:
    """The next frame that is not a heartbeat (each answered with a NOP, as clients
    do: a run that lasts past the 30 s heartbeat interval gets one)."""
    while True:
        kind, data = _frame(s)
        if (kind, data) != (0, b"_heartbeat_"):
            return kind, data
        s.sendall(b"NOP\n")


def _connect(address: str) -> socket.socket:
    s = socket.create_connection(split_hostport(address), timeout=30)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.sendall(b"  V2")
    return s


def publish_and_subscribe(s: socket.socket, n: int, rdy: int) -> None:
    """On connection s: n messages of 20 bytes published to TOPIC (MPUBs of 1,000),
    then a SUB to its channel "ch" with RDY rdy."""
    mpub, per = build_command("MPUB", TOPIC, 20, 1000)
    for _ in range(0, n, per):
        s.sendall(mpub)
        assert _frame(s) == (0, b"OK")
    s.sendall(f"SUB {TOPIC} ch\n".encode())
    assert _frame(s) == (0, b"OK")
    s.sendall(f"RDY {rdy}\n".encode())


def defer_all(address: str, n: int) -> None:
    """n messages published, delivered once and requeued for an hour each."""
    with _connect(address) as s:
        publish_and_subscribe(s, n, 2500)
        got = 0
        while got < n:
            kind, data = _frame(s)
            if kind == 2:
                s.sendall(b"REQ " + data[10:26] + b" 3600000\n")
                got += 1


def turns_over_budget(b: BrokerProcess) -> int:
    """How many turns of b's loops (not its HTTP server's) took over 20 ms so far
    (/metrics: ``pybroker_loop_turn_seconds``)."""
    with urllib.request.urlopen(f"http://{b.http_address}/metrics", timeout=10) as r:
        text = r.read().decode()
    over = 0
    for m in re.finditer(r'^pybroker_loop_turn_seconds_(count|bucket)\{loop="([^"]+)"'
                         r'(?:,le="([^"]+)")?\} (\S+)$', text, re.M):
        kind, loop, le, value = m.groups()
        if loop == "http":
            continue
        if kind == "count":
            over += int(float(value))
        elif le == "0.02":
            over -= int(float(value))
    return over


@contextlib.contextmanager
def led_topic(etcd_path: str) -> Iterator[tuple[ClusterSetting, BrokerProcess, int]]:
    """A real etcd and three nodes (replication factor 3, min-insync 2, memory, lease
    3 s) with TOPIC and its channel created: (the cluster, TOPIC's leader, its id).
    Everything is stopped after."""
    etcd = Etcd(shutil.which(etcd_path) or etcd_path)
    try:
        cs = ClusterSetting(etcd, argparse.Namespace(lease_ttl="3s", durability="memory"),
                            {i: dict(os.environ) for i in (1, 2, 3)})
        try:
            leader = cs.new_topic(TOPIC)
            yield cs, leader, next(i for i, b in cs.nodes.items() if b is leader)
        finally:
            cs.stop()
    finally:
        etcd.stop()


def one_run(args: argparse.Namespace) -> tuple[float, float, int]:
    """(the longest PUB round trip on a surviving node, ms; the build time, ms)."""
    with led_topic(args.etcd) as (cs, leader, lead):
        defer_all(leader.tcp_address, args.deferred)
        # the followers hold a version of the states made after every deferral
        v0 = (cs.replication(lead, TOPIC) or {}).get("channel_states", 0)
        v1 = wait(lambda: (v := (cs.replication(lead, TOPIC) or {})
                           .get("channel_states", 0)) > v0 and v, 30, "a new version")
        wait(lambda: all((cs.replication(i, TOPIC) or {}).get("channel_states", 0) >= v1
                         for i in cs.nodes if i != lead), 30, "the states shipped")
        stop = threading.Event()
        worst: dict[int, float] = {}

        def ping(i: int) -> None:
            with _connect(cs.nodes[i].tcp_address) as s:
                cmd, _ = build_command("PUB", PING, 1, 1)
                while not stop.is_set():
                    t0 = time.perf_counter()
                    s.sendall(cmd)
                    assert _answer(s) == (0, b"OK")
                    worst[i] = max(worst.get(i, 0.0), time.perf_counter() - t0)
                    stop.wait(0.002)

        others = [i for i in cs.nodes if i != lead]
        threads = [threading.Thread(target=ping, args=(i,)) for i in others]
        for t in threads:
            t.start()
        over = {i: turns_over_budget(cs.nodes[i]) for i in others}
        assert leader.pid is not None
        os.kill(leader.pid, signal.SIGKILL)
        new = wait(lambda: cs.leader(TOPIC, 2), 30, "a new leader")
        b = cs.nodes[new]
        built = wait(lambda: re.search(r"channels built in (\d+) ms|channels taken over",
                                       b.log_text()), 30, "the channels taken over")
        time.sleep(1)
        stop.set()
        for t in threads:
            t.join(10)
        ms = float(built.group(1)) if built.group(1) else 0.0
        held = sum(turns_over_budget(cs.nodes[i]) - over[i] for i in others)
        return 1000 * max(worst.values()), ms, held


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--deferred", type=int, default=100_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--etcd", default=os.environ.get("ETCD", "etcd"))
    args = ap.parse_args()
    worst, built, held = [], [], []
    for k in range(args.runs):
        w, b, h = one_run(args)
        worst.append(w)
        built.append(b)
        held.append(h)
        print(f"run {k + 1}: longest PUB round trip on a surviving node {w:.1f} ms; "
              f"channels built in {b:.0f} ms; loop turns over 20 ms meanwhile: {h}",
              flush=True)
    print(f"{args.deferred:,} deferred: longest round trip median {statistics.median(worst):.1f}"
          f" ms (max {max(worst):.1f}); build median {statistics.median(built):.0f} ms; "
          f"loop turns over 20 ms {sum(held)} in all")


if __name__ == "__main__":
    main()
