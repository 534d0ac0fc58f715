#!/usr/bin/env python3
"""Many concurrent connections held on one broker: does it serve them all, and what do
they cost?

    python loadtest/bench_connections.py [--connections 10000] [--hold 10] [--subs 0.5]
                                         [--tcp-address HOST:PORT | --pybroker-arg ...]

Starts a pybroker (ephemeral loopback ports, temporary data dir, stopped by PID) unless
``--tcp-address`` names a running one. Opens ``--connections`` TCP connections from one
thread (non-blocking, one selector), each sending the magic and IDENTIFY; a fraction
``--subs`` of them SUBscribe (to 10 topics x 10 channels, RDY 1) and the others PUB one
message. While all are held for ``--hold`` seconds, a probe client PUBs in a loop and a
publisher feeds the subscribed topics. Prints: connections established and answered,
the probe's round trips (p50, p99, max), messages the held consumers received, and the
broker's RSS (total and per connection). Raises this process's fd limit to its hard
limit first (the broker raises its own at start-up).
"""
from __future__ import annotations

import argparse
import resource
import selectors
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pybroker.bench.brokers import BrokerProcess, proc_status_kb  # noqa: E402
from pybroker.bench.wire import identify_cmd, pub_cmd  # noqa: E402
from pybroker.config import split_hostport as _split  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--connections", type=int, default=10_000)
    p.add_argument("--hold", type=float, default=10.0)
    p.add_argument("--subs", type=float, default=0.5)
    p.add_argument("--tcp-address", default="")
    p.add_argument("--pybroker-arg", action="append", default=[])
    a = p.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if a.connections + 100 > hard:
        print(f"fd hard limit {hard} is too low for {a.connections} connections", file=sys.stderr)
        return 2
    broker = None
    if not a.tcp_address:
        broker = BrokerProcess("pybroker", a.pybroker_arg).start()
        addr = _split(broker.tcp_address)
    else:
        addr = _split(a.tcp_address)
    try:
        return run(a, addr, broker)
    finally:
        if broker is not None:
            broker.stop()


def run(a: argparse.Namespace, addr: tuple[str, int], broker: BrokerProcess | None) -> int:
    sel = selectors.DefaultSelector()
    identify = identify_cmd(client_id="held", heartbeat_interval=60000)
    rss0 = proc_status_kb(broker.pid, "VmRSS") if broker and broker.pid else 0
    t0 = time.monotonic()
    socks = []
    n_sub = int(a.connections * a.subs)
    for i in range(a.connections):
        s = socket.socket(socket.AF_INET6 if ":" in addr[0] else socket.AF_INET)
        s.setblocking(False)
        s.connect_ex(addr)
        if i < n_sub:
            topic, ch = f"held{i % 10}", f"c{(i // 10) % 10}"
            hello = b"  V2" + identify + f"SUB {topic} {ch}\nRDY 1\n".encode()
        else:
            hello = b"  V2" + identify + pub_cmd("held_pub", b"hello")
        socks.append(s)
        sel.register(s, selectors.EVENT_WRITE, [hello, 0])
    answered = 0
    received = 0
    deadline = time.monotonic() + 120
    while answered < a.connections and time.monotonic() < deadline:
        for key, mask in sel.select(1.0):
            s, st = key.fileobj, key.data
            if mask & selectors.EVENT_WRITE:
                try:
                    s.send(st[0])  # type: ignore[union-attr]
                except OSError:
                    continue
                sel.modify(s, selectors.EVENT_READ, st)
            elif mask & selectors.EVENT_READ:
                try:
                    data = s.recv(65536)  # type: ignore[union-attr]
                except OSError:
                    data = b""
                if data and st[1] == 0:
                    st[1] = 1
                    answered += 1
    setup_s = time.monotonic() - t0
    print(f"{answered} of {a.connections} connections answered in {setup_s:.1f}s")
    # hold them: a probe measures round trips, a publisher feeds the held consumers
    probe = socket.create_connection(addr)
    probe.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    probe.sendall(b"  V2")
    feed = socket.create_connection(addr)
    feed.sendall(b"  V2")
    pub = pub_cmd("held_probe", b"p")
    rtts = []
    end = time.monotonic() + a.hold
    while time.monotonic() < end:
        for i in range(10):
            feed.sendall(pub_cmd(f"held{i}", b"m"))
        t = time.perf_counter()
        probe.sendall(pub)
        got = b""
        while len(got) < 10:
            got += probe.recv(10 - len(got))
        rtts.append(time.perf_counter() - t)
        for key, _ in sel.select(0):
            try:
                data = key.fileobj.recv(65536)  # type: ignore[union-attr]
            except OSError:
                data = b""
            received += data.count(b"\x00\x00\x00\x02")
        time.sleep(0.01)
    rss1 = proc_status_kb(broker.pid, "VmRSS") if broker and broker.pid else 0
    rtts.sort()
    print(f"probe PUB round trips while held: n={len(rtts)}, p50 "
          f"{statistics.median(rtts) * 1e3:.2f} ms, p99 {rtts[int(len(rtts) * 0.99)] * 1e3:.2f} "
          f"ms, max {rtts[-1] * 1e3:.2f} ms")
    print(f"messages received by the held consumers (approx.): {received}")
    if broker is not None:
        print(f"broker RSS {rss1 / 2**20:.1f} MiB, {(rss1 - rss0) / max(answered, 1) / 1024:.1f} "
              f"KiB per connection")
    for s in socks:
        s.close()
    probe.close()
    feed.close()
    return 0 if answered == a.connections else 1


if __name__ == "__main__":
    sys.exit(main())
