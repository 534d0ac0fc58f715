"""JSON values as ``json.loads`` returns them, and the narrowing helpers that read one.

``Json`` is the recursive type of any decoded document; ``JsonObject`` is an object.
Where a document's shape is fixed (the /stats document, core.statsdoc) it has its own
TypedDicts; ``Json`` is for documents whose shape is the peer's (a remote /stats or
/info, a lookupd answer, a TOML table): their fields are narrowed where they are read,
with the helpers below, each of which raises ``JsonShapeError`` (a ``ValueError``) naming
the field when the value has another type.
"""
from __future__ import annotations

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
