#!/usr/bin/env python3
"""Connection churn: clients that connect, publish one message and leave.

    python loadtest/bench_churn.py [--runs 3] [--seconds 3] [--threads 4] [--nsqd PATH]
                                   [--log-level info] [--baseline-src DIR]

What short-lived producers do (a cron job, a CGI script, a serverless function): each
connection sends the V2 magic and one ``PUB``, waits for its ``OK`` and closes. For
``--seconds`` ``--threads`` client threads do that without pause against one broker
(ephemeral loopback ports, a new data path, stopped by PID); the broker's log goes to a
pipe read by this process, at ``--log-level`` (three lines a connection at ``info``, as
nsqd writes). Printed per run: connections a second and the broker's CPU (user+system,
/proc/PID/stat) a connection; then the medians, and the ratio to nsqd's where one is
found (``--nsqd``, else on PATH). The brokers run alternately, run by run.
``--baseline-src DIR`` adds a pybroker from another tree (a ``git worktree`` with its
native module built), run the same way.
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import struct
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pybroker.bench.brokers import BrokerProcess  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")
PUB = b"PUB churn\n" + struct.pack(">i", 5) + b"hello"


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def read_frame(s: socket.socket) -> bytes:
    buf = b""
    while len(buf) < 4:
        chunk = s.recv(4096)
        if not chunk:
            raise ConnectionError("closed before the answer")
        buf += chunk
    size = struct.unpack(">i", buf[:4])[0]
    while len(buf) < 4 + size:
        chunk = s.recv(4096)
        if not chunk:
            raise ConnectionError("closed mid-answer")
        buf += chunk
    return buf[4:4 + size]


def churn(address: tuple[str, int], seconds: float, threads: int) -> int:
    counts = [0] * threads
    errors: list[str] = []
    stop = time.monotonic() + seconds

    def one(i: int) -> None:
        try:
            while time.monotonic() < stop:
                with socket.create_connection(address, timeout=10) as s:
                    s.sendall(b"  V2" + PUB)
                    frame = read_frame(s)
                    if frame[4:] != b"OK":
                        raise ValueError(f"not OK: {frame!r}")
                counts[i] += 1
        except (OSError, ValueError) as e:
            errors.append(str(e))

    workers = [threading.Thread(target=one, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise SystemExit(f"a client failed: {errors[0]}")
    return sum(counts)


def run_one(kind: str, args: argparse.Namespace, src: str | None) -> tuple[float, float]:
    level = [f"--log-level={args.log_level}"]
    if kind == "nsqd":
        b = BrokerProcess("nsqd", level, nsqd_path=args.nsqd)
    else:
        # PYTHONSAFEPATH: the working directory (maybe this tree) must not come first
        b = BrokerProcess("pybroker", level,
                          env={"PYTHONPATH": src, "PYTHONSAFEPATH": "1"} if src else None)
    b.start()
    try:
        host, _, port = b.tcp_address.rpartition(":")
        address = (host, int(port))
        churn(address, 0.5, args.threads)                 # warm-up
        before = cpu_s(b.pid)
        started = time.monotonic()
        n = churn(address, args.seconds, args.threads)
        took = time.monotonic() - started
        cpu = cpu_s(b.pid) - before
    finally:
        b.stop()
    return n / took, cpu / n * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--log-level", default="info")
    p.add_argument("--nsqd", default=shutil.which("nsqd"))
    p.add_argument("--baseline-src", default=None)
    args = p.parse_args()
    kinds: list[tuple[str, str | None]] = [("pybroker", None)]
    if args.baseline_src:
        kinds.append(("baseline", str(Path(args.baseline_src).resolve())))
    if args.nsqd:
        kinds.append(("nsqd", None))
    got: dict[str, list[tuple[float, float]]] = {k: [] for k, _ in kinds}
    for r in range(args.runs):
        for kind, src in kinds:
            rate, us = run_one("nsqd" if kind == "nsqd" else "pybroker", args, src)
            got[kind].append((rate, us))
            print(f"run {r + 1} {kind:9s} {rate:8,.0f} connections/s  {us:6.0f} us of "
                  f"broker CPU a connection", flush=True)
    medians = {k: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v))
               for k, v in got.items()}
    print(f"medians of {args.runs} ({args.threads} threads, {args.seconds:g} s, log level "
          f"{args.log_level}):")
    for kind, (rate, us) in medians.items():
        ratio = f"  {rate / medians['nsqd'][0]:.2f}x nsqd" if "nsqd" in medians else ""
        print(f"  {kind:9s} {rate:8,.0f} connections/s  {us:6.0f} us a connection{ratio}")


if __name__ == "__main__":
    main()
