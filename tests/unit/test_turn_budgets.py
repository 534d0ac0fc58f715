"""A turn reads at most a budget's worth of ready objects; the rest are read in the
turns after, each once (``evloop.EVENTS_BUDGET_NS``; the publish lane's general reads,
``lane.TURN_NS``): 10,000 clients connecting and subscribing at once held a loop's turn
30-50 ms. Real sockets; the loops' turns run by the test."""
from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from pybroker import evloop
from pybroker.evloop import SelectorLoop
from pybroker.poller import EVENT_READ
from pybroker.runtime import Runtime
from pybroker.server import lane
from tests.support.inproc import attach, temp_runtime, turn


class OneByte:
    """Reads a byte when readable and notes the turn it was read in."""

    def __init__(self, sock: socket.socket, turns: list[int]) -> None:
        self.sock = sock
        self.turns = turns
        self.read_in: list[int] = []

    def on_readable(self) -> None:
        if self.sock.recv(1):
            self.read_in.append(self.turns[0])

    def on_writable(self) -> None:
        pass


@pytest.fixture
def pairs() -> Iterator[list[tuple[socket.socket, socket.socket]]]:
    made = [socket.socketpair() for _ in range(20)]
    yield made
    for a, b in made:
        a.close()
        b.close()


@pytest.mark.parametrize("budget", ["spent", "default"])
def test_ready_objects_past_the_budget_are_read_next_turn_each_once(
        pairs: list[tuple[socket.socket, socket.socket]], budget: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    if budget == "spent":
        monkeypatch.setattr(evloop, "EVENTS_BUDGET_NS", -1)   # past it at every look
        monkeypatch.setattr(evloop, "EVENTS_LOOK", 4)         # a look every 4 objects
    loop = SelectorLoop("test-budget")
    turns = [0]
    handlers = []
    try:
        for a, b in pairs:
            a.setblocking(False)
            h = OneByte(a, turns)
            loop.selector.register(a, EVENT_READ, h)
            handlers.append(h)
            b.send(b"x")
        per_turn: list[int] = []
        while sum(per_turn) < len(pairs):
            turns[0] += 1
            assert turns[0] <= 50, per_turn
            before = sum(len(h.read_in) for h in handlers)
            turn(loop)
            per_turn.append(sum(len(h.read_in) for h in handlers) - before)
        assert all(len(h.read_in) == 1 for h in handlers)     # each read once
        if budget == "spent":
            assert per_turn == [3] * 6 + [2]    # 3 before the look that finds it spent
        else:
            assert per_turn == [20]
        turn(loop)                               # nothing owed is left behind
        assert all(len(h.read_in) == 1 for h in handlers)
    finally:
        loop.close()


@pytest.fixture
def rt() -> Iterator[Runtime]:
    with temp_runtime("turnbudget-") as r:
        yield r


def test_new_connections_past_the_lanes_budget_are_read_next_turn(
        rt: Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    """Connections the lane reads the general way (here: new ones, magic and SUB)
    stop being read once TURN_NS of such reads have passed; the others are read in the
    turns after, and every one is answered."""
    loop = rt.loops[0]
    turn(loop)                                  # (the lane is on from a turn's end)
    assert loop.lane_on
    monkeypatch.setattr(lane, "TURN_NS", -10**9)     # spent as soon as it is looked at
    monkeypatch.setattr(lane, "GENERAL_LOOK", 2)     # a look every 2 connections
    clients = attach(loop, b"  V2SUB budget ch\n", 9)
    try:
        answered: list[int] = []
        got = [bytearray() for _ in clients]
        for _ in range(20):
            turn(loop)
            n = 0
            for c, buf in zip(clients, got):
                c.setblocking(False)
                try:
                    buf.extend(c.recv(64))
                except BlockingIOError:
                    pass
                n += len(buf) >= 10          # the OK frame: size, type, "OK"
            answered.append(n)
            if n == len(clients):
                break
        assert answered[-1] == len(clients), answered
        assert answered[0] == 2, answered           # two read in the first turn
        assert all(b[-2:] == b"OK" for b in got)
        steps = [b - a for a, b in zip([0] + answered, answered)]
        assert max(steps) <= 2, answered           # and at most two a turn after it
    finally:
        for c in clients:
            c.close()
