"""A channel's skip (pybroker.core.skip.Skip): one array read from a head index, driven
as a state machine beside a deque of the same offsets (what skip was before), with the
shorter copies made after a few offsets so that they happen within a run."""
from __future__ import annotations

import array
from collections import deque

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import pybroker.core.skip as skip_mod
from pybroker.core.skip import Skip

offsets = st.lists(st.integers(0, 400), unique=True).map(sorted)


class SkipMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self._compact_at = skip_mod.COMPACT_AT
        skip_mod.COMPACT_AT = 4
        self.model: deque[int] = deque()
        self.s = Skip()
        self.copies: list[tuple[array.array[int], list[int]]] = []

    def teardown(self) -> None:
        skip_mod.COMPACT_AT = self._compact_at

    @initialize(offs=offsets, as_array=st.booleans())
    def start(self, offs: list[int], as_array: bool) -> None:
        self.model = deque(offs)
        self.s = Skip(array.array("q", offs) if as_array else offs)

    @rule(offs=offsets)
    def replaced(self, offs: list[int]) -> None:
        """A rewind or a restore: a new skip."""
        self.model = deque(offs)
        self.s = Skip(array.array("q", offs))

    @precondition(lambda self: bool(self.model))
    @rule()
    def popleft(self) -> None:
        assert self.s.first() == self.model[0]
        assert self.s.popleft() == self.model.popleft()

    @rule(to=st.integers(-1, 420))
    def drop_below(self, to: int) -> None:
        self.s.drop_below(to)
        while self.model and self.model[0] < to:
            self.model.popleft()

    @rule(lo=st.integers(-1, 420), hi=st.integers(-1, 420))
    def between(self, lo: int, hi: int) -> None:
        assert list(self.s.span(lo, hi)) == [o for o in self.model if lo <= o <= hi]
        if self.model:
            assert self.s.last() == self.model[-1]
        else:
            with pytest.raises(IndexError):
                self.s.last()

    @rule()
    def copied(self) -> None:
        """A snapshot's copy, which later changes must not reach."""
        self.copies.append((self.s.copy(), list(self.model)))

    @rule()
    def iterate_while_popping(self) -> None:
        """An iterator taken now sees the offsets of now, whatever is taken off after
        (/stats iterates skip; the array is never changed in place)."""
        it = iter(self.s)
        want = list(self.model)
        if self.s:
            self.s.popleft()
            self.model.popleft()
        assert list(it) == want

    @invariant()
    def same(self) -> None:
        assert len(self.s) == len(self.model)
        assert bool(self.s) == bool(self.model)
        assert list(self.s) == list(self.model) == self.s.tolist()
        for copy, then in self.copies:
            assert copy.tolist() == then

    @invariant()
    def bounded(self) -> None:
        """What is behind the head is under COMPACT_AT offsets or half the array."""
        a, i = self.s._a, self.s._i
        assert i < skip_mod.COMPACT_AT or 2 * i < len(a)
        if not self.model:
            assert i == 0 and len(a) == 0     # all passed: nothing held


TestSkip = SkipMachine.TestCase
TestSkip.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


def test_empty_skip_raises_on_first_and_popleft() -> None:
    s = Skip()
    with pytest.raises(IndexError):
        s.first()
    with pytest.raises(IndexError):
        s.popleft()
    assert not s and len(s) == 0 and list(s) == []


def test_all_passed_frees_the_array() -> None:
    s = Skip(range(10))
    s.drop_below(100)
    assert not s and len(s._a) == 0 and s._i == 0
