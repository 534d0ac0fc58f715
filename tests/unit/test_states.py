"""pybroker.cluster.states: a leader's channel states shipped in parts and a follower's
copy of them. A Hypothesis state machine runs a leader's Replica (its versions and the
parts it answers) and a follower that fetches at any time, misses versions, comes back
knowing nothing, and checks that what the follower holds is the leader's states; the
hostile cases (parts outside the frame, runs outside what is held, sizes that do not
add up) are refused with ValueError, and a follower then asks for everything."""
from __future__ import annotations

import json
import logging
import struct
from types import SimpleNamespace
from typing import Any, cast

import pytest

from pybroker.evloop import SelectorLoop
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from pybroker.cluster import states, takeover
from pybroker.cluster import replica as replica_mod
from pybroker.cluster.replica import FOLLOWER, Replica
from pybroker.cluster.rules import EpochHistory
from pybroker.cluster.states import (Held, Part, delta, joined, ops_of, parts_of, ship,
                                     take, whole)
from pybroker.core.deferred import CHUNK, DeferredSet
from pybroker.core.lifecycle import ChannelState, deferred_states, state_floor
from pybroker.jsonvalue import PartTexts, dumps_keyed
from tests.unit.test_channel import WALL, make_topic

NOW = 5_000_000_000

NAMES = ("a", "b", "c")
offsets = st.integers(0, 12 * CHUNK - 1)


def _fetch(r: Replica, held: dict[str, Held], version: int
           ) -> tuple[dict[str, Held], int]:
    """A follower holding ``held`` at ``version`` fetches: what it holds after, and
    the bytes of states it was sent (through the wire's parsing)."""
    items, pieces, length = r.states_for(version)
    blob = b"".join(pieces)
    assert len(blob) == length
    return take(held, parts_of(items, memoryview(blob))), length


def _text(held: dict[str, Held]) -> object:
    pieces, size = joined(held)
    text = b"".join(pieces)
    assert len(text) == size
    return json.loads(text)


class Shipping(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.topic = make_topic(mem=100)
        self.r = Replica(cast(Any, SimpleNamespace(wake_fetches=lambda name: None)),
                         self.topic, EpochHistory())
        self.sets: dict[str, DeferredSet] = {}
        self.memos: dict[str, PartTexts] = {}
        self.encoded: dict[str, object] = {}    # each channel's state installed, decoded
        self.expect: dict[str, object] = {}     # and as the current version has them
        self.held: dict[str, Held] = {}
        self.version = 0                         # the follower's
        self.attempt = 0

    @rule(name=st.sampled_from(NAMES), off=offsets)
    def defer(self, name: str, off: int) -> None:
        self.attempt += 1
        self.sets.setdefault(name, DeferredSet()).add((off, self.attempt, 10**18))
        self.topic.get_channel(name)

    @rule(name=st.sampled_from(NAMES), off=offsets)
    def discard(self, name: str, off: int) -> None:
        s = self.sets.get(name)
        d = s.get(off) if s is not None else None
        if s is not None and d is not None:
            s.discard(d)

    @rule(name=st.sampled_from(NAMES), k=st.integers(0, 11))
    def empty_chunk(self, name: str, k: int) -> None:
        """Every message of a chunk finished (its piece goes from between others)."""
        s = self.sets.get(name)
        for off in range(k * CHUNK, (k + 1) * CHUNK):
            d = s.get(off) if s is not None else None
            if s is not None and d is not None:
                s.discard(d)

    @rule(name=st.sampled_from(NAMES), cursor=st.integers(0, 3), installed=st.booleans())
    def encode(self, name: str, cursor: int, installed: bool) -> None:
        """The storage thread encodes a channel; the loop installs it and makes a
        version, or (``installed`` false: a leadership that changed meanwhile) drops
        it, its encoder's memory having moved on."""
        if name not in self.sets:
            return
        state: ChannelState = {"cursor": cursor, "pending": [[cursor, 1, 0]]}
        snap = self.sets[name].snapshot()
        deferred_states(state, snap, self.memos.setdefault(name, PartTexts()))
        shipped = ship(dumps_keyed(state, self.memos[name]), state_floor(state))
        if installed:
            self.r.shipped[name] = shipped
            self.encoded[name] = {"cursor": cursor, "pending": [[cursor, 1, 0]] + [
                list(d) for part in snap for d in part]}
            self._new_version()

    @rule(cursor=st.integers(0, 3))
    def tick(self, cursor: int) -> None:
        """The leader's tick: every channel encoded and installed (a version)."""
        for name in list(self.sets):
            self.encode(name, cursor, True)

    def _new_version(self) -> None:
        """A version is made once every channel is encoded, of the encodings then."""
        was = self.r.chan_version
        self.r._new_version()
        if self.r.chan_version != was:
            self.expect = dict(self.encoded)

    @rule(name=st.sampled_from(NAMES))
    def delete(self, name: str) -> None:
        self.topic.channels.pop(name, None)
        self.sets.pop(name, None)
        self.memos.pop(name, None)
        if self.r.shipped.pop(name, None) is not None:
            del self.encoded[name]
            self._new_version()

    @precondition(lambda self: self.r.chan_version > self.version)
    @rule()
    def fetch(self) -> None:
        was = self.version
        fresh = was in self.r.version_gens
        self.held, sent = _fetch(self.r, self.held, was)
        self.version = self.r.chan_version
        assert _text(self.held) == self.expect
        whole_size = whole(self.r.versioned)[1]
        if fresh:
            # what is held is sent again only where it changed: never more than the
            # whole states plus the ops (16 bytes a piece)
            pieces = sum(len(s.keyed.pieces) for s in self.r.versioned.values())
            assert sent <= whole_size + 16 * pieces
            # a channel held already costs nothing; one held at the encoding before its
            # current one costs the pieces that encoding lacked, and its ops
            gens = self.r.version_gens[was]
            for item in self.r.states_for(was)[0]:
                assert isinstance(item, list)
                name, gen, base = item[:3]
                s = self.r.versioned[str(name)]
                if gens.get(str(name)) == gen:
                    assert base == gen and item[6] == item[8] == 0
                elif s.ops and gens.get(str(name)) == s.keyed.base:
                    assert base == s.keyed.base and item[8] == s.lit_size
                    assert item[6] == len(s.ops)
                else:
                    assert base == 0 and item[8] == s.keyed.size

    @rule()
    def reconnect(self) -> None:
        """A follower of a new leader holds version 0: it is sent every state whole."""
        self.version = 0


TestShipping = Shipping.TestCase
TestShipping.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


class ShippingFewPieces(Shipping):
    """The same with MAX_PIECES at 4: states go back and forth between shipped in
    pieces and whole as one piece."""

    def __init__(self) -> None:
        super().__init__()
        self.was = states.MAX_PIECES
        states.MAX_PIECES = 4

    def teardown(self) -> None:
        states.MAX_PIECES = self.was


TestShippingFewPieces = ShippingFewPieces.TestCase
TestShippingFewPieces.settings = settings(max_examples=60, stateful_step_count=40,
                                          deadline=None)


def _chunks(n: int) -> list[tuple[tuple[int, int, int], ...]]:
    """n chunks of 100 deferred messages each."""
    return [tuple((k * CHUNK + j, 1, 10**18) for j in range(100)) for k in range(n)]


def _encoded(parts: list[tuple[tuple[int, int, int], ...]], memo: PartTexts
             ) -> states.Shipped:
    state: ChannelState = {"cursor": 0, "pending": []}
    deferred_states(state, tuple(parts), memo)
    return ship(dumps_keyed(state, memo), state_floor(state))


def test_a_follower_that_holds_the_version_before_is_sent_the_changed_chunk_only() -> None:
    """300 chunks of 100 deferred messages each, one chunk changed: the follower is
    sent that chunk and a few bytes around it, not the state."""
    memo = PartTexts()
    parts = _chunks(300)
    first = _encoded(parts, memo)
    held = take({}, parts_of(*_answer({"ch": first}, None)))
    parts[150] = parts[150][:50]
    second = _encoded(parts, memo)
    items, sent = _answer({"ch": second}, {"ch": first.keyed.gen})
    held = take(held, parts_of(items, sent))
    assert len(sent) < 2_000 < second.keyed.size // 100
    assert b"".join(held["ch"].pieces) == b"".join(second.keyed.pieces)
    del parts[200]                      # a chunk emptied between others
    third = _encoded(parts, memo)
    items, sent = _answer({"ch": third}, {"ch": second.keyed.gen})
    held = take(held, parts_of(items, sent))
    assert len(sent) < 100
    assert b"".join(held["ch"].pieces) == b"".join(third.keyed.pieces)


def test_a_follower_is_sent_only_the_chunks_of_messages_in_flight_that_changed() -> None:
    """10,000 messages in flight, listed in no order (the pending entries but the
    deferred ones: core/lifecycle.py ``pending_chunks``), then one FIN'd and another
    delivered again with one more attempt: only those two chunks are encoded again and
    sent, not the state; the follower's copy is the leader's."""
    import random
    rnd = random.Random(5)
    memo = PartTexts()

    def encoded(entries: list[tuple[int, int, int]]) -> states.Shipped:
        listed = entries[:]
        rnd.shuffle(listed)
        state: ChannelState = {"cursor": 10_000, "pending": listed}
        deferred_states(state, (), memo)
        assert state_floor(state) == min(e[0] for e in entries)
        return ship(dumps_keyed(state, memo), state_floor(state))

    entries = [(off, 1, 0) for off in range(10_000)]
    first = encoded(entries)
    assert memo.made == 10                        # 1,024 offsets a chunk
    held = take({}, parts_of(*_answer({"ch": first}, None)))
    changed = [e for e in entries if e[0] != 10]
    changed = [(o, 2, 0) if o == 9_500 else (o, a, d) for o, a, d in changed]
    second = encoded(changed)
    assert memo.made == 10 + 2
    items, sent = _answer({"ch": second}, {"ch": first.keyed.gen})
    held = take(held, parts_of(items, sent))
    assert len(sent) < 30_000 and second.keyed.size > 130_000
    assert b"".join(held["ch"].pieces) == b"".join(second.keyed.pieces)
    text = json.loads(b"".join(second.keyed.pieces))
    assert [tuple(e) for e in text["pending"]] == changed      # in offset order
    assert encoded(changed).keyed.size == second.keyed.size and memo.made == 12


@pytest.mark.parametrize("pure", [False, True])
def test_a_snapshots_entries_are_made_only_for_the_chunks_that_changed(
        pure: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A snapshot's own pending entries (a MadeLater of the in-flight copy, the
    requeued and the dying) are chunked from two arrays (core/lifecycle.py
    ``pending_chunks``): the same JSON and floor as the list they stand for, and at the
    next version a chunk whose offsets and attempts did not change is the part kept
    from the last encoding, the very object; only the changed ones are made and
    encoded. (Made whole, 250,000 in flight cost a leader's storage thread 30% of a
    core.)"""
    import random
    from pybroker._native import inflight as inflight_mod
    from pybroker._native.inflight import InFlight
    from pybroker.core.flight import Flight
    from pybroker.core.lifecycle import MadeLater, _pending_of
    if pure:
        monkeypatch.setattr(inflight_mod, "_GATHER", False)
        monkeypatch.setattr(inflight_mod, "_SORT_PAIRS", False)
    rnd = random.Random(23)
    t: InFlight[Flight] = InFlight(pure=pure)
    firsts = list(range(0, 12_000, 4))
    rnd.shuffle(firsts)
    t.add_flights([Flight(None, f, 4, 1 + f % 3, 0) for f in firsts])
    t.add_flights([Flight(None, 20_000 + k, 1, 2, 0) for k in range(300)])   # of one
    requeued = tuple((30_000 + k, 3, 0) for k in range(50))
    dying = {40_000 + k: 9 for k in range(20)}
    memo = PartTexts()

    def encoded(pending: Any, texts: PartTexts) -> tuple[bytes, Any, int]:
        state: ChannelState = {"cursor": 50_000, "pending": pending}
        deferred_states(state, (), texts)
        return b"".join(dumps_keyed(state, texts).pieces), state, state_floor(state)

    def key() -> tuple[Any, ...]:
        return (t.copy(), requeued, dict(dying))

    first, state, floor = encoded(MadeLater(key(), _pending_of), memo)
    want, _, want_floor = encoded(_pending_of(key()), PartTexts())
    assert first == want and floor == want_floor == 0
    parts = list(state["pending"].parts)
    chunks = len(parts)
    assert memo.made == chunks > 12
    # one FIN, and one flight delivered again with one more attempt: two chunks
    t.pop(5_001)
    t.pop(9_000)
    for off in (9_001, 9_002, 9_003):
        t.pop(off)
    t.add_flights([Flight(None, 9_000, 4, 7, 0)])
    made = memo.made
    second, state, floor = encoded(MadeLater(key(), _pending_of), memo)
    assert second == encoded(_pending_of(key()), PartTexts())[0] and second != first
    assert memo.made - made == 2
    kept = {p.key: p for p in parts}
    again = [p for p in state["pending"].parts if kept.get(p.key) is p]
    assert len(again) == chunks - 2
    assert json.loads(second)["pending"] == sorted([list(e) for e in _pending_of(key())])
    # unchanged: every chunk kept, none made
    made = memo.made
    assert encoded(MadeLater(key(), _pending_of), memo)[0] == second
    assert memo.made == made


class PendingColumnsModel(RuleBasedStateMachine):
    """Messages put in flight (flights of one and of many), finished, requeued and
    dying, at random, and the state encoded after each step from a snapshot's
    MadeLater (the columns and the parts kept from the last encoding) and from the
    list it stands for, afresh: the two always write the same JSON and floor."""

    def __init__(self) -> None:
        super().__init__()
        from pybroker._native.inflight import InFlight
        from pybroker.core.flight import Flight
        self.flight = Flight
        self.t: InFlight[Any] = InFlight()
        self.requeued: dict[int, int] = {}
        self.dying: dict[int, int] = {}
        self.memo = PartTexts()

    def _free(self, first: int, n: int) -> bool:
        return not any(o in self.t or o in self.requeued or o in self.dying
                       for o in range(first, first + n))

    @rule(first=st.integers(0, 6 * CHUNK), n=st.sampled_from([1, 1, 3, 40]),
          attempts=st.integers(1, 70_000))
    def deliver(self, first: int, n: int, attempts: int) -> None:
        if self._free(first, n):
            self.t.add_flights([self.flight(None, first, n, min(attempts, 65_535), 0)])

    @precondition(lambda self: len(self.t) > 0)
    @rule(data=st.data(), to=st.sampled_from(["fin", "requeue", "dying"]))
    def finish(self, data: st.DataObject, to: str) -> None:
        off = data.draw(st.sampled_from(sorted(self.t)))
        f, _ = self.t.pop(off)
        if to == "requeue":
            self.requeued[off] = f.attempts
        elif to == "dying":
            self.dying[off] = f.attempts

    @precondition(lambda self: len(self.requeued) > 0)
    @rule(data=st.data())
    def redeliver(self, data: st.DataObject) -> None:
        off = data.draw(st.sampled_from(sorted(self.requeued)))
        a = self.requeued.pop(off)
        self.t.add_flights([self.flight(None, off, 1, min(a + 1, 65_535), 0)])

    @rule()
    def encode(self) -> None:
        from pybroker.core.lifecycle import MadeLater, _pending_of
        key = (self.t.copy(), tuple((o, a, 0) for o, a in self.requeued.items()),
               dict(self.dying))
        got, want = [], []
        for pending, memo in ((MadeLater(key, _pending_of), self.memo),
                              (_pending_of(key), PartTexts())):
            state: ChannelState = {"cursor": 7 * CHUNK, "pending": pending}
            deferred_states(state, (), memo)
            (got if memo is self.memo else want).append(
                (b"".join(dumps_keyed(state, memo).pieces), state_floor(state)))
        assert got == want


TestPendingColumns = PendingColumnsModel.TestCase
TestPendingColumns.settings = settings(max_examples=40, stateful_step_count=40,
                                       deadline=None)


def test_the_floor_looks_through_every_chunk_of_the_lowest_range() -> None:
    """A chunk of deferred messages and one of the others in the same range of
    offsets: the floor is the lowest of both, whichever chunk's first entry is lower."""
    deferred = ((CHUNK + 50, 1, 10**18), (CHUNK + 3, 1, 10**18))
    for pending, low in (([[CHUNK + 10, 1, 0], [5 * CHUNK, 1, 0]], CHUNK + 3),
                         ([[CHUNK + 1, 1, 0]], CHUNK + 1),
                         ([[9 * CHUNK, 1, 0]], CHUNK + 3)):
        state: ChannelState = {"cursor": 10 * CHUNK, "pending": pending}
        deferred_states(state, (deferred,), PartTexts())
        assert state_floor(state) == low


def _answer(shipped: dict[str, states.Shipped], held: dict[str, int] | None
            ) -> tuple[list[Any], memoryview]:
    items, pieces, _ = delta(shipped, held)
    return items, memoryview(b"".join(pieces))


def test_a_state_of_more_pieces_than_a_loop_walks_goes_whole_as_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Over MAX_PIECES pieces (deferred messages far apart, a chunk each), a state is
    shipped whole each time, as one piece: a follower's loop never walks more."""
    monkeypatch.setattr(states, "MAX_PIECES", 8)
    memo = PartTexts()
    parts = _chunks(20)
    first = _encoded(parts, memo)
    # joined by the storage thread: the leader's loop sends a few pieces, not one a chunk
    assert len(first.keyed.pieces) == 1 and first.ops == b""
    items, blob = _answer({"ch": first}, None)
    assert struct.unpack(">2q", blob[items[0][5]:items[0][5] + 16]) == (-1, first.keyed.size)
    held = take({}, parts_of(items, blob))
    assert len(held["ch"].pieces) == 1
    parts[3] = parts[3][:50]
    second = _encoded(parts, memo)
    held = take(held, parts_of(*_answer({"ch": second}, {"ch": first.keyed.gen})))
    assert b"".join(held["ch"].pieces) == b"".join(second.keyed.pieces)
    # back under MAX_PIECES: what the follower holds is one piece, not the encoding's
    # pieces, so the next state is not made from it with the encoding's ops
    del parts[5:]
    third = _encoded(parts, memo)
    assert third.ops and third.keyed.base
    held = take(held, parts_of(*_answer({"ch": third}, {"ch": second.keyed.gen})))
    assert b"".join(held["ch"].pieces) == b"".join(third.keyed.pieces)


def _item(blob: bytes, ops: list[int], name: str = "ch", gen: int = 2, base: int = 0
          ) -> tuple[list[Any], memoryview]:
    packed = struct.pack(f">{len(ops)}q", *ops)
    frame = packed + blob
    return ([[name, gen, base, 0, len(blob), 0, len(packed), len(packed), len(blob)]],
            memoryview(frame))


@pytest.mark.parametrize("items", [
    {"ch": 1},                                        # not a list
    [["ch", 1, 0, 0, 1, 0, 16, 16]],                  # 8 fields, not 9
    [[7, 1, 0, 0, 1, 0, 16, 16, 1]],                  # a name that is not a string
    [["ch", 1, 0, 0, 1, 0, 16, 16, "1"]],             # a span that is not a number
    [["ch", 1, 0, 0, 1, -16, 16, 16, 1]],             # a negative span
    [["ch", 1, 0, 0, 1, 0, 16, 16, 10**6]],           # bytes past the frame
    [["ch", 1, 0, 0, 1, 0, 12, 12, 1]],               # ops that are not pairs
])
def test_parts_outside_the_frame_or_malformed_are_refused(items: Any) -> None:
    with pytest.raises(ValueError):
        parts_of(items, memoryview(bytes(40)))


def test_more_ops_than_a_loop_walks_are_refused() -> None:
    ops = [-1, 0] * (states.MAX_PIECES + 1)
    with pytest.raises(ValueError, match="too large"):
        parts_of(*_item(b"", ops))


@pytest.mark.parametrize("ops,blob,base", [
    ([0, 1], b"", 1),              # a run from a generation not held
    ([-1, 3], b"ab", 0),           # a new piece larger than its bytes
    ([-1, 1], b"ab", 0),           # bytes left over
    ([-1, -2, -1, 4], b"ab", 0),   # a negative size
    ([5, 1], b"", 0),              # a run of the base while the state is whole
])
def test_parts_that_do_not_fit_what_is_held_are_refused(ops: list[int], blob: bytes,
                                                        base: int) -> None:
    held = {"ch": Held(7, [b"{}"], 2)}
    with pytest.raises(ValueError):
        take(held, parts_of(*_item(blob, ops, base=base)))


def test_a_run_outside_the_pieces_held_is_refused() -> None:
    held = {"ch": Held(1, [b"{", b"}"], 2)}
    with pytest.raises(ValueError, match="outside"):
        take(held, parts_of(*_item(b"", [0, 3], base=1)))
    with pytest.raises(ValueError, match="not held"):          # keep what is not held
        take(held, [Part("ch", 5, 5, 0, 2, memoryview(b""), memoryview(b""))])


def test_a_follower_sent_parts_that_do_not_fit_keeps_its_states_and_asks_for_all(
        caplog: pytest.LogCaptureFixture) -> None:
    r = Replica(cast(Any, None), make_topic(mem=100), EpochHistory())
    r.held = {"ch": Held(1, [b'{"cursor": 4}'], 13)}
    r.chan_from_leader = 9
    with caplog.at_level(logging.WARNING, logger="pybroker"):
        done = r._take_parts(parts_of(*_item(b"", [0, 9], base=1)), 10, None, print)
    assert done is print                      # (small: taken at once)
    assert r.held == {"ch": Held(1, [b'{"cursor": 4}'], 13)}
    assert r.chan_from_leader == 0            # its next fetch asks for every state
    assert "do not fit" in caplog.text


def test_states_of_another_size_than_said_take_over_no_channel(
        caplog: pytest.LogCaptureFixture) -> None:
    """The text a new leader copies out of its pieces must be the size its leader
    said (small, copied in one join; large, in steps into a mapping)."""
    t = make_topic(mem=100)
    big = json.dumps({"c": {"cursor": 0, "pending": [[k, 1, 0] for k in range(5)]}})
    for text in (takeover.Text([b'{"c": ', b'{"cursor": 1}}'], 99),
                 takeover.Text([big.encode()] * 2, takeover.COPY_STEP + 1)):
        with caplog.at_level(logging.ERROR, logger="pybroker"):
            steps = takeover.build(t, text, t.log.written, NOW, WALL)
            assert takeover.run(steps) == []
        assert "cannot be read" in caplog.text
        caplog.clear()


def test_an_answer_of_many_channels_is_taken_a_step_a_turn(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Past TAKE_STEP op pairs (here 40), a follower takes the parts a step a turn, each
    of about TAKE_STEP pairs; the fetcher is told the round is done only once the
    records are appended and the last step is over."""
    monkeypatch.setattr(states, "TAKE_STEP", 40)
    monkeypatch.setattr(replica_mod, "TAKE_STEP", 40)
    shipped = {f"ch{k}": _encoded(_chunks(10), PartTexts()) for k in range(12)}
    t = make_topic(mem=100)
    loop = SelectorLoop("states-test")       # turned by the test
    t.owner = cast(Any, loop)
    r = Replica(cast(Any, None), t, EpochHistory())
    r.role, r.epoch = FOLLOWER, 3
    parts = parts_of(*_answer(shipped, None))
    assert ops_of(parts) > 40
    told: list[int] = []
    try:
        done = r._take_parts(parts, 9, None, lambda: told.append(1))
        done()                               # the records appended
        turns = 0
        while not told:
            assert r.chan_from_leader == 0 and turns < 1000
            loop.run_once()
            turns += 1
    finally:
        loop.close()
    assert told == [1] and r.chan_from_leader == 9
    assert turns >= ops_of(parts) // 40 - 1
    assert set(r.held) == set(shipped)
    assert all(b"".join(r.held[n].pieces) == b"".join(s.keyed.pieces)
               for n, s in shipped.items())
