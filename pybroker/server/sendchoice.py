"""Who writes a dispatch pass's frames to consumers at RDY 1 or 2: the event loop
itself, or its sender thread (``EventLoop.deliver``; docs/io.md, "Choosing who writes a
pass"). Which of the two is faster depends on the machine, and by a wide margin:

- on one 2-core VM the sender thread took RDY 1 from 95.6k to 111.6k msg/s, because the
  loop was the bottleneck and the sends' kernel time moved to the other core;
- on another (AMD EPYC under KVM) it took RDY 1 from about 121k down to 92-100k: waking
  the sleeping thread cost the poster 14-38 us a pass, a spinning one took the core the
  consumers needed, and the loop waited for each job about as long as it would have
  taken to write the pass itself.

So with ``loop_sender = "auto"`` (the default) the loop measures both and keeps the
faster. A *trial* runs one way for ``TRIAL_NS`` of passes that the sender could take;
after a trial of each way, the one that delivered more messages a second wins (by more
than ``MARGIN``); when their rates are that close (a load that is not saturating the
loop: both keep up), the one that cost the loop less time a message wins (its CPU time
plus the time it waited for the sender's jobs). The winner is kept for ``HOLD_NS``,
then both are measured again, in the other order. A gap of more than ``GAP_NS`` between
two such passes (the flow stopped or changed) starts the trial again, so an idle
stretch never counts as a slow rate. ``"on"`` and ``"off"`` fix the choice.

Cost: a clock read per pass the sender could take, a CPU-clock read per trial; the
losing way runs for one trial in every ``HOLD_NS + 2 * TRIAL_NS``.
"""
from __future__ import annotations

import time
from typing import Callable

from pybroker.config import LOOP_SENDER_MODES

TRIAL_NS = 250_000_000      # each way measured this long
HOLD_NS = 5_000_000_000     # the faster way kept this long, then both measured again
GAP_NS = 50_000_000         # passes further apart than this: the trial starts again
MARGIN = 1.05               # rates closer than this are a tie: the cheaper way wins
MIN_MSGS = 1_000            # a trial with fewer messages is extended (too few to judge)


class SendChoice:
    """Per event loop: ``use_sender`` says who writes the next such pass; the loop
    calls ``passed(msgs)`` after each pass the sender could take (``msgs`` messages,
    written whichever way) and ``waited(ns)`` for the time it waited for a job."""

    __slots__ = ("fixed", "use_sender", "_clock", "_cpu", "_state", "_until", "_start",
                 "_last", "_cpu0", "_msgs", "_waited", "_first", "_result", "_rounds")

    def __init__(self, mode: str = "auto",
                 clock: Callable[[], int] = time.monotonic_ns,
                 cpu: Callable[[], int] = time.thread_time_ns) -> None:
        if mode not in LOOP_SENDER_MODES:
            raise ValueError(f"loop_sender: {mode!r} is not one of "
                             f"{', '.join(LOOP_SENDER_MODES)}")
        self.fixed = mode != "auto"
        self.use_sender = mode != "off"
        self._clock = clock
        self._cpu = cpu       # the loop thread's CPU time (it calls passed)
        self._state = "trial"   # "trial" (first way), "second" (the other), "hold"
        self._until = 0       # when the current trial or hold ends (0: not started)
        self._start = 0
        self._last = 0
        self._cpu0 = 0
        self._msgs = 0
        self._waited = 0
        self._first = True    # the way the next round measures first
        # the first trial's (rate, cost) while the second runs
        self._result: tuple[float, float] = (0.0, 0.0)
        self._rounds = 0      # rounds of trials decided

    def waited(self, ns: int) -> None:
        self._waited += ns

    def passed(self, msgs: int) -> None:
        if self.fixed:
            return
        now = self._clock()
        if self._until == 0 or (self._state != "hold" and now - self._last > GAP_NS):
            # the first pass, or the flow stopped: the round starts again, first way
            self.use_sender = self._first
            self._begin(now, "trial")
        self._last = now
        if self._state == "hold":
            if now >= self._until:
                self._first = not self._first
                self.use_sender = self._first
                self._begin(now, "trial")
            return
        self._msgs += msgs
        if now < self._until or self._msgs < MIN_MSGS:
            return
        wall = now - self._start
        result = (self._msgs * 1e9 / wall,
                  (self._cpu() - self._cpu0 + self._waited) / self._msgs)
        if self._state == "trial":
            self._result = result
            self.use_sender = not self.use_sender
            self._begin(now, "second")
            return
        # use_sender is the second way, result its measure; _result the first's
        self.use_sender = self.use_sender == self._better(result, self._result)
        self._rounds += 1
        self._state = "hold"
        self._until = now + HOLD_NS

    @staticmethod
    def _better(a: tuple[float, float], b: tuple[float, float]) -> bool:
        """Is way a (rate, cost) better than way b?"""
        if a[0] > b[0] * MARGIN:
            return True
        if b[0] > a[0] * MARGIN:
            return False
        return a[1] <= b[1]

    def _begin(self, now: int, state: str) -> None:
        self._state = state
        self._until = now + TRIAL_NS
        self._start = now
        self._cpu0 = self._cpu()
        self._msgs = 0
        self._waited = 0

    @property
    def rounds(self) -> int:
        """Rounds of trials decided so far."""
        return self._rounds
