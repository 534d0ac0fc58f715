#!/usr/bin/env python3
"""The topic log against nsqd, side by side in one run, with nsq's own bench programs.

    python loadtest/bench_topic_log.py [--runs 3] [--seconds 4] [--size 200]
                                       [--only SCENARIO ...] [--nsqd PATH]

Scenarios (each run of each alternates pybroker and nsqd, every broker freshly started on
ephemeral loopback ports with its own temporary data dir and ``--mem-queue-size=1000000``,
stopped by PID):

- ``backlog``: ``bench_writer`` for ``--seconds``, then ``bench_reader`` (its SUB creates
  the channel, so it reads the whole backlog): publish and consume msgs/s.
- ``precreated``: the same with the channel created before publishing.
- ``together``: channel created first, writer and reader at the same time.
- ``fanout``: MPUB publish throughput to a topic with 1, 4 and 16 channels (no consumer).
- ``stall``: 1,000,000 messages queued; a probe client PUBs to another topic in a loop
  while a new channel is SUBscribed on the big topic: the longest probe round trip.
- ``memory``: RSS with 1,000,000 queued 100-byte messages (minus RSS before publishing).

Prints one table per scenario: medians over ``--runs`` (min-max) and pybroker/nsqd ratios.
Needs ``bench_writer`` and ``bench_reader`` (nsq's bench programs) and ``nsqd`` on PATH.
"""
from __future__ import annotations

import argparse
import re
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pybroker.bench.brokers import BrokerProcess, proc_status_kb  # noqa: E402
from pybroker.config import split_hostport  # noqa: E402

OPS_RE = re.compile(r"([0-9.]+)ops/s")
OK = struct.pack(">ii", 6, 0) + b"OK"



def _run_tool(args: list[str], timeout_s: float) -> float:
    out = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s)
    m = OPS_RE.search(out.stderr + out.stdout)
    if out.returncode != 0 or m is None:
        raise RuntimeError(f"{args[0]} failed ({out.returncode}): {out.stderr[-2000:]}")
    return float(m.group(1))


def writer(b: BrokerProcess, topic: str, seconds: float, size: int) -> float:
    return _run_tool(["bench_writer", f"--nsqd-tcp-address={b.tcp_address}", f"--topic={topic}",
                      f"--runfor={seconds}s", f"--size={size}"], seconds + 120)


def reader(b: BrokerProcess, topic: str, seconds: float, size: int) -> float:
    return _run_tool(["bench_reader", f"--nsqd-tcp-address={b.tcp_address}", f"--topic={topic}",
                      "--channel=ch", f"--runfor={seconds}s", f"--size={size}"], seconds + 120)


def http_post(b: BrokerProcess, path: str) -> None:
    req = urllib.request.Request(f"http://{b.http_address}{path}", data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=60):
        pass


def create_channel(b: BrokerProcess, topic: str, channel: str) -> None:
    http_post(b, f"/topic/create?topic={topic}")
    http_post(b, f"/channel/create?topic={topic}&channel={channel}")


class Wire:
    """A raw V2 connection for the stall probe and MPUB loads."""

    def __init__(self, addr: str) -> None:
        self.sock = socket.create_connection(split_hostport(addr), timeout=60)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.sendall(b"  V2")

    def call(self, data: bytes) -> bytes:
        self.sock.sendall(data)
        head = self._exact(8)
        size, _ = struct.unpack(">ii", head)
        return self._exact(size - 4)

    def _exact(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("closed")
            buf += chunk
        return buf

    def close(self) -> None:
        self.sock.close()


def mpub_cmd(topic: str, bodies: list[bytes]) -> bytes:
    payload = struct.pack(">i", len(bodies)) + b"".join(struct.pack(">i", len(x)) + x
                                                        for x in bodies)
    return f"MPUB {topic}\n".encode() + struct.pack(">i", len(payload)) + payload


def fill(b: BrokerProcess, topic: str, n: int, size: int, conns: int = 2) -> float:
    """MPUB n messages over conns connections; returns msgs/s."""
    per = n // conns
    cmd = mpub_cmd(topic, [b"x" * size] * 200)

    def work() -> None:
        w = Wire(b.tcp_address)
        for _ in range(per // 200):
            w.call(cmd)
        w.close()

    t0 = time.perf_counter()
    ths = [threading.Thread(target=work) for _ in range(conns)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    return (per // 200) * 200 * conns / (time.perf_counter() - t0)


def scenario_backlog(b: BrokerProcess, a: argparse.Namespace, pre: bool) -> dict[str, float]:
    topic = "bench_log"
    if pre:
        create_channel(b, topic, "ch")
    pub = writer(b, topic, a.seconds, a.size)
    sub = reader(b, topic, a.seconds, a.size)
    return {"publish msg/s": pub, "consume msg/s": sub}


def scenario_together(b: BrokerProcess, a: argparse.Namespace) -> dict[str, float]:
    topic = "bench_log"
    create_channel(b, topic, "ch")
    res: dict[str, float] = {}
    th = threading.Thread(target=lambda: res.__setitem__("r", reader(b, topic, a.seconds, a.size)))
    th.start()
    res["w"] = writer(b, topic, a.seconds, a.size)
    th.join()
    return {"publish msg/s": res["w"], "consume msg/s": res["r"]}


def scenario_fanout(b: BrokerProcess, a: argparse.Namespace) -> dict[str, float]:
    out = {}
    for n in (1, 4, 16):
        topic = f"fan{n}"
        for i in range(n):
            create_channel(b, topic, f"c{i}")
        out[f"{n} ch msg/s"] = fill(b, topic, 400_000, a.size)
    out["16/1"] = out["16 ch msg/s"] / out["1 ch msg/s"]
    return out


def scenario_stall(b: BrokerProcess, a: argparse.Namespace) -> dict[str, float]:
    fill(b, "big", 1_000_000, a.size)
    rtts: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        w = Wire(b.tcp_address)
        cmd = b"PUB other\n" + struct.pack(">i", 5) + b"probe"
        while not stop.is_set():
            t0 = time.perf_counter()
            w.call(cmd)
            rtts.append(time.perf_counter() - t0)
        w.close()

    th = threading.Thread(target=probe)
    th.start()
    time.sleep(0.5)
    before = len(rtts)
    base = max(rtts[:before]) if before else 0.0
    c = Wire(b.tcp_address)
    c.call(b"SUB big new\n")
    c.sock.sendall(b"RDY 100\n")
    c._exact(8)
    time.sleep(1.0)
    stop.set()
    th.join()
    c.close()
    return {"max rtt ms during SUB": max(rtts[before:]) * 1e3, "max rtt ms before": base * 1e3}


def scenario_memory(b: BrokerProcess, a: argparse.Namespace) -> dict[str, float]:
    assert b.pid is not None
    time.sleep(0.5)
    rss0 = proc_status_kb(b.pid, "VmRSS")
    create_channel(b, "mem", "ch")
    fill(b, "mem", 1_000_000, 100)
    time.sleep(1.0)
    rss1 = proc_status_kb(b.pid, "VmRSS")
    # proc_status_kb gives bytes (the kB figure of /proc/PID/status, times 1024)
    return {"RSS growth MiB": (rss1 - rss0) / 2**20, "B/msg": (rss1 - rss0) / 1_000_000}


SCENARIOS = {
    "backlog": lambda b, a: scenario_backlog(b, a, pre=False),
    "precreated": lambda b, a: scenario_backlog(b, a, pre=True),
    "together": scenario_together,
    "fanout": scenario_fanout,
    "stall": scenario_stall,
    "memory": scenario_memory,
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--size", type=int, default=200)
    p.add_argument("--only", nargs="*", default=list(SCENARIOS), choices=list(SCENARIOS))
    p.add_argument("--nsqd", default=shutil.which("nsqd"))
    p.add_argument("--pybroker-arg", action="append", default=[])
    a = p.parse_args()
    for tool in ("bench_writer", "bench_reader"):
        if shutil.which(tool) is None:
            print(f"{tool} not found on PATH (build nsq's bench/{tool})", file=sys.stderr)
            return 2
    kinds = ["pybroker"] + (["nsqd"] if a.nsqd else [])
    for name in a.only:
        results: dict[str, dict[str, list[float]]] = {k: {} for k in kinds}
        for run in range(a.runs):
            for kind in kinds:
                extra = ["--mem-queue-size=1000000"]
                if kind == "pybroker":
                    extra += a.pybroker_arg
                b = BrokerProcess(kind, extra, nsqd_path=a.nsqd).start()
                try:
                    got = SCENARIOS[name](b, a)
                finally:
                    b.stop()
                for k, v in got.items():
                    results[kind].setdefault(k, []).append(v)
                print(f"  {name} run {run + 1} {kind}: "
                      + ", ".join(f"{k} {v:,.1f}" for k, v in got.items()), flush=True)
        print(f"\n== {name} (median of {a.runs}, min-max)")
        for key in results["pybroker"]:
            row = []
            for kind in kinds:
                vals = results[kind].get(key, [])
                if vals:
                    row.append(f"{kind} {statistics.median(vals):,.1f} "
                               f"({min(vals):,.1f}-{max(vals):,.1f})")
            ratio = ""
            if "nsqd" in results and results["nsqd"].get(key):
                nv = statistics.median(results["nsqd"][key])
                if nv:
                    ratio = f"  ratio {statistics.median(results['pybroker'][key]) / nv:.2f}x"
            print(f"  {key:24s} " + " | ".join(row) + ratio)
        print(flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
