"""The in-flight table (pybroker/_native/inflight.py, csrc/inflight.c) against a dict
of offset -> flight, the structure it replaced: a Hypothesis state machine adds flights
of one and of many messages (a pass of more than SMALL flights takes the batched call),
FINs runs of several clients (their own offsets, others', ones not in flight, twice the
same), pops, takes timed-out flights and clears; after each step every reading of the
table equals the dict's (``sorted_from`` too, which a rewind takes). Run on the C table and on the pure-Python one."""
from __future__ import annotations

import array

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

from pybroker._native import inflight as mod
from pybroker._native.inflight import InFlight, InFlightCopy

C_BUILT = mod._C


class Client:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


class F:
    """A flight as the table sees one."""

    def __init__(self, client: Client | None, first: int, n: int, attempts: int = 1) -> None:
        self.client = client
        self.first = first
        self.n = n
        self.slot = -1
        self.attempts = attempts

    def __repr__(self) -> str:
        return f"F({self.client}, {self.first}+{self.n})"


CLIENTS = [Client("a"), Client("b"), Client("c"), None]


class InFlightMachine(RuleBasedStateMachine):
    pure = False

    @initialize()
    def start(self) -> None:
        self.t: InFlight[F] = InFlight(pure=self.pure)
        self.model: dict[int, F] = {}
        self.known: list[F] = []
        self.next = 0
        self.copies: list[tuple[InFlightCopy[F], list[tuple[int, int]]]] = []

    def _free_offsets(self, start: int, n: int) -> bool:
        return all(o not in self.model for o in range(start, start + n))

    @rule(sizes=st.lists(st.sampled_from([1, 1, 2, 3, 8, 40]), min_size=1, max_size=14),
          who=st.lists(st.integers(0, 3), min_size=14, max_size=14),
          gap=st.integers(0, 3), reuse=st.booleans())
    def add(self, sizes: list[int], who: list[int], gap: int, reuse: bool) -> None:
        # new offsets past the last ones, or (reuse) finished ones again from 0 on
        at = 0 if reuse else self.next + gap
        flights = []
        for k, n in enumerate(sizes):
            while not self._free_offsets(at, n) or any(
                    f.first < at + n and at < f.first + f.n for f in flights):
                at += 1
            flights.append(F(CLIENTS[who[k]], at, n))
            at += n
        self.t.add_flights(flights)
        for f in flights:
            for o in range(f.first, f.first + f.n):
                self.model[o] = f
        self.known += flights
        self.next = max(self.next, at)

    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        offs = sorted(self.model)
        pick = st.sampled_from(offs) if offs else st.integers(0, 5)
        runs = data.draw(st.lists(st.tuples(
            st.sampled_from(CLIENTS),
            st.lists(st.one_of(pick, st.integers(-2, self.next + 3)), max_size=12)),
            min_size=1, max_size=10))
        want_bad = []
        want_gone = []
        for client, run in runs:
            bad = []
            for i, off in enumerate(run):
                f = self.model.get(off)
                if f is None:
                    bad.append((i, False))
                elif f.client is not client:
                    bad.append((i, True))
                else:
                    del self.model[off]
                    if all(self.model.get(o) is not f for o in range(f.first, f.first + f.n)):
                        want_gone.append(f)
            want_bad.append(bad)
        got_bad, got_gone = self.t.finish(runs)
        assert got_bad == want_bad
        assert sorted(map(id, got_gone)) == sorted(map(id, want_gone))

    @rule(data=st.data())
    def finish_singles(self, data: st.DataObject) -> None:
        # one offset per client, in order: their own single flights go, until the first
        # that is not one; from there on all stay
        offs = sorted(self.model)
        pick = st.sampled_from(offs) if offs else st.integers(0, 5)
        pairs = data.draw(st.lists(st.tuples(st.sampled_from(CLIENTS),
                                             st.one_of(pick, st.integers(-2, self.next + 3))),
                                   min_size=1, max_size=10))
        clients = [c for c, _ in pairs]
        offsets = [o for _, o in pairs]
        want_gone = []
        want_rest: list[int] = []
        for i, (client, off) in enumerate(pairs):
            f = self.model.get(off)
            if f is None or f.n != 1 or f.client is not client:
                want_rest = list(range(i, len(pairs)))   # the rest: left for finish()
                break
            del self.model[off]
            want_gone.append(f)
        gone, rest = self.t.finish_singles(clients, offsets)
        assert [id(f) for f in gone] == [id(f) for f in want_gone]
        assert rest == want_rest

    @rule(data=st.data())
    def pop(self, data: st.DataObject) -> None:
        off = data.draw(st.sampled_from(sorted(self.model)) if self.model
                        else st.integers(0, 5))
        f = self.model.pop(off, None)
        if f is None:
            with pytest.raises(KeyError):
                self.t.pop(off)
            return
        got, gone = self.t.pop(off)
        assert got is f
        assert gone == all(self.model.get(o) is not f for o in range(f.first, f.first + f.n))

    @precondition(lambda self: self.known)
    @rule(data=st.data())
    def take(self, data: st.DataObject) -> None:
        f = data.draw(st.sampled_from(self.known))
        want = [o for o in range(f.first, f.first + f.n) if self.model.get(o) is f]
        for o in want:
            del self.model[o]
        assert self.t.take(f) == want

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def touch(self, data: st.DataObject) -> None:
        # a TOUCHed message of a larger flight gets a flight of its own
        off = data.draw(st.sampled_from(sorted(self.model)))
        f = self.model[off]
        self.t.pop(off)
        single = F(f.client, off, 1)
        self.t.add_flights([single])
        self.model[off] = single
        self.known.append(single)

    @rule()
    def clear(self) -> None:
        self.t.clear()
        self.model.clear()
        self.known = []

    @rule()
    def copy(self) -> None:
        # a snapshot's copy (Lifecycle.snapshot_parts): kept, checked after later changes
        self.copies.append((self.t.copy(), sorted((o, id(f)) for o, f in self.model.items())))

    @invariant()
    def copies_keep_what_was_in_flight(self) -> None:
        now = self.t.copy()
        mine = sorted((o, id(f)) for o, f in self.model.items())
        assert now == self.t.copy() and len(now) == len(self.model)
        for c, then in self.copies:
            assert sorted((o, id(f)) for o, f in c.items()) == then
            if c == now:                  # equal copies: the same contents
                assert then == mine

    @invariant()
    def sorted_from_is_the_sorted_offsets_from_there(self) -> None:
        more = [3, self.next, self.next, 0]
        for at in (0, 1, self.next // 2, self.next + 1):
            want = sorted({o for o in self.model if o >= at} | {o for o in more if o >= at})
            got = self.t.sorted_from(at, array.array("q", more))
            assert got.typecode == "q" and list(got) == want

    @invariant()
    def same_as_the_dict(self) -> None:
        model = self.model
        assert len(self.t) == len(model) and bool(self.t) == bool(model)
        assert sorted(self.t) == sorted(model)
        assert sorted((o, id(f)) for o, f in self.t.items()) == \
            sorted((o, id(f)) for o, f in model.items())
        assert self.t.min() == (min(model) if model else -1)
        for o in range(-1, self.next + 2):
            assert self.t.get(o) is model.get(o)
            assert (o in self.t) == (o in model)
        live = {id(f): 0 for f in self.known}
        for f in model.values():
            live[id(f)] += 1
        for f in self.known:
            assert self.t.live(f) == live[id(f)]
        assert sorted(map(id, self.t.flights())) == sorted(
            {id(f) for f in model.values()})


@pytest.mark.skipif(not C_BUILT, reason="C codec not built (or PYBROKER_PURE=1)")
class TestCTable(InFlightMachine.TestCase):
    settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


class PureMachine(InFlightMachine):
    pure = True


class TestPureTable(PureMachine.TestCase):
    settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


@pytest.mark.parametrize("pure", [False, True])
def test_a_large_table_grows_and_shrinks_back(pure: bool) -> None:
    # 100,000 in flight (flights of 2,500, strided offsets too), then all finished:
    # lookups right at every size, and the C arrays back to a small table
    if not pure and not C_BUILT:
        pytest.skip("C codec not built")
    t: InFlight[F] = InFlight(pure=pure)
    a, b = CLIENTS[0], CLIENTS[1]
    flights = [F(a if k % 2 else b, k * 2500, 2500) for k in range(20)]
    strided = [F(a, 1_000_000 + k * 4096, 2) for k in range(25_000)]
    t.add_flights(flights)
    t.add_flights(strided)
    assert len(t) == 100_000
    assert t.get(1_000_000 + 4096 * 7 + 1) is strided[7] and t.get(1_000_000 + 2) is None
    runs = [(f.client, list(range(f.first, f.first + f.n))) for f in flights]
    bad, gone = t.finish(runs)
    assert bad == [[]] * 20 and len(gone) == 20
    bad, gone = t.finish([(a, [f.first, f.first + 1]) for f in strided])
    assert not any(bad) and len(gone) == 25_000
    assert len(t) == 0 and not t and t.min() == -1
    if not pure:
        assert t._t.t.cap <= 4096     # shrunk as it emptied
    t.add_flights([F(a, 7, 3)])
    assert sorted(t) == [7, 8, 9]


def test_an_offset_put_in_flight_twice_is_refused_loudly() -> None:
    # a bug in the caller, never a silent second owner (the dict it replaced overwrote)
    t: InFlight[F] = InFlight()
    t.add_flights([F(CLIENTS[0], 10, 4)])
    with pytest.raises(RuntimeError, match="twice"):
        t.add_flights([F(CLIENTS[1], 12, 4)])


@pytest.mark.parametrize("pure", [False, True])
def test_fins_of_many_clients_with_no_offset_on_a_new_table(pure: bool) -> None:
    # more runs than the one-call path takes, none naming an offset (found by the
    # machine above: the C table's output arrays did not exist yet)
    t: InFlight[F] = InFlight(pure=pure)
    assert t.finish([(CLIENTS[0], [])] * 9) == ([[]] * 9, [])


@pytest.mark.skipif(not mod._SORT, reason="the compiled module is not built")
def test_the_radix_sort_keeps_the_offsets_from_there_once_each() -> None:
    """nsqf_sort_from on spans that need one, two, three and six passes, repeats and an
    offset past them all."""
    import random
    from pybroker._native import _ffi, _lib
    rnd = random.Random(7)
    for span in (100, 3000, 1 << 30, 1 << 62):
        vals = [rnd.randrange(span) for _ in range(5000)] + [span // 2] * 3
        for at in (0, span // 3, span + 1):
            a = _ffi.new("int64_t[]", vals)
            tmp = _ffi.new("int64_t[]", len(vals))
            kept = _lib.nsqf_sort_from(a, tmp, len(vals), at)
            assert list(_ffi.unpack(a, kept)) == sorted({v for v in vals if v >= at})


@pytest.mark.parametrize("pure", [False, True])
def test_a_tables_dump_sorted_by_offset_keeps_each_offsets_slot(
        pure: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``sorted_pairs`` (nsqf_sort_pairs, else Python's sort) on spans that need one to
    six passes, and the copy's entries: the table's in offset order after the flights
    of one."""
    import random
    if not pure and not mod._SORT_PAIRS:
        pytest.skip("the compiled module is not built")
    if pure:
        monkeypatch.setattr(mod, "_SORT_PAIRS", False)
    rnd = random.Random(11)
    for span in (1, 100, 3000, 1 << 30, 1 << 62):
        for n in (0, 1, 2, 1000, 20_000):
            keys = rnd.sample(range(span), min(n, span))
            vals = [rnd.randrange(-(1 << 31), 1 << 31) for _ in keys]
            k, v = mod.sorted_pairs(array.array("q", keys).tobytes(),
                                    array.array("i", vals).tobytes())
            assert list(zip(k, v)) == sorted(zip(keys, vals))
    t: InFlight[F] = InFlight(pure=pure)
    flights = [F(CLIENTS[k % 2], 10_000 - k * 7, 3, 1 + k % 5) for k in range(500)]
    t.add_flights(flights)
    t.add_flights([F(CLIENTS[0], 20_000, 1)])
    t.add_flights([F(CLIENTS[1], 20_001, 1)])
    items = t.copy().items()
    offs = [off for off, _ in items]
    assert sorted(offs) == sorted(t)
    assert all(f is t.get(off) for off, f in items)
    entries = t.copy().entries()
    by_off = dict(items)
    table = [off for off, _, _ in entries if by_off[off].n > 1]
    assert table == sorted(table)
    assert entries == [(off, by_off[off].attempts, 0) for off, _, _ in entries]
    assert sorted(entries) == sorted((off, f.attempts, 0) for off, f in items)
    assert [off for off, _, _ in entries[:2]] == [20_000, 20_001]   # the flights of one


@pytest.mark.parametrize("pure", [False, True])
def test_the_order_that_sorts_a_list_by_its_offsets(
        pure: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``sort_order`` (nsqf_sort_order, else Python's sort): the keys sorted in place
    and the index each had, equal keys in their order; None for keys in order
    already (a channel state's entries, core/lifecycle.py ``pending_chunks``)."""
    import random
    if not pure and not mod._SORT_ORDER:
        pytest.skip("the compiled module is not built")
    if pure:
        monkeypatch.setattr(mod, "_SORT_ORDER", False)
    rnd = random.Random(3)
    for span in (1, 50, 3000, 1 << 40):
        for n in (0, 1, 2, 1000):
            keys = [rnd.randrange(span) for _ in range(n)]
            a = array.array("q", keys)
            order = mod.sort_order(a)
            want = sorted(range(n), key=keys.__getitem__)      # stable
            if want == list(range(n)):
                assert order is None and list(a) == keys
            else:
                assert order is not None and list(order) == want
                assert list(a) == [keys[i] for i in want]


@pytest.mark.parametrize("pure", [False, True])
def test_a_copys_columns_are_its_entries_as_two_arrays(
        pure: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``gather`` (nsqf_gather_i32, else a Python pass): each index's value, 0 for one
    outside the table; ``InFlightCopy.columns``: the offsets and attempts of
    ``entries``, as arrays (the table's attempts gathered by slot)."""
    import random
    if not pure and not mod._GATHER:
        pytest.skip("the compiled module is not built")
    if pure:
        monkeypatch.setattr(mod, "_GATHER", False)
    rnd = random.Random(17)
    for size in (0, 1, 7, 5000):
        table = array.array("i", [rnd.randrange(-(1 << 31), 1 << 31) for _ in range(size)])
        idx = array.array("i", [rnd.randrange(-3, size + 3) for _ in range(2000)])
        want = [table[k] if 0 <= k < size else 0 for k in idx]
        assert list(mod.gather(table, idx)) == want
        assert list(mod.gather(table, array.array("i"))) == []
    t: InFlight[F] = InFlight(pure=pure)
    t.add_flights([F(CLIENTS[k % 2], 50_000 - k * 9, 4, 1 + k % 7) for k in range(300)])
    t.add_flights([F(CLIENTS[0], 90_000 + k, 1, 2 + k % 3) for k in range(40)])
    for off in list(t)[::5]:
        t.pop(off)                  # holes in the flights, and flights of one gone
    copy = t.copy()
    offs, attempts = copy.columns()
    assert offs.typecode == "q" and attempts.typecode == "i"
    assert sorted(zip(offs, attempts, [0] * len(offs))) == sorted(copy.entries())
    assert len(offs) == len(copy) > 0
