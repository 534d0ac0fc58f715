"""JSON values as ``json.loads`` returns them, and the narrowing helpers that read one.

``Json`` is the recursive type of any decoded document; ``JsonObject`` is an object.
Where a document's shape is fixed (the /stats document, core.statsdoc) it has its own
TypedDicts; ``Json`` is for documents whose shape is the peer's (a remote /stats or
/info, a lookupd answer, a TOML table): their fields are narrowed where they are read,
with the helpers below, each of which raises ``JsonShapeError`` (a ``ValueError``) naming
the field when the value has another type.
"""
from __future__ import annotations

import json
import time
from typing import Union

Json = Union[None, bool, int, float, str, list["Json"], dict[str, "Json"]]
JsonObject = dict[str, Json]


class JsonShapeError(ValueError):
    """A JSON value is not of the type its reader expects."""


def _wrong(what: str, want: str, v: Json) -> JsonShapeError:
    return JsonShapeError(f"{what}: expected {want}, got {type(v).__name__}")


def obj(v: Json, what: str = "value") -> JsonObject:
    """``v`` as a JSON object."""
    if isinstance(v, dict):
        return v
    raise _wrong(what, "an object", v)


def arr(v: Json, what: str = "value") -> list[Json]:
    """``v`` as a JSON array."""
    if isinstance(v, list):
        return v
    raise _wrong(what, "an array", v)


def num(v: Json, what: str = "value") -> int | float:
    """``v`` as a number (``bool`` is refused, as JSON has no numeric booleans)."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return v
    raise _wrong(what, "a number", v)


def integer(v: Json, what: str = "value") -> int:
    """``v`` as an integer."""
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    raise _wrong(what, "an integer", v)


def text(v: Json, what: str = "value") -> str:
    """``v`` as a string."""
    if isinstance(v, str):
        return v
    raise _wrong(what, "a string", v)


YIELD_ITEMS = 1024      # list items json encodes per hold of the GIL in ``dumps_yielding``


def dumps_yielding(v: object) -> str:
    """``json.dumps(v)``, the same text, made off the event loops (the storage thread)
    without holding the GIL through it: a list of more than YIELD_ITEMS items is encoded
    in slices, with the GIL offered to the other threads between them
    (``time.sleep(0)``). json's C encoder holds the GIL for a whole call: a channel state
    with 100,000 deferred messages held every loop about 40 ms at each checkpoint.
    Budget: one slice (about 2 ms) per hold; dicts and short lists are encoded whole."""
    out: list[str] = []
    _dump(v, out)
    return "".join(out)


def _dump(v: object, out: list[str]) -> None:
    if isinstance(v, dict):
        out.append("{")
        for i, (k, item) in enumerate(v.items()):
            out.append(", " if i else "")
            out.append(json.dumps(k))
            out.append(": ")
            _dump(item, out)
        out.append("}")
    elif isinstance(v, list) and len(v) > YIELD_ITEMS:
        out.append("[")
        for i in range(0, len(v), YIELD_ITEMS):
            if i:
                out.append(", ")
                time.sleep(0)
            out.append(json.dumps(v[i:i + YIELD_ITEMS])[1:-1])
        out.append("]")
    else:
        out.append(json.dumps(v))
