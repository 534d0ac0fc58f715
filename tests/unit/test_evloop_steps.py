"""Step-a-turn work (``SelectorLoop.run_steps``): a generator's first step at once,
then one a turn, in order, the turns between not sleeping; ``done`` with its return
value; a step that raises ends it with ``failed`` (or a log line), the loop going on."""
from __future__ import annotations

import logging
from collections.abc import Generator

import pytest

from pybroker.evloop import SelectorLoop


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
