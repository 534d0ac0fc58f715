"""Where a follower's fsync runs (pybroker.cluster.syncs.FollowerSyncs), driven as a
state machine with a test clock of durations: an inline fsync over SLOW_NS turns inline
syncing off, and only RESUME_AFTER fast handed fsyncs in a row turn it on again. So a
loop is held by one slow fsync at most until the disk has been fast that long."""
from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from pybroker.cluster.syncs import FollowerSyncs

SLOW = 2_000
RESUME = 4
durations = st.one_of(st.integers(0, SLOW), st.integers(SLOW + 1, 50 * SLOW))


class Syncs(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.p = FollowerSyncs(slow_ns=SLOW, resume_after=RESUME)
        self.fast_run = 0          # fast handed fsyncs in a row since the last slow one
        self.slow_inline_since_resume = 0
        self.inline = self.handed = self.slow = 0

    @rule(ns=durations)
    def sync(self, ns: int) -> None:
        """The node's next fsync, where the policy says it runs."""
        if self.p.inline_on():
            self.p.took_inline(ns)
            self.inline += 1
            if ns > SLOW:
                self.slow += 1
                self.slow_inline_since_resume += 1
                self.fast_run = 0
        else:
            self.p.took_handed(ns)
            self.handed += 1
            self.fast_run = self.fast_run + 1 if ns <= SLOW else 0
            if self.fast_run >= RESUME:
                self.slow_inline_since_resume = 0
                self.fast_run = 0

    @rule(ns=durations)
    def handed_anyway(self, ns: int) -> None:
        """A sync handed over for another reason (its loop serves clients)."""
        was_on = self.p.inline_on()
        self.p.took_handed(ns)
        self.handed += 1
        if was_on:
            assert self.p.inline_on()       # never turns inline syncing off
            return
        self.fast_run = self.fast_run + 1 if ns <= SLOW else 0
        if self.fast_run >= RESUME:
            self.slow_inline_since_resume = 0
            self.fast_run = 0

    @invariant()
    def at_most_one_slow_hold_until_resumed(self) -> None:
        assert self.slow_inline_since_resume <= 1

    @invariant()
    def off_exactly_after_a_slow_hold(self) -> None:
        assert self.p.inline_on() == (self.slow_inline_since_resume == 0)

    @invariant()
    def counts_add_up(self) -> None:
        c = self.p.counts()
        assert (c["inline"], c["handed"], c["slow"], c["inline_on"]) == (
            self.inline, self.handed, self.slow, self.p.inline_on())


TestSyncs = Syncs.TestCase
TestSyncs.settings = settings(max_examples=200, stateful_step_count=60, deadline=None)


def test_a_steady_slow_disk_never_holds_a_loop_twice() -> None:
    p = FollowerSyncs(slow_ns=SLOW, resume_after=RESUME)
    p.took_inline(SLOW + 1)
    for _ in range(1000):
        assert not p.inline_on()
        p.took_handed(SLOW * 3)
    for _ in range(RESUME - 1):
        p.took_handed(SLOW)
        assert not p.inline_on()
    p.took_handed(SLOW)
    assert p.inline_on()
