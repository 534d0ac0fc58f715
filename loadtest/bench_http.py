#!/usr/bin/env python3
"""HTTP publishing benchmark: /pub and /mpub requests per second over keep-alive
connections, pybroker and nsqd side by side.

    python loadtest/bench_http.py [--nsqd PATH] [--seconds 5] [--connections 8]
                                  [--depth 1] [--size 200] [--batch 100]

Starts each broker itself (ephemeral ports, a temporary data dir; stopped by PID), or
measures running ones (``--pybroker-http HOST:PORT``, ``--nsqd-http HOST:PORT``). The
client is one thread with a selector: every connection keeps ``--depth`` requests in
flight (1 = one request, then its answer; more = pipelining), with pre-built request
bytes, so that per request it costs a send and a recv. Messages go to an ephemeral
topic without channels, so neither broker touches the disk. For each endpoint it
prints requests/s, messages/s, latency percentiles and the broker's CPU time per 1000
requests (from /proc, so it does not depend on how fast the client is).
"""
from __future__ import annotations

import argparse
import json
import os
import selectors
import shutil
import socket
import struct
import sys
import time
import urllib.request
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pybroker.bench.brokers import Broker, BrokerProcess, ExternalBroker

TOPIC = "bench_http%23ephemeral"  # "#ephemeral": overflow is dropped, never written


def build_requests(host: str, size: int, batch: int) -> dict[str, tuple[bytes, int]]:
    """{endpoint: (request bytes, messages per request)}."""
    body = (b"m" * (size - 1) + b"x")[:size]

    def post(path: str, payload: bytes) -> bytes:
        return (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(payload)}\r\n"
                "\r\n").encode() + payload

    text = b"\n".join([body] * batch)
    binary = struct.pack(">i", batch) + (struct.pack(">i", len(body)) + body) * batch
    return {
        "/pub": (post(f"/pub?topic={TOPIC}", body), 1),
        "/mpub": (post(f"/mpub?topic={TOPIC}", text), batch),
        "/mpub binary": (post(f"/mpub?topic={TOPIC}&binary=true", binary), batch),
    }


def response_length(addr: tuple[str, int], request: bytes) -> int:
    """The byte length of the (fixed-size) answer to request; it must be 200 OK."""
    with socket.create_connection(addr, timeout=10) as s:
        s.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data:
            data += s.recv(65536)
        head, _, rest = data.partition(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200 "):
            raise RuntimeError(f"benchmark request refused: {data[:300]!r}")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        while len(rest) < length:
            rest += s.recv(65536)
        return len(head) + 4 + length


class _Conn:
    __slots__ = ("partial", "pending", "sent_at", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.pending = 0
        self.sent_at: deque[float] = deque()
        self.partial = 0


def drive(addr: tuple[str, int], request: bytes, resp_len: int, connections: int,
          depth: int, seconds: float) -> tuple[int, list[float]]:
    """Keep ``depth`` requests in flight on each connection for ``seconds``; returns
    (answered requests, latencies in seconds)."""
    sel = selectors.DefaultSelector()
    conns = []
    for _ in range(connections):
        s = socket.create_connection(addr, timeout=10)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.setblocking(False)
        c = _Conn(s)
        conns.append(c)
        sel.register(s, selectors.EVENT_READ, c)
    now = time.perf_counter
    burst = request * depth
    for c in conns:
        c.sock.sendall(burst)
        t = now()
        c.sent_at.extend([t] * depth)
        c.pending = depth
    done = 0
    latencies: list[float] = []
    end = now() + seconds
    try:
        while now() < end:
            for key, _ in sel.select(0.5):
                c = key.data
                data = c.sock.recv(1 << 20)
                if not data:
                    raise RuntimeError("the broker closed a connection")
                total = c.partial + len(data)
                n, c.partial = divmod(total, resp_len)
                if not n:
                    continue
                t = now()
                for _ in range(n):
                    latencies.append(t - c.sent_at.popleft())
                done += n
                c.sock.sendall(request * n)
                c.sent_at.extend([now()] * n)
    finally:
        for c in conns:
            c.sock.close()
        sel.close()
    return done, latencies


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def wait_http(b: Broker, timeout_s: float = 20.0) -> tuple[str, int]:
    deadline = time.monotonic() + timeout_s
    while not b.http_address:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{b.name} has no HTTP address")
        time.sleep(0.05)
    host, _, port = b.http_address.rpartition(":")
    addr = (host.strip("[]"), int(port))
    with urllib.request.urlopen(f"http://{b.http_address}/ping", timeout=10) as r:
        assert r.read() == b"OK"
    return addr


def bench_broker(b: Broker, args: argparse.Namespace) -> list[dict[str, object]]:
    addr = wait_http(b)
    rows = []
    for endpoint, (request, per_req) in build_requests(addr[0], args.size, args.batch).items():
        if args.only and endpoint.split()[0] not in args.only:
            continue
        resp_len = response_length(addr, request)
        drive(addr, request, resp_len, args.connections, args.depth, args.warmup)
        cpu0 = b.cpu_s()
        done, lat = drive(addr, request, resp_len, args.connections, args.depth, args.seconds)
        cpu = b.cpu_s() - cpu0
        rows.append({
            "endpoint": endpoint, "broker": b.name, "connections": args.connections,
            "depth": args.depth, "requests_per_s": done / args.seconds,
            "messages_per_s": done * per_req / args.seconds,
            "p50_ms": pct(lat, 0.5) * 1e3, "p99_ms": pct(lat, 0.99) * 1e3,
            "cpu_ms_per_1k": (cpu * 1e6 / done) if done and b.pid else None,
        })
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nsqd", default=shutil.which("nsqd") or "/usr/local/bin/nsqd",
                   help="nsqd binary to compare with ('' to skip)")
    p.add_argument("--pybroker-http", default="", help="measure a running pybroker")
    p.add_argument("--nsqd-http", default="", help="measure a running nsqd")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--connections", type=int, default=8)
    p.add_argument("--depth", type=int, default=1, help="requests in flight per connection")
    p.add_argument("--size", type=int, default=200, help="message size in bytes")
    p.add_argument("--batch", type=int, default=100, help="messages per /mpub")
    p.add_argument("--only", nargs="*", help="endpoints: /pub /mpub")
    p.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    args = p.parse_args()

    brokers: list[Broker] = []
    if args.pybroker_http:
        brokers.append(ExternalBroker("pybroker", "", args.pybroker_http))
    else:
        brokers.append(BrokerProcess("pybroker"))
    if args.nsqd_http:
        brokers.append(ExternalBroker("nsqd", "", args.nsqd_http))
    elif args.nsqd and os.access(args.nsqd, os.X_OK):
        brokers.append(BrokerProcess("nsqd", ["--https-address="], nsqd_path=args.nsqd))
    rows: list[dict[str, object]] = []
    for b in brokers:
        b.start()
        try:
            rows += bench_broker(b, args)
        finally:
            b.stop()
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{args.connections} keep-alive connections, {args.depth} request(s) in flight each, "
          f"{args.size}-byte messages, {args.batch} per /mpub, {args.seconds:.0f}s per run")
    print(f"{'endpoint':<13} {'broker':<9} {'req/s':>9} {'msg/s':>10} {'p50 ms':>7} "
          f"{'p99 ms':>7} {'cpu ms/1k req':>13}")
    for endpoint in dict.fromkeys(r["endpoint"] for r in rows):
        for r in (r for r in rows if r["endpoint"] == endpoint):
            cpu = r["cpu_ms_per_1k"]
            print(f"{r['endpoint']:<13} {r['broker']:<9} {r['requests_per_s']:>9.0f} "
                  f"{r['messages_per_s']:>10.0f} {r['p50_ms']:>7.2f} {r['p99_ms']:>7.2f} "
                  f"{'' if cpu is None else f'{cpu:.0f}':>13}")


if __name__ == "__main__":
    main()
