"""JSON values as ``json.loads`` returns them, and the narrowing helpers that read one.

``Json`` is the recursive type of any decoded document; ``JsonObject`` is an object.
Where a document's shape is fixed (the /stats document, core.statsdoc) it has its own
TypedDicts; ``Json`` is for documents whose shape is the peer's (a remote /stats or
/info, a lookupd answer, a TOML table): their fields are narrowed where they are read,
with the helpers below, each of which raises ``JsonShapeError`` (a ``ValueError``) naming
the field when the value has another type.
"""
from __future__ import annotations

import itertools
import json
import mmap
import re
import time
from collections.abc import Generator, Iterable, Iterator, Sequence
from typing import Any, NamedTuple, Union

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
    out: list[str | _Ref] = []
    _dump(v, out)
    return [p if isinstance(p, str) else bytes(p.text.piece(p.first)).decode() for p in out]


BYTES_PIECE = 256 * 1024     # UTF-8 bytes ``dumps_bytes`` gathers per piece


def dumps_bytes(v: object) -> Iterator[bytes]:
    """``dumps_yielding``'s text as UTF-8, in pieces of about BYTES_PIECE bytes (each
    a short hold of the GIL), never joined: written one by one (``_fsutil.atomic_write``)
    or sent as they are (a replicated channel's state)."""
    out: list[str | _Ref] = []
    _dump(v, out)
    return grouped(p.encode() if isinstance(p, str) else p.text.piece(p.first) for p in out)


def grouped(pieces: Iterable[bytes | memoryview]) -> Iterator[bytes]:
    """The bytes of ``pieces`` in pieces of about BYTES_PIECE bytes (many small pieces
    made into few, each copied once)."""
    buf = bytearray()
    for p in pieces:
        buf += p
        if len(buf) >= BYTES_PIECE:
            yield bytes(buf)
            buf.clear()
    if buf:
        yield bytes(buf)


Piece = Union[bytes, memoryview]
_gens = itertools.count(1)     # keyed encodings, in this process


def new_gen() -> int:
    """A generation no keyed encoding has (nor will have): for a text whose pieces a
    reader does not hold as they were encoded (``ops`` are never made from it)."""
    return next(_gens)


class Keyed(NamedTuple):
    """A keyed encoding (``dumps_keyed``): the text in ``pieces``, each part's text
    (a chunk of deferred messages) a piece of its own, the rest in pieces between them;
    and how to make those pieces from the ones of the encoding ``base`` (0: none):
    ``ops``, pairs (k, n) one after another: n pieces of ``base`` from its k-th on, or,
    with k = -1, one piece of n bytes not in it, the next of ``literals``."""

    base: int
    gen: int
    pieces: list[Piece]
    ops: list[int]
    literals: list[Piece]
    size: int


def dumps_keyed(v: object, memo: PartTexts) -> Keyed:
    """``dumps_bytes``'s text in pieces a reader can keep, and how they are made from
    those of the last keyed encoding with ``memo`` (the PartTexts of the one PartedList
    in ``v``, or a fresh one: the memory of this value from one encoding to the next).
    A part kept from that encoding, at the same kind of place (first in its list, or
    not), is a piece its reader holds, and so is a piece between parts with the same
    bytes; runs of them one after another in both are one pair of ``ops``. A state of
    1,000,000 deferred messages with a few chunks changed is made of a few new pieces
    (a leader ships those only: Replica.states_for). Time: one pass over the pieces,
    besides ``_dump``'s."""
    out: list[str | _Ref] = []
    _dump(v, out)
    base = memo.gen
    k = _Keying(base, memo.lits if base else {})
    texts: list[str] = []
    for p in out:
        if isinstance(p, str):
            texts.append(p)
            continue
        k.between(texts)
        texts = []
        t = p.text
        prev = t.at if base and t.gen == base and t.first == p.first else -1
        t.gen, t.at, t.first = k.gen, len(k.pieces), p.first
        k.add(t.piece(p.first), prev)
    k.between(texts)
    if k.run_n:
        k.ops += (k.run_at, k.run_n)
    memo.gen, memo.lits = k.gen, k.lits
    return Keyed(base, k.gen, k.pieces, k.ops, k.literals, k.size)


class _Keying:
    """``dumps_keyed``'s pieces and ops as they are made."""

    __slots__ = ("gen", "old_lits", "lits", "pieces", "ops", "literals", "size",
                 "run_at", "run_n")

    def __init__(self, base: int, old_lits: dict[bytes, int]) -> None:
        self.gen = next(_gens)
        self.old_lits = old_lits
        self.lits: dict[bytes, int] = {}
        self.pieces: list[Piece] = []
        self.ops: list[int] = []
        self.literals: list[Piece] = []
        self.size = 0
        self.run_at = self.run_n = 0      # a run of pieces of the base being copied

    def between(self, texts: list[str]) -> None:
        """The text between two parts: one piece (none if empty)."""
        piece = "".join(texts).encode()
        if piece:
            self.lits.setdefault(piece, len(self.pieces))
            self.add(piece, self.old_lits.get(piece, -1))

    def add(self, piece: Piece, prev: int) -> None:
        """The next piece; ``prev``: where the base has it (-1: nowhere)."""
        if prev >= 0 and self.run_n and prev == self.run_at + self.run_n:
            self.run_n += 1
        else:
            if self.run_n:
                self.ops += (self.run_at, self.run_n)
            self.run_at, self.run_n = prev, int(prev >= 0)
            if prev < 0:
                self.ops += (-1, len(piece))
                self.literals.append(piece)
        self.pieces.append(piece)
        self.size += len(piece)


def apply_ops(base: Sequence[Piece], ops: Sequence[int],
              literals: Iterator[Piece]) -> list[Piece]:
    """The pieces ``ops`` make (``Keyed``) from ``base``'s and the next ``literals``
    (a reader's side; ValueError for a run outside ``base`` or a literal missing or of
    another size). Time: one step per pair, the runs copied as references."""
    if len(ops) % 2:
        raise ValueError("ops are pairs")
    out: list[Piece] = []
    for i in range(0, len(ops), 2):
        k, n = ops[i], ops[i + 1]
        if k == -1:
            piece = next(literals, None)
            if piece is None or len(piece) != n:
                raise ValueError("a literal piece missing, or of another size")
            out.append(piece)
        elif k < 0 or n <= 0 or k + n > len(base):
            raise ValueError(f"a run of {n} pieces from {k} outside the {len(base)} held")
        else:
            out += base[k:k + n]
    return out


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
    thread); one per list encoded (a channel's ``pending``). ``dumps_keyed`` also
    keeps here where each piece of its last encoding was (``gen``, ``lits``, and each
    part's ``_Text``), to say how the next encoding is made from it."""

    __slots__ = ("_last", "_next", "made", "gen", "lits")

    def __init__(self) -> None:
        self._last: dict[object, _Text] = {}
        self._next: dict[object, _Text] = {}
        self.made = 0        # parts encoded (not found kept), in all: for the tests
        self.gen = 0         # the last keyed encoding (0: none)
        self.lits: dict[bytes, int] = {}    # its pieces between parts, by their bytes

    def __len__(self) -> int:
        return len(self._last)

    def begin(self) -> None:
        self._next = {}

    def last_part(self, key: object) -> Sequence[Any] | None:
        """The part of this key the last encoding met (its text kept), or None."""
        got = self._last.get(key)
        return None if got is None else got.part

    def text(self, part: Sequence[Any]) -> tuple[_Text, bool]:
        """The part's items as JSON (without the brackets), and whether it was
        encoded now (else kept from the last encoding). A part with a ``key``
        (``KeyedPart``) is made anew for each encoding: its text is kept while a part
        of that key has the same items."""
        key: object = getattr(part, "key", None)
        if key is None:
            key = id(part)
            got = self._last.get(key)
            made = got is None or got.part is not part     # (an id may be another's now)
        else:
            got = self._last.get(key)
            made = got is None or got.part is not part and got.part != part
        if made:
            got = _Text(part, b", " + json.dumps(part)[1:-1].encode())
            self.made += 1
        assert got is not None
        self._next[key] = got
        return got, made

    def end(self) -> None:
        """The encoding is complete: keep what it met, forget the rest."""
        self._last, self._next = self._next, {}


class KeyedPart(tuple):  # type: ignore[type-arg]
    """A part of a PartedList made anew for each encoding (a chunk of a channel's
    messages in flight, core/lifecycle.py), known from one encoding to the next by its
    ``key`` rather than by its identity (PartTexts)."""

    key: object
    # what its items are made from, as bytes, when its maker says (None: not said; 12
    # bytes an entry for a channel's pending chunks, kept with the text in PartTexts):
    # a maker that finds the part kept for its key has this ``sig`` gives that part
    # again instead of making the items (core/lifecycle.py ``pending_chunks``)
    sig: bytes | None

    def __new__(cls, items: Iterable[Any], key: object) -> KeyedPart:
        self = super().__new__(cls, items)
        self.key = key
        self.sig = None
        return self


class _Text:
    """A part's JSON text, after ", " (without it when the part comes first), and where
    it was in the pieces of the keyed encoding ``gen`` (``dumps_keyed``)."""

    __slots__ = ("part", "data", "gen", "at", "first")

    def __init__(self, part: Sequence[Any], data: bytes) -> None:
        self.part = part
        self.data = data
        self.gen = 0
        self.at = -1
        self.first = False

    def piece(self, first: bool) -> bytes | memoryview:
        return memoryview(self.data)[2:] if first else self.data


class _Ref(NamedTuple):
    """A kept part's text in ``_dump``'s output (its place says if it comes first)."""

    text: _Text
    first: bool


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


def _dump(v: object, out: list[str | _Ref]) -> None:
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
                out.append(sep)
                out.append(json.dumps(part)[1:-1])
                made += len(part)
            else:
                # a kept part counts one (a lookup), so that many small ones kept
                # still offer the GIL every YIELD_ITEMS
                text, new = texts.text(part)
                made += len(part) if new else 1
                out.append(_Ref(text, not sep))
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
