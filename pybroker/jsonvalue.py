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
import mmap
import re
import time
from collections.abc import Generator, Iterable, Iterator, Sequence
from typing import Any, Union

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
    return "".join(dumps_pieces(v))


def dumps_pieces(v: object) -> list[str]:
    """``dumps_yielding``'s text in the pieces it was made in, not joined: joining the
    35 MB of a state with 1,000,000 deferred messages (and encoding it) held the GIL
    about 10 ms."""
    out: list[str] = []
    _dump(v, out)
    return out


BYTES_PIECE = 256 * 1024     # UTF-8 bytes ``dumps_bytes`` gathers per piece


def dumps_bytes(v: object) -> Iterator[bytes]:
    """``dumps_yielding``'s text as UTF-8, in pieces of about BYTES_PIECE bytes (each
    a short hold of the GIL), never joined: written one by one (``_fsutil.atomic_write``)
    or sent as they are (a replicated channel's state)."""
    buf = bytearray()
    for piece in dumps_pieces(v):
        buf += piece.encode()
        if len(buf) >= BYTES_PIECE:
            yield bytes(buf)
            buf.clear()
    if buf:
        yield bytes(buf)


class PartTexts:
    """The JSON text of each part of a PartedList (a chunk of a channel's deferred
    messages, core/deferred.py), kept by the part's identity from one encoding of the
    list to the next. A part is never changed once made, so a state whose deferred
    messages changed in a few chunks is encoded in time proportional to those chunks,
    not to all of them: a replicated channel holding 300,000 deferred messages, a few
    deferred again each second, cost its leader half a core encoding the whole state
    every 200 ms to ship it.

    Kept: the texts of the parts the last encoding met, nothing older (a part that
    went away is forgotten at the next encoding). Memory: the text, about 35 bytes a
    deferred message. Owned by the one thread that encodes with it (the storage
    thread); one per list encoded (a channel's ``pending``)."""

    __slots__ = ("_last", "_next", "made")

    def __init__(self) -> None:
        self._last: dict[int, tuple[Sequence[Any], str]] = {}
        self._next: dict[int, tuple[Sequence[Any], str]] = {}
        self.made = 0        # parts encoded (not found kept), in all: for the tests

    def __len__(self) -> int:
        return len(self._last)

    def begin(self) -> None:
        self._next = {}

    def text(self, part: Sequence[Any]) -> tuple[str, bool]:
        """The part's items as JSON (without the brackets), and whether it was
        encoded now (else kept from the last encoding)."""
        key = id(part)
        got = self._last.get(key)
        made = got is None or got[0] is not part     # (an id may be another's now)
        if made:
            got = (part, json.dumps(part)[1:-1])
            self.made += 1
        assert got is not None
        self._next[key] = got
        return got[1], made

    def end(self) -> None:
        """The encoding is complete: keep what it met, forget the rest."""
        self._last, self._next = self._next, {}


class PartedList(list):  # type: ignore[type-arg]
    """A list whose items go on in ``parts`` (sequences kept elsewhere, shared and never
    changed: a channel's deferred messages, core/deferred.py), encoded by
    ``dumps_yielding`` as one JSON array, its own items first, without copying the
    parts into it (a young list of a million items costs the garbage collector a
    walk over all of them). ``texts``: the parts' texts kept from the last encoding of
    this list (PartTexts), or None."""

    def __init__(self, items: Iterable[Any] = (), parts: Sequence[Sequence[Any]] = (),
                 texts: PartTexts | None = None) -> None:
        super().__init__(items)
        self.parts = parts
        self.texts = texts


def _dump(v: object, out: list[str]) -> None:
    if isinstance(v, PartedList) or isinstance(v, list) and len(v) > YIELD_ITEMS:
        # about YIELD_ITEMS items encoded (a slice, or parts) per hold of the GIL; a
        # part's text kept from the last encoding is not encoded again
        texts: PartTexts | None = getattr(v, "texts", None)
        out.append("[")
        sep = ""
        made = 0               # items encoded since the GIL was last offered
        for i in range(0, len(v), YIELD_ITEMS):
            if made:
                time.sleep(0)
            piece = v[i:i + YIELD_ITEMS]
            out.append(sep)
            out.append(json.dumps(piece)[1:-1])
            made = len(piece)
            sep = ", "
        if texts is not None:
            texts.begin()
        for part in getattr(v, "parts", ()):
            if not part:
                continue
            if made >= YIELD_ITEMS:
                time.sleep(0)
                made = 0
            if texts is None:
                text = json.dumps(part)[1:-1]
                made += len(part)
            else:
                # a kept part counts one (a lookup), so that many small ones kept
                # still offer the GIL every YIELD_ITEMS
                text, new = texts.text(part)
                made += len(part) if new else 1
            out.append(sep)
            out.append(text)
            sep = ", "
        if texts is not None:
            texts.end()
        out.append("]")
    elif isinstance(v, dict):
        out.append("{")
        for i, (k, item) in enumerate(v.items()):
            out.append(", " if i else "")
            out.append(json.dumps(k))
            out.append(": ")
            _dump(item, out)
        out.append("}")
    else:
        out.append(json.dumps(v))




# A list of integers or of integer lists, as a channel state's "pending", "skip" and
# "deliveries" are encoded: digits, signs, commas, spaces and brackets only (no string,
# object or float). Such a span over LOADS_SLICE bytes is decoded in slices. Found by
# its start (a "[" and 1,024 such characters) and then its end, SCAN_STEP bytes a step:
# one regular expression over a whole 64 MB list would hold the GIL about 50 ms (2.4 ms
# measured over 3.3 MB).
_LONG_LIST = re.compile(rb"\[[-0-9, \[\]]{1024}")
_NOT_LIST = re.compile(rb"[^-0-9, \[\]]")
LOADS_SLICE = 64 * 1024   # bytes ``loads_steps`` decodes per step
SCAN_STEP = 1 << 20       # bytes ``loads_steps`` scans per step
# the most ``loads_steps`` decodes in one step (about 20 ms): the text left once the long
# lists are cut out (a state's cursors and settings: about 30,000 channels' worth), or an
# item of a long list (a state's are 3 integers)
WHOLE_MAX = 2 << 20
ITEM_MAX = 4 * LOADS_SLICE
_HOLE = "\x00span:"      # stands for a span cut out: a text no state holds (NUL)


def loads_steps(raw: bytes | mmap.mmap, tuples: bool = False) -> Generator[None, None, Json]:
    """``json.loads(raw)`` in steps: returns the same value, and yields between steps
    (about LOADS_SLICE bytes decoded or SCAN_STEP bytes scanned each). Each list of
    integers or integer lists longer than LOADS_SLICE (a channel state's deferred
    messages) is cut out of the text and decoded in slices; the rest, small, is decoded
    whole. A follower taking over 100,000 deferred messages (3.3 MB) held its loop 35 ms
    in one ``json.loads``; its loop now decodes a step a turn (pybroker.cluster.takeover).
    Budget: one slice or one scan (about 1 ms each) a step, whatever the text's size,
    and one decode of at most WHOLE_MAX bytes. Raises ``ValueError`` where ``json.loads``
    does, and for what it would decode in one step past that budget: a text without long
    lists over WHOLE_MAX bytes, an item over ITEM_MAX, nesting too deep for the
    interpreter (``json.loads`` raises RecursionError there). What does not decode this
    way (a span that is not one list, a string that looks like a cut span) is decoded
    whole, within WHOLE_MAX. ``tuples``: the items of a long list of lists come as
    tuples (a channel's pending messages: a tuple of integers is untracked by the
    garbage collector at its first pass, a list never is). ``raw`` may be an anonymous
    mapping (a new leader's copy of 35 MB of states, made in steps)."""
    spans: list[list[Json]] = []
    parts: list[bytes] = []
    at = pos = 0
    n = len(raw)
    try:
        while pos < n:
            stop = min(n, pos + SCAN_STEP)
            m = _LONG_LIST.search(raw, pos, min(n, stop + 1024))
            if m is None:
                pos = stop
                if pos < n:
                    yield
                continue
            a, end = m.start(), m.end()
            while True:                  # the end of the run of list characters
                k = _NOT_LIST.search(raw, end, min(n, end + SCAN_STEP))
                if k is not None:
                    end = k.start()
                    break
                end = min(n, end + SCAN_STEP)
                if end >= n:
                    break
                yield
            b = raw.rfind(b"]", a, end) + 1
            pos = end
            if b - a <= LOADS_SLICE:
                continue
            # [a, b): "[1, 2]" or "[[1, 2], [3]]". A span that is not one such list (a
            # run of these characters around a "{" or a string, or deeper) decodes to
            # an error: a slice cut inside an item or across lists has unbalanced
            # brackets, and the text with the span cut out is not JSON
            items: list[Json] = []
            yield from _slices(raw, a + 1, b - 1, items, tuples)
            spans.append(items)
            parts.append(raw[at:a])
            parts.append(json.dumps(_HOLE + str(len(spans) - 1)).encode())
            at = b
        if not spans:
            return _whole(raw)
        parts.append(raw[at:])
        found = [0]
        v = _fill(_whole(b"".join(parts)), spans, found)
        if found[0] == len(spans):
            return v
    except (ValueError, RecursionError):
        pass
    return _whole(raw)


def _whole(text: bytes | mmap.mmap) -> Json:
    if len(text) > WHOLE_MAX:
        raise ValueError(f"{len(text)} bytes to decode at once (at most {WHOLE_MAX})")
    try:
        return json.loads(text if isinstance(text, bytes) else text[:])  # type: ignore[no-any-return]
    except RecursionError:
        raise ValueError("nested too deep") from None


def _slices(raw: bytes | mmap.mmap, lo: int, hi: int, out: list[Json],
            tuples: bool) -> Generator[None, None, None]:
    # the items of raw[lo:hi], a slice a step, cut after an item: "]," in a list of
    # lists (a "]" there always closes an item), "," in a list of integers
    sep = b"]," if raw[lo:lo + 64].lstrip().startswith(b"[") else b","
    start = lo
    while start < hi:
        cut = raw.find(sep, start + LOADS_SLICE, min(hi, start + ITEM_MAX))
        end = hi if cut < 0 else cut + len(sep) - 1
        if end - start > ITEM_MAX:
            raise ValueError(f"an item over {ITEM_MAX} bytes")
        piece = json.loads(b"[" + raw[start:end] + b"]")
        if not isinstance(piece, list):
            raise ValueError("not a list")
        if tuples:
            out.extend([tuple(x) if type(x) is list else x for x in piece])  # type: ignore[misc]
        else:
            out.extend(piece)
        start = end + 1
        yield


def _fill(v: Json, spans: list[list[Json]], found: list[int]) -> Json:
    """v with each string standing for a cut span replaced by the span's items."""
    if isinstance(v, str):
        if v.startswith(_HOLE):
            k = v[len(_HOLE):]
            if not k.isdigit() or int(k) >= len(spans):
                raise ValueError("a string of the text looks like a cut span")
            found[0] += 1
            return spans[int(k)]
        return v
    if isinstance(v, dict):
        for key, item in v.items():
            if isinstance(item, (dict, list, str)):
                v[key] = _fill(item, spans, found)
    elif isinstance(v, list):
        for i, item in enumerate(v):
            if isinstance(item, (dict, list, str)):
                v[i] = _fill(item, spans, found)
    return v
