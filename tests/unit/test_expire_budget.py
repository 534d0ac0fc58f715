"""A queue scan's results are requeued about EXPIRE_TURN messages a turn
(``EventLoop.on_expired``): 250,000 messages timing out at once took the loop 43 ms in
one turn (loadtest/bench_snapshot.py's channel, 100 consumers at RDY 2,500). A real
Runtime in this process, its loop turned by the test; the channel is a recorder of
what each turn hands it, so that the slices can be checked one by one."""
from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from pybroker.server import loop as loop_mod
from pybroker.runtime import Runtime
from tests.support.inproc import temp_runtime, turn


class _Flight:
    def __init__(self, first: int, n: int) -> None:
        self.first, self.n = first, n


class _Channel:
    """What on_expired needs of a channel: requeue_expired and deleted."""

    def __init__(self) -> None:
        self.deleted = False
        self.calls: list[tuple[list[_Flight], list[tuple[int, int, int]]]] = []

    def requeue_expired(self, timed_out: list[_Flight],
                        due: list[tuple[int, int, int]]) -> None:
        self.calls.append((timed_out, due))

    def dispatch(self, now_ns: int, wall_ns: int) -> bool:   # (a dirty channel's turn)
        return False


@pytest.fixture
def rt() -> Iterator[Runtime]:
    with temp_runtime("expire-") as r:
        yield r


@pytest.mark.parametrize("flights,size,due", [
    (100, 2_500, 0),            # 100 consumers at RDY 2,500 timing out together
    (3, 40_000, 0),             # flights larger than a turn's budget: one a turn
    (0, 0, 50_000),             # deferred messages due together
    (10, 2_000, 30_000),        # both
    (2, 10, 5),                 # a small scan: one turn
])
def test_a_large_scan_is_requeued_in_slices_one_a_turn(rt: Runtime, flights: int, size: int,
                                                       due: int) -> None:
    loop = rt.loops[0]
    budget = loop_mod.EXPIRE_TURN
    ch = _Channel()
    timed_out = [_Flight(k * size, size) for k in range(flights)]
    dues = [(1_000_000 + k, 1, 0) for k in range(due)]
    loop.on_expired(ch, timed_out, dues)  # type: ignore[arg-type]
    deadline = time.monotonic() + 10        # (the next slice's timer: due at once)
    while sum(len(a) + len(b) for a, b in ch.calls) < flights + due:
        assert time.monotonic() < deadline, "the slices stopped coming"
        before = len(ch.calls)
        turn(loop)
        assert len(ch.calls) <= before + 1          # at most one slice a turn
    # everything once, in order
    assert [f for a, _ in ch.calls for f in a] == timed_out
    assert [d for _, b in ch.calls for d in b] == dues
    sizes = [sum(f.n for f in a) + len(b) for a, b in ch.calls]
    for (a, _), n in zip(ch.calls, sizes):
        # within the budget, but for its last flight (a flight is never split)
        assert 0 < n and (n <= budget or a and n - a[-1].n < budget), (n, budget)
    assert all(n >= budget for n in sizes[:-1]), sizes     # none cut short
