"""Who writes a pass to consumers at RDY 1 or 2 (server/sendchoice.py): with
``loop_sender = "auto"`` the loop measures both ways and keeps the faster. Driven here
by a simulated flow on a fake clock: each way delivers at its own rate and costs the
loop its own CPU time a message."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pybroker.server.sendchoice import (GAP_NS, HOLD_NS, MARGIN, MIN_MSGS, TRIAL_NS,
                                        SendChoice)


@dataclass
class Way:
    rate: float          # messages a second this way delivers
    cost_ns: float = 5_000.0   # the loop's CPU time a message
    wait_ns: float = 0.0       # the loop's wait for the sender a message (sender only)


class Flow:
    """Passes of ``per_pass`` messages, each way at its own rate; the clock and the
    loop's CPU clock move as that way says."""

    def __init__(self, mode: str, sender: Way, self_: Way, per_pass: int = 20) -> None:
        self.now = 1_000_000_000
        self.cpu = 0
        self.choice = SendChoice(mode, clock=lambda: self.now, cpu=lambda: self.cpu)
        self.ways = {True: sender, False: self_}
        self.per_pass = per_pass
        self.msgs = {True: 0, False: 0}     # messages each way wrote

    def run(self, seconds: float) -> None:
        end = self.now + int(seconds * 1e9)
        while self.now < end:
            self.step()

    def step(self) -> None:
        c = self.choice
        way = self.ways[c.use_sender]
        self.msgs[c.use_sender] += self.per_pass
        if c.use_sender:
            c.waited(int(way.wait_ns * self.per_pass))
        c.passed(self.per_pass)
        self.now += int(self.per_pass * 1e9 / way.rate)
        self.cpu += int(self.per_pass * way.cost_ns)

    def idle(self, seconds: float) -> None:
        self.now += int(seconds * 1e9)


def _never() -> int:
    raise AssertionError("a fixed choice reads no clock")


@pytest.mark.parametrize("mode,sender", [("on", True), ("off", False)])
def test_a_fixed_choice_never_measures(mode: str, sender: bool) -> None:
    c = SendChoice(mode, clock=_never, cpu=_never)
    for _ in range(10_000):
        c.waited(1_000)
        c.passed(20)
        assert c.use_sender is sender
    assert c.rounds == 0


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="loop_sender"):
        SendChoice("sometimes")


@pytest.mark.parametrize("faster", [True, False])
def test_auto_keeps_the_faster_way_and_pays_a_trial_a_round(faster: bool) -> None:
    fast, slow = Way(120_000), Way(92_000)
    f = Flow("auto", sender=fast if faster else slow, self_=slow if faster else fast)
    f.run(2 * TRIAL_NS / 1e9 + 0.01)        # one round: a trial each way
    assert f.choice.rounds == 1
    assert f.choice.use_sender is faster
    f.msgs = {True: 0, False: 0}
    f.run(5 * (HOLD_NS + 2 * TRIAL_NS) / 1e9)
    assert f.choice.rounds >= 5
    # the slower way ran one trial a round: about TRIAL / (HOLD + 2 TRIAL) of the time
    share = f.msgs[not faster] / sum(f.msgs.values())
    assert 0.0 < share < 1.5 * TRIAL_NS / (HOLD_NS + 2 * TRIAL_NS)


def test_rates_within_the_margin_are_decided_by_the_loops_cost() -> None:
    # a load both ways keep up with (the same rate): the sender's way costs the loop
    # less CPU, but its waits for the thread make it dearer in all
    f = Flow("auto", sender=Way(50_000, cost_ns=3_000, wait_ns=4_000),
             self_=Way(50_000, cost_ns=6_000))
    f.run(2 * TRIAL_NS / 1e9 + 0.01)
    assert f.choice.rounds == 1 and f.choice.use_sender is False
    g = Flow("auto", sender=Way(50_000, cost_ns=3_000, wait_ns=1_000),
             self_=Way(50_000, cost_ns=6_000))
    g.run(2 * TRIAL_NS / 1e9 + 0.01)
    assert g.choice.rounds == 1 and g.choice.use_sender is True


def test_a_pause_in_a_trial_starts_the_round_again() -> None:
    # the sender's way is faster, but the flow stops in the middle of its trial: had
    # the idle second counted, it would have measured slower and lost
    f = Flow("auto", sender=Way(120_000), self_=Way(92_000))
    f.run(TRIAL_NS / 2e9)
    f.idle(1.0)
    assert GAP_NS < 1e9
    f.run(2 * TRIAL_NS / 1e9 + 0.01)
    assert f.choice.rounds == 1 and f.choice.use_sender is True


def test_a_trial_of_too_few_messages_is_extended() -> None:
    f = Flow("auto", sender=Way(2_000), self_=Way(1_000), per_pass=1)
    f.run(TRIAL_NS / 1e9 + 0.01)
    assert f.choice.use_sender is True     # still the first trial: under MIN_MSGS
    assert f.msgs[True] < MIN_MSGS
    f.run(2.0)
    assert f.choice.rounds == 1 and f.choice.use_sender is True


def test_the_choice_follows_a_change_of_the_faster_way() -> None:
    sender, self_ = Way(120_000), Way(92_000)
    f = Flow("auto", sender=sender, self_=self_)
    f.run(1.0)
    assert f.choice.use_sender is True
    sender.rate, self_.rate = 80_000, 121_000     # the machine got busier elsewhere
    f.run((HOLD_NS + 2 * TRIAL_NS) / 1e9 + 0.1)
    assert f.choice.use_sender is False


@settings(max_examples=200, deadline=None)
@given(sender=st.floats(5_000, 300_000), self_=st.floats(5_000, 300_000),
       per_pass=st.integers(8, 64))
def test_a_way_faster_by_more_than_the_margin_always_wins(sender: float, self_: float,
                                                          per_pass: int) -> None:
    if max(sender, self_) < min(sender, self_) * MARGIN * 1.02:
        return      # within the margin (and the pass's granularity): a tie
    f = Flow("auto", sender=Way(sender), self_=Way(self_), per_pass=per_pass)
    for _ in range(3):      # three rounds, each order measured first at least once
        rounds = f.choice.rounds
        while f.choice.rounds == rounds:
            f.step()
        assert f.choice.use_sender is (sender > self_)
