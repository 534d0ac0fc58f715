"""core/deferred.py's DeferredSet against a dict, as a Hypothesis state machine; a
state completed with its chunks (jsonvalue.PartedList) encoded as json would encode
the whole list; the storage thread's test for a state it wrote already."""
from __future__ import annotations

import array
import json

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pybroker.core.deferred import CHUNK, CHUNK_BITS, Chunks, DeferredSet
from pybroker.core.lifecycle import ChannelState, deferred_states, state_floor
from pybroker.jsonvalue import (BYTES_PIECE, YIELD_ITEMS, PartedList, PartTexts, dumps_bytes,
                                dumps_yielding)
from pybroker.server.storage import TopicState, _same_state, _saved_state

# offsets over a few chunks, so that chunks fill, empty and share
offsets = st.integers(0, 4 * CHUNK - 1)


class DeferredSetModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.s = DeferredSet()
        self.model: dict[int, tuple[int, int, int]] = {}
        self.snaps: list[tuple[object, dict[int, tuple[int, int, int]]]] = []
        self.attempt = 0
        self.texts = PartTexts()          # the encoder's memory, from one state to the next
        self.encoded: Chunks = ()
        self.encodings = 0
        # chunks changed since the last snapshot (one changed and changed back, as an
        # add and a discard of one offset, is made again: equal, not the same value)
        self.touched: set[int] = set()

    @rule(off=offsets)
    def add(self, off: int) -> None:
        self.attempt += 1
        d = (off, self.attempt, 10**18)
        self.s.add(d)
        self.model[off] = d
        self.touched.add(off >> CHUNK_BITS)

    @rule(off=offsets, same=st.booleans())
    def discard(self, off: int, same: bool) -> None:
        held = self.model.get(off)
        d = held if same and held is not None else (off, -1, 0)
        assert self.s.discard(d) == (held is not None and d is held)
        if held is not None and d is held:
            del self.model[off]
            self.touched.add(off >> CHUNK_BITS)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def discard_held(self, data: st.DataObject) -> None:
        """One held (offsets drawn at random are seldom held)."""
        off = data.draw(st.sampled_from(sorted(self.model)))
        assert self.s.discard(self.model.pop(off))
        self.touched.add(off >> CHUNK_BITS)

    @rule()
    def clear(self) -> None:
        self.touched.update(o >> CHUNK_BITS for o in self.model)
        self.s.clear()
        self.model.clear()

    @rule(per=st.integers(1, 2 * CHUNK), steps=st.integers(0, 4))
    def freeze_some(self, per: int, steps: int) -> None:
        """A restored channel's chunk tuples made a step at a time (possibly not all:
        changes may come between steps in another use)."""
        gen = self.s.freeze_steps(per)
        for _ in range(steps):
            if next(gen, StopIteration) is StopIteration:
                break

    @rule()
    def snapshot(self) -> None:
        before = self.snaps[-1][0] if self.snaps else None
        snap = self.s.snapshot()
        assert all(0 < len(part) <= CHUNK for part in snap)
        assert sorted(d for part in snap for d in part) == sorted(self.model.values())
        assert all(d is self.model[d[0]] for part in snap for d in part)
        assert len({part[0][0] >> CHUNK_BITS for part in snap}) == len(snap)
        if before is not None and not self.touched:
            assert snap is before       # nothing changed: the very same value
        if isinstance(before, tuple):
            # a chunk whose messages did not change is the tuple shared with the last
            old = {part[0][0] >> CHUNK_BITS: part for part in before}
            for part in snap:
                key = part[0][0] >> CHUNK_BITS
                if key in old and key not in self.touched:
                    assert old[key] is part
        self.touched.clear()
        self.snaps.append((snap, dict(self.model)))
        self.encode(snap)

    def encode(self, snap: Chunks) -> None:
        """Encoded with the texts kept from the last encoding: the same JSON as the
        whole list, the same floor, and only the chunks not encoded last time made."""
        state: ChannelState = {"cursor": 3 * CHUNK, "pending": [[2 * CHUNK + 1, 1, 0]]}
        deferred_states(state, snap, self.texts)
        whole = [[2 * CHUNK + 1, 1, 0]] + [list(d) for part in snap for d in part]
        made = self.texts.made
        assert b"".join(dumps_bytes(state)) == json.dumps(
            {"cursor": 3 * CHUNK, "pending": whole}).encode()
        before = {id(part) for part in self.encoded}
        # the entry in flight is a chunk of its own (pending_chunks): made the first time,
        # kept after (the same items each time)
        first = 0 if self.encodings else 1
        assert self.texts.made - made == first + sum(1 for part in snap
                                                     if id(part) not in before)
        assert len(self.texts) == len(snap) + 1      # nothing older kept
        self.encodings += 1
        assert state_floor(state) == min([3 * CHUNK, 2 * CHUNK + 1, *self.model])
        self.encoded = snap

    @invariant()
    def agrees(self) -> None:
        assert len(self.s) == len(self.model) and bool(self.s) == bool(self.model)
        assert sorted(self.s) == sorted(self.model)
        assert self.s.lowest() == (min(self.model) if self.model else None)
        # a rewind's listing: every offset held from there on, and only offsets held
        # in the chunks that reach it (the caller drops the few below it)
        for at in (0, CHUNK - 1, CHUNK + 7, 3 * CHUNK):
            out = array.array("q", [-5])
            self.s.offsets_from(at, out)
            got = list(out[1:])
            assert out[0] == -5 and len(got) == len(set(got))
            assert {o for o in got if o >= at} == {o for o in self.model if o >= at}
            assert set(got) <= {o for o in self.model if o >> CHUNK_BITS >= at >> CHUNK_BITS}
        for off, d in self.model.items():
            assert self.s.get(off) is d
        # what a snapshot returned is never changed afterwards
        for snap, then in self.snaps:
            assert sorted(d for part in snap for d in part) == sorted(then.values())  # type: ignore[attr-defined]


TestDeferredSet = DeferredSetModel.TestCase
TestDeferredSet.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_a_state_with_its_chunks_encodes_as_the_whole_list() -> None:
    """deferred_states adds the chunks without copying them; dumps_yielding writes the
    same JSON as json.dumps of the complete state, and state_floor sees them all."""
    s = DeferredSet()
    for off in range(100, 100 + 3 * CHUNK, 3):
        s.add((off, 2, 10**18))
    own = [[7000 + k, 1, 0] for k in range(YIELD_ITEMS + 5)]      # more than a slice
    for pending in ([], own):
        state: ChannelState = {"cursor": 50_000, "pending": list(pending)}
        chunks = s.snapshot()
        deferred_states(state, chunks)
        assert isinstance(state["pending"], PartedList)
        whole = list(pending) + [list(d) for part in chunks for d in part]
        assert json.loads(dumps_yielding(state)) == {"cursor": 50_000, "pending": whole}
        assert dumps_yielding(state) == json.dumps({"cursor": 50_000, "pending": whole})
        pieces = list(dumps_bytes(state))        # as written and shipped: never joined
        assert b"".join(pieces) == json.dumps({"cursor": 50_000, "pending": whole}).encode()
        assert all(len(p) < BYTES_PIECE + 64 * 1024 for p in pieces)
        assert state_floor(state) == 100
    empty: ChannelState = {"cursor": 9, "pending": []}
    deferred_states(empty, DeferredSet().snapshot())
    assert dumps_yielding(empty) == json.dumps({"cursor": 9, "pending": []})
    assert state_floor(empty) == 9


def test_a_topic_state_is_the_same_only_with_the_same_chunks() -> None:
    """The storage thread writes a topic's state again unless it equals the last one
    written *and* its channels' pending go on in the very same chunks: a PartedList
    compares only its own items, so a change among the deferred messages alone must
    still count (core/deferred.py: a chunk never changes once a snapshot returned it)."""
    s = DeferredSet()
    s.add((5, 1, 10**18))

    def topic_state(chunks: Chunks) -> TopicState:
        ch: ChannelState = {"cursor": 10, "pending": [[3, 1, 0]]}
        deferred_states(ch, chunks)
        return {"topic": "t", "released": 10, "channels": {"c": ch}}

    first = s.snapshot()
    written = _saved_state(topic_state(first))
    assert _same_state(written, _saved_state(topic_state(s.snapshot())))
    s.add((6, 1, 10**18))                       # only a deferred message changed
    assert not _same_state(written, _saved_state(topic_state(s.snapshot())))
    assert not _same_state(None, written)
    other = _saved_state(topic_state(first))
    other[0]["released"] = 11                   # the rest of the state changed
    assert not _same_state(written, other)
