#!/usr/bin/env python3
"""What durability costs: publish throughput and fsyncs per second for pybroker with
``--durability=memory`` and ``--durability=fsync`` (and nsqd as a reference), side by
side in one run.

    python loadtest/bench_durability.py [--seconds 3] [--runs 3] [--connections 4]
                                        [--batch 100] [--size 200] [--depth 1]
                                        [--nsqd PATH | --no-nsqd]

Each setting is a broker started here (ephemeral ports, its own temporary data dir,
stopped by PID). Every run publishes to a fresh durable topic that has one channel and
no consumer, so everything published is kept (memory up to mem_queue_size, then disk)
and, in fsync mode, written and synced before each OK. Scenarios: MPUB batches and
single PUBs, over ``--connections`` raw sockets (one thread each, ``--depth`` commands in
flight). Runs of the settings are interleaved; the table shows the median of
``--runs`` runs (and min-max) of messages/s, fsync+fdatasync calls per second counted
in the kernel with ``perf stat`` on the broker's PID (``strace -c`` when perf is
missing; it slows the broker down, so its throughput is then marked), messages per
fsync, and broker CPU ms per 1000 messages.
"""
from __future__ import annotations

import argparse
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pybroker.bench.brokers import BrokerProcess
from pybroker.config import split_hostport

OK_FRAME = struct.pack(">ii", 6, 0) + b"OK"


def _sized(b: bytes) -> bytes:
    return struct.pack(">i", len(b)) + b


def build_command(kind: str, topic: str, size: int, batch: int) -> tuple[bytes, int]:
    """(command bytes, messages per command) for "PUB" or "MPUB"."""
    body = (b"d" * (size - 1) + b"x")[:size]
    if kind == "PUB":
        return f"PUB {topic}\n".encode() + _sized(body), 1
    payload = struct.pack(">i", batch) + _sized(body) * batch
    return f"MPUB {topic}\n".encode() + _sized(payload), batch



def _http(b: BrokerProcess, path: str) -> None:
    req = urllib.request.Request(f"http://{b.http_address}{path}", data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=10) as resp:
        resp.read()


# -- load -------------------------------------------------------------------------------------


def publish_for(addr: tuple[str, int], cmd: bytes, per_cmd: int, connections: int,
                depth: int, seconds: float) -> tuple[int, float]:
    """Publish from ``connections`` threads for ``seconds``; (messages OK'd, elapsed s)."""
    stop = threading.Event()
    counts = [0] * connections
    errors: list[str] = []
    socks = []
    for _ in range(connections):
        s = socket.create_connection(addr, timeout=30)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(b"  V2")
        socks.append(s)
    burst = cmd * depth
    want = len(OK_FRAME) * depth

    def run(i: int) -> None:
        s = socks[i]
        try:
            while not stop.is_set():
                s.sendall(burst)
                got = b""
                while len(got) < want:
                    chunk = s.recv(want - len(got))
                    if not chunk:
                        raise ConnectionError("closed")
                    got += chunk
                if got != OK_FRAME * depth:
                    raise RuntimeError(f"unexpected answer {got[:80]!r}")
                counts[i] += per_cmd * depth
        except (OSError, RuntimeError) as e:  # reported after the run
            errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(connections)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(30)
    elapsed = time.monotonic() - t0
    for s in socks:
        s.close()
    if errors:
        raise RuntimeError(f"publisher failed: {errors[0]}")
    return sum(counts), elapsed


# -- fsync counting ---------------------------------------------------------------------------


class SyscallCounter:
    """Counts fsync + fdatasync calls of a PID while running (perf, else strace -c)."""

    def __init__(self, tool: str) -> None:
        self.tool = tool
        self.proc: subprocess.Popen[bytes] | None = None

    @staticmethod
    def pick() -> str:
        perf = shutil.which("perf")
        if perf:
            probe = subprocess.run([perf, "stat", "-x,", "-e", "syscalls:sys_enter_fsync",
                                    "true"], capture_output=True, check=False)
            if probe.returncode == 0 and b"not supported" not in probe.stderr:
                return "perf"
        return "strace" if shutil.which("strace") else ""

    def start(self, pid: int) -> None:
        if self.tool == "perf":
            cmd = ["perf", "stat", "-x,", "-e",
                   "syscalls:sys_enter_fsync,syscalls:sys_enter_fdatasync", "-p", str(pid)]
        elif self.tool == "strace":
            cmd = ["strace", "-c", "-f", "-e", "trace=fsync,fdatasync", "-p", str(pid)]
        else:
            return
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(0.3)  # attached

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        self.proc.send_signal(signal.SIGINT)
        _, err = self.proc.communicate(timeout=30)
        self.proc = None
        total = 0
        for line in err.decode("utf-8", "replace").splitlines():
            if self.tool == "perf" and ("sys_enter_fsync" in line
                                        or "sys_enter_fdatasync" in line):
                value = line.split(",")[0]
                total += int(value) if value.isdigit() else 0
            elif self.tool == "strace":
                parts = line.split()
                if parts and parts[-1] in ("fsync", "fdatasync") and len(parts) >= 5:
                    total += int(parts[3])
        return total


# -- runs -------------------------------------------------------------------------------------


@dataclass
class Sample:
    msgs_per_s: float
    fsyncs_per_s: float | None
    cpu_ms_per_1k: float


def one_run(b: BrokerProcess, scenario: str, run: int, args: argparse.Namespace,
            counter_tool: str) -> Sample:
    topic = f"dur_{scenario.lower()}_{run}_{time.monotonic_ns() % 10**9}"
    _http(b, "/topic/create?" + urllib.parse.urlencode({"topic": topic}))
    _http(b, "/channel/create?" + urllib.parse.urlencode({"topic": topic, "channel": "ch"}))
    cmd, per_cmd = build_command(scenario, topic, args.size, args.batch)
    addr = split_hostport(b.tcp_address)
    publish_for(addr, cmd, per_cmd, args.connections, args.depth, args.warmup)
    counter = SyscallCounter(counter_tool)
    assert b.pid is not None
    counter.start(b.pid)
    cpu0 = b.cpu_s()
    n, elapsed = publish_for(addr, cmd, per_cmd, args.connections, args.depth, args.seconds)
    cpu = b.cpu_s() - cpu0
    fsyncs = counter.stop()
    _http(b, "/topic/delete?" + urllib.parse.urlencode({"topic": topic}))
    return Sample(n / elapsed, None if fsyncs is None else fsyncs / elapsed,
                  1000 * cpu * 1000 / max(n, 1))


def fmt(v: float | None, digits: int = 0) -> str:
    return "n/a" if v is None else f"{v:,.{digits}f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=3.0, help="measured seconds per run")
    p.add_argument("--warmup", type=float, default=0.5)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--connections", type=int, default=4)
    p.add_argument("--depth", type=int, default=1, help="commands in flight per connection")
    p.add_argument("--batch", type=int, default=100, help="messages per MPUB")
    p.add_argument("--size", type=int, default=200, help="message size in bytes")
    p.add_argument("--nsqd", default=shutil.which("nsqd") or "/usr/local/bin/nsqd")
    p.add_argument("--no-nsqd", action="store_true")
    p.add_argument("--scenarios", nargs="*", default=["MPUB", "PUB"])
    args = p.parse_args()

    settings: list[tuple[str, BrokerProcess]] = [
        ("pybroker memory", BrokerProcess("pybroker", ["--durability=memory"])),
        ("pybroker fsync", BrokerProcess("pybroker", ["--durability=fsync"])),
    ]
    if not args.no_nsqd and Path(args.nsqd).is_file():
        settings.append(("nsqd 1.3 (ref.)", BrokerProcess("nsqd", [], nsqd_path=args.nsqd)))
    tool = SyscallCounter.pick()
    print(f"fsync counting: {tool or 'unavailable'}; {args.connections} connections, depth "
          f"{args.depth}, {args.size}-byte messages, MPUB x{args.batch}, "
          f"{args.seconds:g}s x {args.runs} runs", flush=True)
    results: dict[tuple[str, str], list[Sample]] = {}
    try:
        for _, b in settings:
            b.start()
        for run in range(args.runs):
            for scenario in args.scenarios:
                for name, b in settings:
                    s = one_run(b, scenario, run, args, tool)
                    results.setdefault((name, scenario), []).append(s)
                    print(f"  run {run + 1} {scenario:4} {name:16} {s.msgs_per_s:>12,.0f} msg/s "
                          f"{fmt(s.fsyncs_per_s):>8} fsync/s", flush=True)
    finally:
        for _, b in settings:
            b.stop()

    mark = " (*)" if tool == "strace" else ""
    head = (f"{'setting':16} {'scenario':9} {'msgs/s' + mark:>14} {'min-max':>19} "
            f"{'fsyncs/s':>9} {'msgs/fsync':>10} {'CPU ms/1k':>9}")
    print("\n" + head + "\n" + "-" * len(head))
    for scenario in args.scenarios:
        for name, _ in settings:
            ss = results[(name, scenario)]
            rates = [s.msgs_per_s for s in ss]
            fs = [s.fsyncs_per_s for s in ss if s.fsyncs_per_s is not None]
            med = statistics.median(rates)
            fmed = statistics.median(fs) if fs else None
            per = med / fmed if fmed else None
            label = f"MPUB x{args.batch}" if scenario == "MPUB" else scenario
            print(f"{name:16} {label:9} {med:>14,.0f} {min(rates):>9,.0f}-{max(rates):<9,.0f} "
                  f"{fmt(fmed):>9} {fmt(per, 1):>10} "
                  f"{statistics.median(s.cpu_ms_per_1k for s in ss):>9.1f}")
    if tool == "strace":
        print("(*) measured under strace -c, which slows every fsync down")


if __name__ == "__main__":
    main()
