"""FlowController (RDY spread, refill, truncation, backoff, redistribution) without sockets.

Connections are small stand-ins that record the RDY commands they were asked to send;
timers go to a loop stand-in the test fires by hand, so no test sleeps.
"""
from __future__ import annotations

import time
from typing import Any, Callable

from pybroker.client.config import Config
from pybroker.client.loop import Timer
from pybroker.client.rdy import BackoffSignal, FlowController


class StubConn:
    def __init__(self, address: str) -> None:
        self.address = address
        self.rdy_count = self.rdy_remaining = self.in_flight = self.queued = 0
        self.max_rdy_count = 2500
        self.last_rdy_ts = 0.0
        self.last_message_ts = time.monotonic()
        self.closing = self.is_closed = False
        self.sent: list[int] = []

    def send_quietly(self, data: bytes) -> bool:
        assert data.startswith(b"RDY ")
        self.sent.append(int(data[4:]))
        return True

    def __repr__(self) -> str:
        return self.address


class ManualLoop:
    def __init__(self) -> None:
        self.timers: list[tuple[float, Timer]] = []

    def call_later(self, delay_s: float, fn: Callable[..., Any], *args: Any) -> Timer:
        t = Timer(delay_s, fn, args)
        self.timers.append((delay_s, t))
        return t

    def fire(self) -> list[float]:
        """Run every pending timer; return their delays."""
        due, self.timers = self.timers, []
        for _, t in due:
            if not t.cancelled:
                t.fn(*t.args)
        return [d for d, t in due if not t.cancelled]


def make(n: int, **cfg: Any) -> tuple[FlowController, list[Any], ManualLoop,
                                       list[tuple[str, int]]]:
    """A FlowController over ``n`` stand-in connections (typed Any: they quack like Conn)."""
    conns: list[Any] = [StubConn(f"c{i}") for i in range(n)]
    loop = ManualLoop()
    hooks: list[tuple[str, int]] = []
    fc = FlowController(Config(**cfg), loop, lambda: list(conns),  # type: ignore[arg-type]
                        lambda c, k: hooks.append((c.address, k)))
    return fc, conns, loop, hooks


def test_share_is_max_in_flight_over_connections() -> None:
    fc, conns, _, _ = make(3, max_in_flight=30)
    for c in conns:
        fc.maybe_update_rdy(c)
    assert [c.sent for c in conns] == [[10], [10], [10]]
    assert fc.total_rdy_count == 30
    fc.max_in_flight = 2
    assert fc.per_conn_max_in_flight() == 1          # max(1, 2 // 3)


def test_rdy_truncated_to_max_in_flight_and_retried() -> None:
    fc, conns, loop, _ = make(3, max_in_flight=2)
    results = [fc.update_rdy(c, 1) for c in conns]
    assert results == [True, True, False]
    assert [c.rdy_count for c in conns] == [1, 1, 0]
    assert [d for d, _ in loop.timers] == [5.0]      # c2 retries leaving RDY 0 later
    fc.update_rdy(conns[0], 0)
    loop.fire()
    assert conns[2].rdy_count == 1 and fc.total_rdy_count == 2


def test_refill_when_remaining_runs_low() -> None:
    fc, conns, _, hooks = make(1, max_in_flight=10)
    c = conns[0]
    fc.maybe_update_rdy(c)
    for _ in range(7):
        fc.on_message(c)
    assert c.rdy_remaining == 3, "refilled too early"
    c.last_rdy_ts = 0.0
    fc.on_message(c)                                 # remaining 2 < 25 % of 10
    assert c.rdy_remaining == 10 and c.last_rdy_ts > 0, "the window restarts"
    # the server holds RDY 10 as a cap on in-flight: the same count is not sent again
    assert c.sent == [10] and hooks == [("c0", 10)]
    assert c.in_flight == 8 and c.queued == 8
    fc.on_dispatched(c)
    fc.on_response_sent(c)
    assert (c.in_flight, c.queued) == (7, 7)


def test_rdy_once_at_max_in_flight_1() -> None:
    """At max_in_flight 1 every delivery empties the window; RDY 1 goes out once."""
    fc, conns, _, hooks = make(1, max_in_flight=1)
    c = conns[0]
    fc.maybe_update_rdy(c)
    for _ in range(100):
        fc.on_message(c)
        fc.on_dispatched(c)
        fc.on_response_sent(c)
    assert c.sent == [1] and hooks == [("c0", 1)]
    assert (c.rdy_count, c.rdy_remaining, c.in_flight) == (1, 1, 0)
    fc.change_max_in_flight(3)                       # a changed count is sent
    fc.change_max_in_flight(0)
    assert c.sent == [1, 3, 0]


def test_rdy_lowered_when_above_share() -> None:
    fc, conns, _, _ = make(1, max_in_flight=10)
    fc.maybe_update_rdy(conns[0])
    conns.append(StubConn("late"))                   # a second connection arrives
    fc.on_message(conns[0])
    assert conns[0].sent == [10, 5]


def test_backoff_rdy_zero_then_trial_one_then_full() -> None:
    fc, conns, loop, hooks = make(2, max_in_flight=10, backoff_multiplier=0.5)
    for c in conns:
        fc.maybe_update_rdy(c)
    fc.signal(BackoffSignal.BACKOFF)
    assert [c.rdy_count for c in conns] == [0, 0] and fc.backoff_counter == 1
    assert [d for d, _ in loop.timers] == [1.0]      # 0.5 * 2**1
    fc.signal(BackoffSignal.RESUME)                  # ignored while the timer runs
    fc.signal(BackoffSignal.BACKOFF)
    assert fc.backoff_counter == 1
    fc.on_message(conns[0])                          # no refill while backing off
    assert conns[0].rdy_count == 0
    loop.fire()                                      # trial: RDY 1 on one connection
    assert sorted(c.rdy_count for c in conns) == [0, 1]
    fc.signal(BackoffSignal.RESUME)
    assert [c.rdy_count for c in conns] == [5, 5] and fc.backoff_counter == 0
    counts = [k for _, k in hooks]
    assert counts == [5, 5, 0, 0, 1, 5, 5]


def test_backoff_levels_and_cap() -> None:
    fc, conns, loop, _ = make(1, max_in_flight=4, backoff_multiplier=1.0,
                              max_backoff_duration=4.0)
    fc.maybe_update_rdy(conns[0])
    delays = []
    for _ in range(4):
        fc.signal(BackoffSignal.BACKOFF)
        delays += loop.fire()
    assert delays == [2.0, 4.0, 4.0, 4.0]            # level 3 (8 s) would pass the cap
    assert fc.backoff_counter == 2
    fc.signal(BackoffSignal.CONTINUE)                # same level again
    assert loop.fire() == [4.0]
    fc.signal(BackoffSignal.RESUME)                  # level 1: still backing off
    assert fc.backoff_counter == 1 and loop.fire() == [2.0]
    fc.signal(BackoffSignal.RESUME)
    assert fc.backoff_counter == 0 and conns[0].rdy_count == 4


def test_redistribute_moves_rdy_from_idle_connections() -> None:
    fc, conns, _, _ = make(3, max_in_flight=1, low_rdy_idle_timeout=1.0)
    fc.update_rdy(conns[0], 1)
    conns[0].last_message_ts = time.monotonic() - 5  # idle for 5 s
    moved = set()
    for _ in range(30):
        fc.redistribute()
        assert fc.total_rdy_count <= 1
        holder = [c for c in conns if c.rdy_count]
        assert len(holder) == 1
        moved.add(holder[0].address)
        holder[0].last_message_ts = time.monotonic() - 5
    assert moved == {"c0", "c1", "c2"}, "RDY never reached the other connections"


def test_conn_close_returns_its_rdy() -> None:
    fc, conns, _, _ = make(2, max_in_flight=2)
    for c in conns:
        fc.maybe_update_rdy(c)
    gone = conns.pop()
    fc.on_conn_close(gone, left=1)
    assert fc.total_rdy_count == 1 and gone.rdy_count == 0
    assert not fc.need_rdy_redistributed
    fc.maybe_update_rdy(conns[0])
    assert conns[0].rdy_count == 2
