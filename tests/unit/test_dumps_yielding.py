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
