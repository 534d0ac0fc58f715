#!/usr/bin/env python3
"""The in-flight table's hot paths, without a network: the C table against the dict.

    python loadtest/bench_inflight.py [--runs 5] [--messages 500000]

A channel's in-flight bookkeeping as dispatch and FIN use it, in three shapes:

- ``rdy2500``: 4 consumers at RDY 2,500 (nsq's bench_reader): flights of 2,500
  messages, FINs read 200 at a time per consumer;
- ``rdy8``: 32 consumers at RDY 8: a pass puts 32 flights of 8 in flight, a turn FINs
  one consumer's 8;
- ``rdy1``: 32 consumers at RDY 1: flights of one message (kept as dict entries by
  both), a turn FINs 32 runs of one.

``InFlight()`` (csrc/inflight.c) against ``InFlight(pure=True)`` (a dict of offset ->
flight, what Lifecycle kept before the table), messages per second of add and FIN
together, medians over ``--runs`` (min-max).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pybroker._native import inflight  # noqa: E402
from pybroker._native.inflight import InFlight  # noqa: E402
from pybroker.core.flight import Flight  # noqa: E402


class Client:
    msg_timeout_ns = 60 * 10**9


SHAPES = {            # consumers, messages a flight, FINs a run
    "rdy2500": (4, 2500, 200),
    "rdy8": (32, 8, 8),
    "rdy1": (32, 1, 1),
}


def run_shape(pure: bool, consumers: int, per: int, fin_run: int, messages: int) -> float:
    table: InFlight[Flight] = InFlight(pure=pure)
    clients = [Client() for _ in range(consumers)]
    off = 0
    done = 0
    t0 = time.perf_counter()
    while done < messages:
        flights = []
        for c in clients:
            flights.append(Flight(c, off, per, 1, 0))   # type: ignore[arg-type]
            off += per
        table.add_flights(flights)
        # FIN every message of the pass, fin_run at a time per consumer, the runs of
        # one turn together
        for at in range(0, per, fin_run):
            runs = [(f.client, range(f.first + at, f.first + min(per, at + fin_run)))
                    for f in flights]
            bad, _ = table.finish(runs)
            assert not any(bad)
        done += consumers * per
    return done / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--messages", type=int, default=500_000)
    args = p.parse_args()
    if not inflight._C:
        sys.exit("the C codec is not built (pip install -e .): nothing to compare")
    print(f"{'shape':<9} {'C table msg/s':>28} {'dict msg/s':>28} {'C/dict':>7}")
    for name, (consumers, per, fin_run) in SHAPES.items():
        rates: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.runs):
            for pure in (False, True):      # alternating
                rates[pure].append(run_shape(pure, consumers, per, fin_run,
                                             args.messages))
        c, d = statistics.median(rates[False]), statistics.median(rates[True])

        def cell(xs: list[float]) -> str:
            return f"{statistics.median(xs):,.0f} ({min(xs):,.0f}-{max(xs):,.0f})"
        print(f"{name:<9} {cell(rates[False]):>28} {cell(rates[True]):>28} {c / d:>6.2f}x")


if __name__ == "__main__":
    main()
