"""dumps_yielding (pybroker.jsonvalue): the same text as json.dumps, made in slices
so that the GIL is offered to the loops between them."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from hypothesis import given, strategies as st

import pybroker.jsonvalue as jv

scalars = st.none() | st.booleans() | st.integers() | st.text(max_size=8) \
    | st.floats(allow_nan=False)
docs = st.recursive(scalars, lambda inner: st.lists(inner, max_size=12)
                    | st.dictionaries(st.text(max_size=6), inner, max_size=6), max_leaves=60)


@given(docs)
def test_the_same_text_as_json_dumps(doc: object) -> None:
    assert jv.dumps_yielding(doc) == json.dumps(doc)


@given(docs)
def test_the_same_text_in_slices_of_three(doc: object) -> None:
    saved = jv.YIELD_ITEMS
    jv.YIELD_ITEMS = 3
    try:
        assert jv.dumps_yielding(doc) == json.dumps(doc)
    finally:
        jv.YIELD_ITEMS = saved


def test_a_long_list_offers_the_gil_between_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    """A channel state of 100,000 deferred messages: encoded in slices of YIELD_ITEMS,
    with the GIL offered between each two."""
    offers: list[float] = []
    # jsonvalue's own view of the time module: a thread of another test sleeping
    # meanwhile is not counted
    monkeypatch.setattr(jv, "time", SimpleNamespace(sleep=lambda s: offers.append(s)))
    state = {"c": {"cursor": 5, "pending": [[k, 1, 10**18] for k in range(100_000)]}}
    text = jv.dumps_yielding(state)
    assert json.loads(text) == state and text == json.dumps(state)
    assert offers == [0] * (-(-100_000 // jv.YIELD_ITEMS) - 1)


def test_parts_kept_from_the_last_encoding_are_not_encoded_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A PartedList with PartTexts: the GIL is offered per YIELD_ITEMS items encoded;
    an encoding that finds every part kept encodes none and offers it never, and one
    part changed is the one part encoded."""
    offers: list[float] = []
    monkeypatch.setattr(jv, "time", SimpleNamespace(sleep=lambda s: offers.append(s)))
    parts = [tuple((k * 1024 + i, 1, 10**18) for i in range(1024)) for k in range(40)]
    texts = jv.PartTexts()
    whole = {"pending": [list(d) for part in parts for d in part]}

    def encode() -> str:
        return jv.dumps_yielding({"pending": jv.PartedList([], parts, texts)})

    assert encode() == json.dumps(whole)
    assert texts.made == 40 and len(offers) == 39
    offers.clear()
    assert encode() == json.dumps(whole) and texts.made == 40 and offers == []
    parts[7] = parts[7][:-1]                   # one chunk changed (a new tuple)
    whole["pending"].pop(8 * 1024 - 1)
    assert encode() == json.dumps(whole) and texts.made == 41 and len(texts) == 40


def test_many_small_parts_kept_still_offer_the_gil(monkeypatch: pytest.MonkeyPatch) -> None:
    """Parts of one message each (deferred messages far apart), all kept from the
    last encoding: each still counts, so the GIL is offered every YIELD_ITEMS of them."""
    offers: list[float] = []
    monkeypatch.setattr(jv, "time", SimpleNamespace(sleep=lambda s: offers.append(s)))
    parts = [((k << 10, 1, 0),) for k in range(3 * jv.YIELD_ITEMS)]
    texts = jv.PartTexts()
    encode = lambda: jv.dumps_yielding(jv.PartedList([], parts, texts))  # noqa: E731
    assert encode() == json.dumps([list(p[0]) for p in parts])
    offers.clear()
    assert encode() == json.dumps([list(p[0]) for p in parts])
    assert texts.made == 3 * jv.YIELD_ITEMS and len(offers) == 2
