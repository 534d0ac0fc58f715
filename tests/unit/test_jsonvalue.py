"""pybroker.jsonvalue: the narrowing helpers accept their type and name the field when
a value has another."""
from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from pybroker.jsonvalue import JsonShapeError, arr, integer, num, obj, text


def test_narrowing_accepts_the_right_types() -> None:
    doc = obj(json.loads('{"a": [1, 2.5], "b": "x", "c": 3}'))
    assert arr(doc["a"]) == [1, 2.5]
    assert num(arr(doc["a"])[1]) == 2.5
    assert integer(doc["c"]) == 3
    assert text(doc["b"]) == "x"


@pytest.mark.parametrize("fn, value, want", [
    (obj, [1], "an object"), (arr, {"k": 1}, "an array"), (num, "1", "a number"),
    (num, True, "a number"), (integer, 1.5, "an integer"), (integer, False, "an integer"),
    (text, None, "a string"),
])
def test_wrong_types_raise_naming_the_field(fn: Callable[..., object], value: object,
                                             want: str) -> None:
    with pytest.raises(JsonShapeError, match=f"field: expected {want}"):
        fn(value, "field")
