#!/usr/bin/env python3
"""What a replicated channel holding many deferred messages costs while a consumer keeps
deferring a few: a three-node cluster (replication factor 3, min-insync 2, a real etcd)
with ``--deferred`` messages deferred for an hour, then a consumer that requeues one
more message every 1/``--rate`` s for ``--seconds``. The leader ships the channel's state
to its followers every 200 ms while it changes (docs/replication.md, "Channels and
consumers");
printed: each node's CPU over that window (% of one core), the state versions made and
the bytes of states the leader shipped (to both followers) a second.

    python loadtest/bench_state_churn.py [--deferred 300000] [--runs 3]
    python loadtest/bench_state_churn.py --in-flight 100000 [--runs 3]

A leader encodes only the chunks of deferred messages that changed since the version
before (jsonvalue.PartTexts), and ships a follower only the pieces it lacks
(pybroker.cluster.states).
``--in-flight N``: instead, N messages in flight (consumers at RDY 2,500 that do not
FIN them; the message timeout, 60 s, is longer than the run) and one FIN a
1/``--rate`` s, each followed by the delivery of one more: the other entries of a
state, kept in chunks of offsets the same way (core/lifecycle.py ``pending_chunks``).
``--single``: one node instead, whose checkpoints write the state (every
``sync_timeout``, 2 s) the same way.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_takeover import (TOPIC, _connect, _frame, defer_all, led_topic,  # noqa: E402
                            publish_and_subscribe)

from pybroker.bench.brokers import BrokerProcess  # noqa: E402

EXTRA = 5_000          # messages published after the deferred ones, to requeue meanwhile


Figures = tuple[dict[int, float], int, float]


def window(args: argparse.Namespace, nodes: dict[int, BrokerProcess],
           shipping: Callable[[], tuple[int, int]], change: Callable[[], None]) -> Figures:
    """After 2 s (the states made of what came before written or shipped), ``change()``
    every 1/``--rate`` s for ``--seconds``: each node's CPU over that window (% of a
    core), the versions of the states made meanwhile and the bytes of states shipped a
    second (``shipping``: the leader's version and bytes shipped so far)."""
    time.sleep(2)
    v0, b0 = shipping()
    cpu0 = {i: b.cpu_s() for i, b in nodes.items()}
    t0 = time.monotonic()
    while time.monotonic() - t0 < args.seconds:
        change()
        time.sleep(1 / args.rate)
    el = time.monotonic() - t0
    cpu = {i: 100 * (b.cpu_s() - cpu0[i]) / el for i, b in nodes.items()}
    v1, b1 = shipping()
    return cpu, v1 - v0, (b1 - b0) / el


def next_message(s: socket.socket) -> bytes:
    """The id of the next message delivered on s (other frames skipped)."""
    while True:
        kind, data = _frame(s)
        if kind == 2:
            return data[10:26]


def churn(address: str, args: argparse.Namespace, nodes: dict[int, BrokerProcess],
          shipping: Callable[[], tuple[int, int]]) -> Figures:
    """Defer ``--deferred`` messages, then one more every 1/``--rate`` s (``window``)."""
    defer_all(address, args.deferred)
    with _connect(address) as s:
        publish_and_subscribe(s, EXTRA, 1)
        return window(args, nodes, shipping,
                      lambda: s.sendall(b"REQ " + next_message(s) + b" 3600000\n"))


def churn_in_flight(address: str, args: argparse.Namespace,
                    nodes: dict[int, BrokerProcess],
                    shipping: Callable[[], tuple[int, int]]) -> Figures:
    """``--in-flight`` messages in flight (consumers at RDY 2,500), then a FIN and the
    delivery that follows every 1/``--rate`` s (``window``)."""
    per = 2500
    with _connect(address) as p:
        publish_and_subscribe(p, args.in_flight + EXTRA, 0)
    conns: list[socket.socket] = []
    try:
        held: deque[bytes] = deque()
        for _ in range(-(-args.in_flight // per)):
            s = _connect(address)
            conns.append(s)
            s.sendall(f"SUB {TOPIC} ch\n".encode())
            assert _frame(s) == (0, b"OK")
            s.sendall(f"RDY {per}\n".encode())
            got = [next_message(s) for _ in range(per)]
            if not held:
                held.extend(got)
        first = conns[0]

        def fin_one() -> None:
            first.sendall(b"FIN " + held.popleft() + b"\n")
            held.append(next_message(first))
        return window(args, nodes, shipping, fin_one)
    finally:
        for s in conns:
            s.close()


def one_run(args: argparse.Namespace) -> tuple[float, float, int, float]:
    """(the leader's CPU %, the followers' mean CPU %, state versions made, bytes of
    states shipped a second); a single node: (its CPU %, 0, 0, 0)."""
    run = churn_in_flight if args.in_flight else churn
    if args.single:
        b = BrokerProcess("pybroker", env=dict(os.environ)).start()
        try:
            cpu, _, _ = run(b.tcp_address, args, {1: b}, lambda: (0, 0))
            return cpu[1], 0.0, 0, 0.0
        finally:
            b.stop()
    with led_topic(args.etcd) as (cs, leader, lead):
        def shipping() -> tuple[int, int]:
            rep = cs.replication(lead, TOPIC) or {}
            return int(rep.get("channel_states", 0)), int(rep.get("states_shipped_bytes", 0))
        cpu, versions, rate = run(leader.tcp_address, args, cs.nodes, shipping)
        followers = [c for i, c in cpu.items() if i != lead]
        return cpu[lead], sum(followers) / len(followers), versions, rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--deferred", type=int, default=300_000)
    ap.add_argument("--in-flight", type=int, default=0,
                    help="messages in flight instead of deferred ones (0: deferred)")
    ap.add_argument("--rate", type=float, default=20.0, help="requeues (or FINs) a second")
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--etcd", default=os.environ.get("ETCD", "etcd"))
    ap.add_argument("--single", action="store_true", help="one node, no replication")
    args = ap.parse_args()
    runs = []
    for k in range(args.runs):
        lc, fc, versions, rate = one_run(args)
        runs.append((lc, fc, versions, rate))
        if args.single:
            print(f"run {k + 1}: the node {lc:.0f}% of a core", flush=True)
        else:
            print(f"run {k + 1}: leader {lc:.0f}% of a core, each follower {fc:.0f}%, "
                  f"{versions} state versions in {args.seconds:.0f} s, states shipped "
                  f"{rate / 1e6:.2f} MB/s", flush=True)
    what = (f"{args.in_flight:,} in flight, {args.rate:g} FINs/s" if args.in_flight
            else f"{args.deferred:,} deferred, {args.rate:g} requeues/s")
    if args.single:
        print(f"{what}, one node: median "
              f"{statistics.median(r[0] for r in runs):.0f}% of a core")
        return
    print(f"{what}: leader median "
          f"{statistics.median(r[0] for r in runs):.0f}% of a core, followers "
          f"{statistics.median(r[1] for r in runs):.0f}%, versions "
          f"{statistics.median(r[2] for r in runs):.0f}, states shipped "
          f"{statistics.median(r[3] for r in runs) / 1e6:.2f} MB/s")


if __name__ == "__main__":
    main()
