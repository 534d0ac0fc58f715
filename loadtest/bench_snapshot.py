#!/usr/bin/env python3
"""What a channel's snapshot costs its owner loop with many messages in flight, without
a network (docs/storage.md, "A snapshot's messages in flight").

    python loadtest/bench_snapshot.py [--runs 5] [--in-flight 250000] [--dpubs 1000000]

A channel with ``--in-flight`` messages in flight in two shapes: ``rdy2500``, 100
consumers at RDY 2,500 (flights of many messages, in the C table), and ``rdy1``, the
same count as flights of one message each (a TOUCHed or RDY-1 message: dict entries).
Timed, with the broker's garbage collector settings (``runtime.py``: thresholds
25,000 / 50 / 100, start-up objects frozen):

- ``loop``: ``snapshot_parts`` on the owner loop (every checkpoint; every 200 ms on a
  replicated topic's leader while the channel changes);
- ``made``: the pending entries made from it, on the thread that completes the state
  (the storage thread, which offers the GIL to the loops meanwhile);
- ``listed``: what the loop did before (an entry list per message in flight, built on
  the loop), for reference;
- ``rewind``: ``rewind(0)`` on the owner loop (every message in flight is at or after
  it: its offsets go to ``skip``, sorted, and each is owed a replay); ``rewind
  (before)``: what the rewind did before (the offsets listed from the table in Python,
  sorted, and put in the ``replay`` set one by one), for reference;
- ``empty``: ``empty()`` once at the end (/channel/empty, and a channel's delete,
  which empties it before it closes its consumers); ``a step``: the longest of the
  steps that free what it dropped after (``lifecycle.freeing``, one a turn).

Then 100 consumers holding ``--in-flight`` messages leave the channel in one turn
(their connections closed at once: ``EventLoop._requeue_leavers``), in both shapes
(``rdy1`` here: the messages TOUCHed, each a flight of its own): ``leave``, the
channel's flights listed for the pass (``Lifecycle.leave``); ``longest step`` and
``steps``, the longest turn's step (``requeue_step``: SCAN_STEP flights looked
through, LEAVE_STEP messages requeued; the first with ``leave``) and how many turns
it took; ``one turn (before)``, a pass and a requeue per consumer in one turn, as
before, for reference.

Then ``rewind(0)`` over ``--in-flight`` messages held elsewhere: ``requeued`` (each
REQ'd at once, behind the queue) and ``deferred`` (each REQ'd for an hour).

Then a channel that read ``--in-flight`` DPUBs an hour away (each deferred by it),
rewound to 0: the first /stats after the rewind (``first``: depth and deferred count,
which find the DPUBs among the rewind's ``skip``) and the next one (``next``).

Then a topic holding ``--dpubs`` DPUBs an hour away, not yet read by its channel
(core/dpubs.py): ``stats``, the channel's depth and deferred count as /stats reads them
on the owner loop; ``counted`` (before, for reference), those DPUBs counted one by one;
``prune``, a step of the topic's pruning once the channel read them all (under the
topic's lock, on the storage thread: ``Topic.prune_dpubs``, PRUNE_STEP of them).

Medians over ``--runs`` (min-max), milliseconds.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pybroker.core.channel import Channel  # noqa: E402
from pybroker.core.lifecycle import freeing  # noqa: E402
from pybroker.core.topic import Topic  # noqa: E402
from pybroker.storage.topiclog import TopicLog  # noqa: E402

S = 1_000_000_000
WALL = 1_700_000_000 * S


class Owner:
    def mark_dirty(self, ch: Channel) -> None:
        pass

    def deliver(self, sends: list[tuple[object, int, int]], out: bytes | bytearray) -> None:
        pass


class Client:
    msg_timeout_ns = 3600 * S
    sample_rate = 0

    def __init__(self, rdy: int) -> None:
        self.rdy = rdy
        self.in_flight_count = 0

    def ready_room(self) -> int:
        return self.rdy - self.in_flight_count

    def send_frames(self, frames: bytes, n: int) -> None:
        pass


def published(n: int, defer_ns: int) -> tuple[Topic, Channel]:
    """A topic in memory holding n messages (deferred by defer_ns: DPUBs), and its
    channel."""
    log = TopicLog(None, max_bytes_per_file=1 << 30, mem_records=n + 1, max_record_bytes=4096)
    owner = Owner()
    t = Topic("t", log, n + 1, lambda _t, _c: owner)
    ch, _ = t.get_channel("c")
    for i in range(0, n, 50_000):
        t.publish([b"m"] * min(50_000, n - i), WALL, defer_ns)
        t.write()
    return t, ch


def channel(n: int, shape: str) -> Channel:
    _, ch = published(n, 0)
    if shape == "rdy2500":
        consumers = [Client(2500) for _ in range(max(1, n // 2500))]
        for c in consumers:
            ch.add_consumer(c, 0)
        while ch.dispatch(0, WALL):
            pass
    else:
        c = Client(1)
        ch.add_consumer(c, 0)
        for _ in range(n):        # one message a flight, as a consumer at RDY 1 takes them
            c.in_flight_count = 0
            ch.dispatch(0, WALL)
    assert len(ch.in_flight) == n, (len(ch.in_flight), n)
    return ch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--in-flight", type=int, default=250_000)
    ap.add_argument("--dpubs", type=int, default=1_000_000)
    args = ap.parse_args()
    print(f"{args.in_flight:,} in flight; median of {args.runs} (min-max), ms")
    print(f"{'shape':8s} {'loop':>20s} {'made':>20s} {'listed (before)':>20s} "
          f"{'rewind':>20s} {'rewind (before)':>20s} {'empty':>9s} {'a step':>9s}")
    for shape in ("rdy2500", "rdy1"):
        ch = channel(args.in_flight, shape)
        gc.collect()
        gc.set_threshold(25_000, 50, 100)
        gc.freeze()
        rows: dict[str, list[float]] = {"loop": [], "made": [], "listed": [],
                                        "rewind": [], "rewind_before": []}
        for _ in range(args.runs):
            t0 = time.perf_counter()
            state, _ = ch.snapshot_parts(WALL, 0)
            t1 = time.perf_counter()
            list(state["pending"])
            t2 = time.perf_counter()
            listed = [[off, f.attempts, 0] for off, f in ch.in_flight.items()]
            t3 = time.perf_counter()
            del state, listed             # freed outside the timings
            t4 = time.perf_counter()
            ch.rewind(0)
            t5 = time.perf_counter()
            replay: set[int] = set()
            held = [off for off in ch.in_flight if off >= 0]
            replay.update(held)
            skip = deque(sorted(set(held)))
            t6 = time.perf_counter()
            del replay, held, skip
            rows["loop"].append(1e3 * (t1 - t0))
            rows["made"].append(1e3 * (t2 - t1))
            rows["listed"].append(1e3 * (t3 - t2))
            rows["rewind"].append(1e3 * (t5 - t4))
            rows["rewind_before"].append(1e3 * (t6 - t5))
        t0 = time.perf_counter()
        litter = ch.empty()               # once: it drops what the channel holds
        emptied = 1e3 * (time.perf_counter() - t0)
        freed = 0.0                       # what it dropped, freed a step a turn
        steps = freeing(litter)
        while True:
            t0 = time.perf_counter()
            try:
                next(steps)
            except StopIteration:
                break
            finally:
                freed = max(freed, 1e3 * (time.perf_counter() - t0))
        gc.unfreeze()
        cells = [f"{statistics.median(v):6.1f} ({min(v):.1f}-{max(v):.1f})"
                 for v in rows.values()]
        print(f"{shape:8s} " + " ".join(f"{c:>20s}" for c in cells)
              + f" {emptied:9.1f} {freed:9.1f}")
    leaving(args.in_flight, args.runs)
    rewind_held(args.in_flight, args.runs)
    rewound_dpubs(args.in_flight, args.runs)
    if args.dpubs:
        dpubs(args.dpubs, args.runs)


def fleet(n: int, shape: str) -> tuple[Channel, list[Client]]:
    """A channel whose 100 consumers hold n messages in flight (TOUCHed, for
    ``rdy1``: a flight each)."""
    _, ch = published(n, 0)
    consumers = [Client(n // 100) for _ in range(100)]
    for c in consumers:
        ch.add_consumer(c, 0)
    while ch.dispatch(0, WALL):
        pass
    if shape == "rdy1":
        for off in list(ch.in_flight):
            f = ch.in_flight.get(off)
            assert f is not None and f.client is not None
            ch.touch(f.client, b"%016x" % off, 1, 3600 * S)
    assert len(ch.in_flight) == n, (len(ch.in_flight), n)
    return ch, consumers


def leaving(n: int, runs: int) -> None:
    print(f"\n100 consumers holding {n:,} leave in one turn; median of {runs} (min-max), ms")
    print(f"{'shape':8s} {'leave':>18s} {'longest step':>18s} {'steps':>6s} "
          f"{'one turn (before)':>20s}")
    for shape in ("rdy2500", "rdy1"):
        rows: dict[str, list[float]] = {"leave": [], "longest": [], "before": []}
        steps = 0
        for run in range(runs + 1):         # the last run: as before
            ch, consumers = fleet(n, shape)
            gc.collect()
            gc.freeze()
            for c in consumers:
                assert ch.detach(c)
            if run == runs:
                t0 = time.perf_counter()
                for c in consumers:          # a pass and the requeues each
                    more = ch.leave([c])
                    while more:
                        _, more = ch.requeue_step()
                rows["before"].append(1e3 * (time.perf_counter() - t0))
            else:
                t0 = time.perf_counter()
                assert ch.leave(consumers)
                t1 = time.perf_counter()
                longest, steps, more = 0.0, 0, True
                while more:
                    t2 = time.perf_counter()
                    _, more = ch.requeue_step()
                    longest = max(longest, 1e3 * (time.perf_counter() - t2)
                                  + (1e3 * (t1 - t0) if not steps else 0))
                    steps += 1
                rows["leave"].append(1e3 * (t1 - t0))
                rows["longest"].append(longest)
            assert len(ch.requeued) == n and not ch.in_flight
            gc.unfreeze()
            del ch, consumers
        cells = [f"{statistics.median(v):6.1f} ({min(v):.1f}-{max(v):.1f})"
                 for v in (rows["leave"], rows["longest"])]
        print(f"{shape:8s} " + " ".join(f"{c:>18s}" for c in cells)
              + f" {steps:6d} {rows['before'][0]:20.1f}")


def rewind_held(n: int, runs: int) -> None:
    """``rewind(0)`` over n messages requeued (REQ 0, each behind the queue) or deferred
    (REQ of an hour), every one at or after the offset: each goes to ``skip`` and the
    requeued ones are made ready at once."""
    print(f"\nrewind(0) over {n:,} messages held elsewhere; median of {runs} (min-max), ms")
    for kind, delay in (("requeued", 0), ("deferred", 3600 * S)):
        ch, _ = fleet(n, "rdy2500")
        for off in list(ch.in_flight):
            f = ch.in_flight.get(off)
            assert f is not None and f.client is not None
            ch.requeue(f.client, b"%016x" % off, delay, 1, WALL)
        assert len(ch.requeued if not delay else ch.deferred) == n
        gc.collect()
        gc.freeze()
        took = []
        for _ in range(runs):
            t0 = time.perf_counter()
            ch.rewind(0)
            took.append(1e3 * (time.perf_counter() - t0))
        assert len(ch.skip) == n
        gc.unfreeze()
        print(f"{kind:8s} {statistics.median(took):6.1f} ({min(took):.1f}-{max(took):.1f})")
        del ch


def rewound_dpubs(n: int, runs: int) -> None:
    """A channel that read n DPUBs an hour away (each deferred by it), rewound to 0:
    the first /stats after the rewind (its depth and deferred count, which find the
    DPUBs among skip's offsets), and the next ones."""
    t, ch = published(n, 3600 * S)
    c = Client(n)
    ch.add_consumer(c, 0)
    for _ in range(n):              # each call defers a batch (it sends nothing)
        if ch.cursor >= n:
            break
        ch.dispatch(0, WALL)
    assert len(ch.deferred) == n
    gc.collect()
    gc.freeze()
    rows: dict[str, list[float]] = {"first": [], "next": []}
    for _ in range(runs):
        ch.rewind(0)
        for key in ("first", "next"):
            t0 = time.perf_counter()
            assert ch.depth(WALL) == 0 and ch.deferred_count(WALL) == n
            rows[key].append(1e3 * (time.perf_counter() - t0))
    gc.unfreeze()
    print(f"\n{n:,} DPUBs an hour away, read (deferred) by the channel, then rewind(0): "
          "/stats's depth and deferred count; median (min-max), ms")
    print(" ".join(f"{k} {statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})"
                   for k, v in rows.items()))


def dpubs(n: int, runs: int) -> None:
    from pybroker.core.topic import PRUNE_STEP

    t, ch = published(n, 3600 * S)
    gc.collect()
    gc.freeze()
    rows: dict[str, list[float]] = {"stats": [], "counted": [], "prune": []}
    for _ in range(runs):
        t0 = time.perf_counter()
        assert ch.depth(WALL) == 0 and ch.deferred_count(WALL) == n
        t1 = time.perf_counter()
        dp = t.dpubs
        assert sum(1 for off in dp.irange(0, n, inclusive=(True, False))
                   if dp[off] > WALL) == n
        t2 = time.perf_counter()
        rows["stats"].append(1e3 * (t1 - t0))
        rows["counted"].append(1e3 * (t2 - t1))
    while t.dpubs:
        t0 = time.perf_counter()
        t.dpubs.drop_below(n, PRUNE_STEP)
        rows["prune"].append(1e3 * (time.perf_counter() - t0))
    gc.unfreeze()
    print(f"\n{n:,} DPUBs an hour away; median (min-max), ms; prune: {len(rows['prune'])} steps")
    print(" ".join(f"{k} {statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})"
                   for k, v in rows.items()))


if __name__ == "__main__":
    main()
