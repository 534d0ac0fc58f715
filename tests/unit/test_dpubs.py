"""DpubIndex (pybroker/core/dpubs.py): a topic's DPUBs not yet read by every channel,
with the count of those not yet due in a range answered by chunks. A Hypothesis state
machine holds it to a plain dict, counted one by one, over the operations the broker
makes (publishes in rising order, a truncation's removal from the end, pruning from the
start in steps, clearing), with chunks small enough to be crossed often."""
from __future__ import annotations

import array

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import pybroker.core.dpubs as dpubs
from pybroker.core.dpubs import DpubIndex

DUES = st.integers(0, 40)


class DpubMachine(RuleBasedStateMachine):
    @initialize(seed=st.lists(st.tuples(st.integers(0, 300), DUES), max_size=30))
    def start(self, seed: list[tuple[int, int]]) -> None:
        self.model: dict[int, int] = dict(seed)
        self.d = DpubIndex(seed)
        self.next = max(self.model, default=0) + 1

    @rule(gap=st.integers(0, 20), dues=st.lists(DUES, min_size=1, max_size=40))
    def publish(self, gap: int, dues: list[int]) -> None:
        at = self.next + gap
        for k, due in enumerate(dues):
            self.d[at + k] = due
            self.model[at + k] = due
        self.next = at + len(dues)

    @rule(off=st.integers(0, 400), due=DUES)
    def set_any(self, off: int, due: int) -> None:
        # an offset out of order, or one set again
        self.d[off] = due
        self.model[off] = due
        self.next = max(self.next, off + 1)

    @rule(end=st.integers(0, 400))
    def truncate(self, end: int) -> None:
        for off in list(self.d.irange(end, None)):
            del self.d[off]
        for off in [o for o in self.model if o >= end]:
            del self.model[off]

    @rule(below=st.integers(0, 450), most=st.one_of(st.none(), st.integers(1, 50)))
    def prune(self, below: int, most: int | None) -> None:
        want = sorted(o for o in self.model if o < below)[:most]
        assert self.d.drop_below(below, most) == len(want)
        for off in want:
            del self.model[off]

    @rule()
    def clear(self) -> None:
        self.d.clear()
        self.model.clear()

    @invariant()
    def same_as_the_dict(self) -> None:
        model = self.model
        assert self.d.items() == sorted(model.items())
        assert len(self.d) == len(model) and bool(self.d) == bool(model)
        for off in range(0, self.next + 2, 7):
            assert self.d.get(off, -1) == model.get(off, -1)

    @invariant()
    def counts_as_one_by_one(self) -> None:
        model = self.model
        for lo, hi, wall in ((0, self.next + 1, 20), (3, 90, 10), (50, 51, 0),
                             (17, self.next, 39), (200, 100, 5)):
            want = sum(1 for o, due in model.items() if lo <= o < hi and due > wall)
            assert self.d.not_due(lo, hi, wall) == want, (lo, hi, wall)
        assert list(self.d.irange(10, 60, inclusive=(True, False))) == \
            sorted(o for o in model if 10 <= o < 60)
        # a rewind's skip against them: the DPUBs among its offsets, with their times
        for asked in ([], [5], list(range(0, self.next + 3, 3)), sorted(model)[1::2],
                      list(range(self.next, self.next + 9))):
            offs, ats = self.d.among(memoryview(array.array("q", asked)))
            want = [o for o in asked if o in model]
            assert list(offs) == want and list(ats) == [model[o] for o in want]


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dpubs, "CHUNK_BITS", 4)
    monkeypatch.setattr(dpubs, "CHUNK", 16)


def test_the_index_is_the_dict_it_replaces(small_chunks: None) -> None:
    DpubMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                             deadline=None)
    DpubMachine.TestCase().runTest()


def test_every_prune_boundary_keeps_the_counts(small_chunks: None) -> None:
    """Offsets 0..79 over chunks of 16, some missing; pruned below each point, with and
    without a step limit: the counts of what is left are the dict's."""
    seed = [(o, o % 5) for o in range(80) if o % 11 != 3]
    for below in range(82):
        for most in (None, 1, 7, 16, 17):
            d = DpubIndex(seed)
            model = dict(seed)
            want = sorted(o for o in model if o < below)[:most]
            assert d.drop_below(below, most) == len(want)
            for o in want:
                del model[o]
            for wall in (-1, 2):
                for lo, hi in ((0, 100), (15, 33), (31, 49), (47, 80)):
                    assert d.not_due(lo, hi, wall) == sum(
                        1 for o, due in model.items() if lo <= o < hi and due > wall), \
                        (below, most, wall, lo, hi)


def test_a_million_dpubs_are_counted_and_pruned_in_steps() -> None:
    """1,000,000 DPUBs an hour away (chunks of the real size): the count a channel's
    /stats makes, and pruning in steps, as the topic does (the times: docs/storage.md
    and loadtest/bench_snapshot.py's ``--dpubs``)."""
    d = DpubIndex()
    for off in range(1_000_000):
        d[off] = 3_600 + off % 7
    want = sum(1 for o in range(10, 999_990) if o % 7 > 2)
    assert d.not_due(10, 999_990, 3_602) == want
    assert d.not_due(10, 999_990, 3_599) == 999_980
    assert d.drop_below(600_000, 32_768) == 32_768
    assert d.peekitem(0) == (32_768, 3_600 + 32_768 % 7)
    while d.drop_below(600_000, 32_768):
        pass
    assert len(d) == 400_000 and d.peekitem(0)[0] == 600_000
    assert d.not_due(0, 2_000_000, 0) == 400_000
