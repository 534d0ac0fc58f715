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


def _bucket_of(dt_ns: int) -> int | None:
    """The index of the bucket a turn of dt_ns falls in (the last bound it exceeds), or
    None for a turn within the first bound (counted, in no bucket)."""
    past = [k for k, bound in enumerate(TURN_BUCKETS_NS) if dt_ns > bound]
    return past[-1] if past else None


def _one_turn(loop: SelectorLoop, ms: float) -> int:
    """Run one turn busy for ms and check what it added to turn_times against its own
    time (from total_ns): a busy machine may stretch any turn, an empty one too, into a
    later bucket. Returns that time."""
    tt = loop.turn_times
    turns, total, over, longest = tt.turns, tt.total_ns, list(tt.over), tt.longest_ns
    loop.call_soon_threadsafe(_busy, ms)
    loop.run_once()
    dt = tt.total_ns - total
    added = [a - b for a, b in zip(tt.over, over)]
    assert tt.turns == turns + 1 and dt >= ms * 1e6
    k = _bucket_of(dt)
    if k is None:
        assert sum(added) == 0 and tt.longest_ns == longest
    else:
        assert added[k] == 1 == sum(added) and tt.longest_ns == max(longest, dt)
    return dt


def test_turn_times_count_each_turn_in_its_bucket_and_log_slow_ones(
        caplog: pytest.LogCaptureFixture) -> None:
    """``SelectorLoop.turn_times`` (/metrics' pybroker_loop_turn_seconds): every turn
    counted, its work timed from its events on; a turn past 1 ms in its bucket and the
    longest kept; one past 100 ms logged, then not again for 10 s. Each turn is checked
    against its own measured time (``_one_turn``), never an assumed one."""
    loop = SelectorLoop("test-turns")
    try:
        tt = loop.turn_times
        for _ in range(5):
            _one_turn(loop, 0)
        assert tt.turns == 5
        assert _bucket_of(_one_turn(loop, 7)) is not None     # past 5 ms at least
        with caplog.at_level(logging.WARNING, logger="pybroker"):
            assert _one_turn(loop, 120) > 100e6     # past 100 ms: logged
            assert _one_turn(loop, 110) > 100e6     # again, within 10 s: not
        assert tt.turns == 8 and tt.over[5] + tt.over[6] >= 2 and tt.total_ns >= 237e6
        assert caplog.text.count("a turn took") == 1
        before = (tt.turns, tt.total_ns, list(tt.over), tt.longest_ns)
        copy = tt.copy()
        _one_turn(loop, 0)
        assert (copy.turns, copy.total_ns, copy.over, copy.longest_ns) == before
        assert tt.turns == 9 and copy.over is not tt.over
    finally:
        loop.close()
