"""Cross-thread calls (pybroker.evloop.CallQueue) run for about CALLS_BUDGET_NS a turn:
a burst longer than that is spread over the turns after, in order, without the loop
sleeping between them, and a loop that stops runs what its last turn left."""
from __future__ import annotations

import time

from pybroker.evloop import CALLS_BUDGET_NS, SelectorLoop


def _work(ms: float, ran: list[int], i: int) -> None:
    """CPU for about ms milliseconds (a call that costs the loop that long), then note i."""
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass
    ran.append(i)


def test_a_burst_of_calls_is_run_over_several_turns_in_order() -> None:
    loop = SelectorLoop("test-calls")
    try:
        ran: list[int] = []
        each_ms = 0.25
        n = int(4 * CALLS_BUDGET_NS / 1e6 / each_ms)     # about four turns' worth
        for i in range(n):
            loop.call_soon_threadsafe(_work, each_ms, ran, i)
        loop.run_once()
        first = len(ran)
        assert 0 < first < n          # a turn's budget, not the whole burst
        turns = 1
        t0 = time.monotonic()
        while len(ran) < n and turns < 1000:
            loop.run_once()           # (would sleep in poll with nothing queued)
            turns += 1
        assert ran == list(range(n))
        assert turns >= 2
        # the turns after did not sleep: their time is the calls' own
        assert time.monotonic() - t0 < 10
    finally:
        loop.close()


def test_a_stopping_loop_runs_the_calls_its_last_turn_left() -> None:
    loop = SelectorLoop("test-calls-stop")
    ran: list[int] = []
    n = int(4 * CALLS_BUDGET_NS / 1e6 / 0.25)
    loop.call_soon_threadsafe(loop._stop)
    for i in range(n):
        loop.call_soon_threadsafe(_work, 0.25, ran, i)
    loop.start()
    assert loop.stopped.wait(30)
    loop.close()
    assert ran == list(range(n))
