"""loads_steps (pybroker.jsonvalue): the value json.loads gives, decoded a slice a step
so that a loop can take a channel state of 100,000 deferred messages over a step a
turn (pybroker.cluster.takeover). Budget: about LOADS_SLICE bytes of a long list a
step; the hostile texts (not JSON, a run of list characters that is not one list, a
string that looks like a cut span) fail or decode exactly as json.loads does."""
from __future__ import annotations

import gc
import json
import mmap
import re

import pytest
from hypothesis import given, settings, strategies as st

import pybroker.jsonvalue as jv


def steps_of(raw: bytes, tuples: bool = False) -> tuple[object, int]:
    """(the value, how many steps it took)."""
    gen = jv.loads_steps(raw, tuples)
    n = 0
    while True:
        try:
            next(gen)
        except StopIteration as done:
            return done.value, n + 1
        n += 1


scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) \
    | st.text(alphabet="ab[]{},: \"\\\x00-0123456789", max_size=8)
docs = st.recursive(scalars, lambda inner: st.lists(inner, max_size=12)
                    | st.dictionaries(st.text(max_size=6), inner, max_size=6), max_leaves=60)
int_lists = st.lists(st.integers(-10**19, 10**19) | st.lists(st.integers(), max_size=4),
                     max_size=40)


SMALL = {"LOADS_SLICE": 8, "SCAN_STEP": 16,
         "_LONG_LIST": re.compile(rb"\[[-0-9, \[\]]{4}")}


@pytest.fixture
def small_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lists over 8 bytes cut out (found by a "[" and 4 list characters), scanned 16
    bytes a step."""
    for name, value in SMALL.items():
        monkeypatch.setattr(jv, name, value)


@given(docs)
def test_the_value_of_json_loads(doc: object) -> None:
    raw = json.dumps(doc).encode()
    assert steps_of(raw)[0] == json.loads(raw)


@settings(max_examples=300)
@given(st.recursive(scalars | int_lists, lambda inner: st.lists(inner, max_size=8)
                    | st.dictionaries(st.text(max_size=4), inner, max_size=5),
                    max_leaves=40),
       st.sampled_from([", ", ","]))
def test_the_value_of_json_loads_in_slices_of_eight_bytes(doc: object, sep: str) -> None:
    """Every list of integers or integer lists over 8 bytes is cut out and decoded in
    slices (both separators), whatever surrounds it, the text scanned 16 bytes a step."""
    saved = {name: getattr(jv, name) for name in SMALL}
    for name, value in SMALL.items():
        setattr(jv, name, value)
    try:
        raw = json.dumps(doc, separators=(sep, ": ")).encode()
        assert steps_of(raw)[0] == json.loads(raw)
    finally:
        for name, value in saved.items():
            setattr(jv, name, value)


def test_a_channel_state_of_100000_deferred_messages_takes_a_step_a_slice() -> None:
    state = {"c": {"cursor": 100_005, "skip": list(range(20_000)),
                   "pending": [[k, 1, 1_900_000_000_000_000_000 + k] for k in range(100_000)],
                   "settings": {"dead_letter_topic": "dl"}},
             "pending": {"cursor": 3, "pending": [[1, 2, 3]]}}
    raw = jv.dumps_yielding(state).encode()
    value, steps = steps_of(raw)
    assert value == state
    assert steps >= len(raw) // jv.LOADS_SLICE - 2     # no slice much over the budget


def _as_lists(v: object) -> object:
    if isinstance(v, (list, tuple)):
        return [_as_lists(x) for x in v]
    if isinstance(v, dict):
        return {k: _as_lists(x) for k, x in v.items()}
    return v


def test_the_items_of_a_long_list_of_lists_come_as_untracked_tuples() -> None:
    """``tuples``: a new leader's pending messages, 100,000 of them, decode as tuples
    (the same values otherwise), which the garbage collector stops tracking at its
    first pass: a full collection does not walk them while the takeover runs."""
    state = {"c": {"cursor": 100_005, "skip": list(range(20_000)),
                   "pending": [[k, 1, 1_900_000_000_000_000_000 + k] for k in range(100_000)]}}
    raw = jv.dumps_yielding(state).encode()
    value, _ = steps_of(raw, tuples=True)
    assert _as_lists(value) == state
    assert isinstance(value, dict)
    pending = value["c"]["pending"]
    assert all(type(p) is tuple for p in pending)
    assert value["c"]["skip"] == list(range(20_000))
    gc.collect()
    assert not any(gc.is_tracked(p) for p in pending)


def test_a_mapped_text_decodes_as_bytes_do() -> None:
    """A new leader copies the shipped states out of their frame into an anonymous
    mapping (in steps, pybroker.cluster.takeover._copy) and decodes that."""
    state = {"c": {"cursor": 7, "pending": [[k, 1, 2] for k in range(50_000)]},
             "d": {"cursor": 1, "pending": []}}
    raw = jv.dumps_yielding(state).encode()
    mapped = mmap.mmap(-1, len(raw))
    mapped[:] = raw
    gen = jv.loads_steps(mapped)
    while True:
        try:
            next(gen)
        except StopIteration as done:
            assert done.value == state
            break
    small = mmap.mmap(-1, 9)
    small[:] = b'{"a": 12}'
    assert steps_of(b'{"a": 12}')[0] == {"a": 12}
    gen = jv.loads_steps(small)
    with pytest.raises(StopIteration) as stop:
        while True:
            next(gen)
    assert stop.value.value == {"a": 12}


@settings(max_examples=200)
@given(st.recursive(scalars | int_lists, lambda inner: st.lists(inner, max_size=8)
                    | st.dictionaries(st.text(max_size=4), inner, max_size=5),
                    max_leaves=40))
def test_tuples_or_not_the_same_values(doc: object) -> None:
    saved = {name: getattr(jv, name) for name in SMALL}
    for name, value in SMALL.items():
        setattr(jv, name, value)
    try:
        raw = json.dumps(doc).encode()
        assert _as_lists(steps_of(raw, tuples=True)[0]) == json.loads(raw)
    finally:
        for name, value in saved.items():
            setattr(jv, name, value)


@pytest.mark.usefixtures("small_slices")
@pytest.mark.parametrize("text", [
    # a run of list characters between objects: "[1], [2], [3]" is not one list
    '[{"a": 1}, [1], [2], [333333333], {"b": 2}]',
    '[{"a": 1}, [1, 2], [3, [4]], 5, 6666666666, {"b": 2}]',
    # deeper than lists of integer lists
    '[[[1, 2], [3, 4]], [[5, 6], [7, 8]], [[9, 10]]]',
    # a string that looks like a cut span, with and without a span cut out
    '["\\u0000span:0", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]',
    '{"x": "\\u0000span:0"}',
    '{"x": "\\u0000span:7", "y": [11111111, 22222222, 33333333]}',
    # brackets inside strings
    '["[1, 2, 3, 4, 5, 6]", [1, 2, 3, 4, 5, 6, 7], "]]"]',
])
def test_texts_that_are_not_cut_as_they_look_decode_as_json_loads(text: str) -> None:
    assert steps_of(text.encode())[0] == json.loads(text)


@pytest.mark.usefixtures("small_slices")
@pytest.mark.parametrize("text", [
    '{"a": [1, 2, 3, 4, 5, 6, 7, 8',
    '[[1, 2], [3, 4], [5, 6], [7, 8]',
    '[1, 2, 3, 4, 5, 6, 7, 8]]',
    '[1, 2, 3, 4, 5, 6, 7, 8] x',
    '[[1, 2], [3, 4]], [[5, 6]]',
    '',
    '[01, 2, 3, 4, 5, 6, 7, 8]',
])
def test_what_is_not_json_fails_as_json_loads_does(text: str) -> None:
    with pytest.raises(ValueError):
        json.loads(text)
    with pytest.raises(ValueError):
        steps_of(text.encode())


@pytest.mark.usefixtures("small_slices")
def test_small_settings_cut_and_scan_in_steps() -> None:
    """The settings the texts above run under do cut lists out and take steps (a text
    decoded whole takes one)."""
    raw = json.dumps({"name": "x" * 40, "a": list(range(40)),
                      "b": [[k, k] for k in range(20)]}).encode()
    value, steps = steps_of(raw)
    assert value == json.loads(raw)
    assert steps >= len(raw) // 16


# -- hostile texts: each is refused within the budget, never decoded at once past it ----
def test_a_nesting_bomb_is_a_value_error() -> None:
    """200 KB of "[" (json.loads raises RecursionError), alone and beside a long list."""
    bomb = "[" * 100_000 + "]" * 100_000
    with pytest.raises(ValueError):
        steps_of(bomb.encode())
    with pytest.raises(ValueError):
        steps_of(json.dumps({"a": list(range(50_000))}).replace("]", ", " + bomb + "]")
                 .encode())


def test_an_item_over_its_budget_is_decoded_whole_only_within_its_budget(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A long list with one item over ITEM_MAX is not sliced: the text is decoded whole
    if it is within WHOLE_MAX (590 KB here), else refused."""
    doc = {"c": {"pending": [[1, 2, 3], list(range(100_000))]}}
    raw = json.dumps(doc).encode()
    assert steps_of(raw)[0] == doc
    monkeypatch.setattr(jv, "WHOLE_MAX", 100_000)
    with pytest.raises(ValueError, match="at once"):
        steps_of(raw)


def test_a_text_over_the_budget_without_long_lists_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Past WHOLE_MAX, what would be decoded in one step is refused (a flood of
    channels, or one long string); within it, decoded."""
    monkeypatch.setattr(jv, "WHOLE_MAX", 1000)
    few = {f"ch{k}": {"cursor": k} for k in range(10)}
    assert steps_of(json.dumps(few).encode())[0] == few
    for doc in ({f"ch{k}": {"cursor": k} for k in range(100)}, {"a": "x" * 2000}):
        raw = json.dumps(doc).encode()
        assert json.loads(raw) == doc
        with pytest.raises(ValueError, match="at once"):
            steps_of(raw)
    # the long lists cut out, the rest within the budget: decoded
    state = {"c": {"cursor": 5, "pending": [[k, 1, 0] for k in range(5000)]}}
    assert steps_of(json.dumps(state).encode())[0] == state
