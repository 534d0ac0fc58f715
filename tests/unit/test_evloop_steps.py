"""Step-a-turn work (``SelectorLoop.run_steps``): a generator's first step at once,
then one a turn, in order, the turns between not sleeping; ``done`` with its return
value; a step that raises ends it with ``failed`` (or a log line), the loop going on."""
from __future__ import annotations

import logging
import time
from collections.abc import Generator

import pytest

from pybroker.evloop import TURN_BUCKETS_NS, SelectorLoop


def _steps(n: int, ran: list[tuple[int, int]], turns: list[int]) -> Generator[None, None, int]:
    for i in range(n):
        ran.append((i, turns[0]))
        if i == n - 1:
            break
        yield
    return n * 10


def test_one_step_a_turn_then_done_with_the_value() -> None:
    loop = SelectorLoop("test-steps")
    try:
        ran: list[tuple[int, int]] = []
        turns = [0]
        got: list[int] = []
        loop.run_steps(_steps(4, ran, turns), got.append)
        assert ran == [(0, 0)] and got == []          # the first step at once
        while not got and turns[0] < 100:
            turns[0] += 1
            loop.run_once()          # (a turn with nothing else to do does not sleep:
            #                           the next step's timer is due)
        assert ran == [(0, 0), (1, 1), (2, 2), (3, 3)]
        assert got == [40]
        loop.run_steps(_steps(1, ran, turns), got.append)    # one step: done at once
        assert got == [40, 10]
    finally:
        loop.close()


def test_a_failing_step_ends_it_and_the_loop_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    def bad() -> Generator[None, None, None]:
        yield
        raise RuntimeError("step two")

    loop = SelectorLoop("test-steps-fail")
    try:
        failed: list[BaseException] = []
        done: list[object] = []
        loop.run_steps(bad(), done.append, failed.append)
        loop.run_once()
        assert done == [] and [str(e) for e in failed] == ["step two"]
        with caplog.at_level(logging.ERROR, logger="pybroker"):
            loop.run_steps(bad(), done.append)      # no failed: logged
            loop.run_once()
        assert "a step of" in caplog.text and "step two" in caplog.text
        after: list[int] = []
        loop.call_later(0, after.append, 1)
        loop.run_once()
        assert after == [1] and done == []
    finally:
        loop.close()


def _busy(ms: float) -> None:
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass


def _bucket_of(dt_ns: int) -> int:
    """The index of the bucket a turn of dt_ns falls in: the last bound it exceeds."""
    return max(k for k, bound in enumerate(TURN_BUCKETS_NS) if dt_ns > bound)


def _one_turn(loop: SelectorLoop, ms: float) -> tuple[int, list[int]]:
    """Run one turn busy for ms; its time (from total_ns) and what it added to over."""
    tt = loop.turn_times
    total, over = tt.total_ns, list(tt.over)
    loop.call_soon_threadsafe(_busy, ms)
    loop.run_once()
    return tt.total_ns - total, [a - b for a, b in zip(tt.over, over)]


def test_turn_times_count_each_turn_in_its_bucket_and_log_slow_ones(
        caplog: pytest.LogCaptureFixture) -> None:
    """``SelectorLoop.turn_times`` (/metrics' pybroker_loop_turn_seconds): every turn
    counted, its work timed from its events on; a turn past 1 ms in its bucket and the
    longest kept; one past 100 ms logged, then not again for 10 s. A busy machine may
    stretch a turn into a later bucket: each turn is checked against its own time."""
    loop = SelectorLoop("test-turns")
    try:
        tt = loop.turn_times
        for _ in range(5):
            loop.call_soon_threadsafe(lambda: None)
            loop.run_once()
        assert tt.turns == 5 and sum(tt.over) == 0 and tt.longest_ns == 0
        dt, added = _one_turn(loop, 7)
        assert dt >= 7e6 and _bucket_of(dt) >= 1
        assert added[_bucket_of(dt)] == 1 == sum(added) and tt.longest_ns == dt
        with caplog.at_level(logging.WARNING, logger="pybroker"):
            dt1, added1 = _one_turn(loop, 120)      # past 100 ms: logged
            dt2, added2 = _one_turn(loop, 110)      # again, within 10 s: not
        for d, a in ((dt1, added1), (dt2, added2)):
            assert d >= 100e6 and a[_bucket_of(d)] == 1 == sum(a)
        assert sum(tt.over) == 3 and tt.turns == 8
        assert tt.longest_ns == max(dt, dt1, dt2) and tt.total_ns >= 237e6
        assert caplog.text.count("a turn took") == 1
        copy = tt.copy()
        loop.call_soon_threadsafe(lambda: None)
        loop.run_once()
        assert copy.turns == 8 and tt.turns == 9 and copy.over == tt.over
    finally:
        loop.close()
