"""A replicated topic's channel states as its leader ships them and a follower holds
them, in pieces (docs/replication.md, "Shipped in parts").

The leader encodes each channel's state (``Replica._encode``, on the storage thread)
with ``jsonvalue.dumps_keyed``: the JSON text in pieces, each chunk of deferred
messages a piece of its own, and the *ops* that make those pieces from the ones of that
channel's encoding before (its generation ``base``). A version of the states names one
generation of each channel. A follower says which version it holds; for each channel
the answer carries one of:

- nothing but the generation, when the follower holds it already;
- the ops from the generation it holds and the pieces it lacks (a channel holding
  1,000,000 deferred messages, a few changed: a few chunks, not its 35 MB);
- the whole state, in its pieces, otherwise (the first time, after a reconnect, or when
  the follower missed a generation).

A channel the version does not name was deleted by the leader. A version is a
snapshot: the encodings of every channel when it was made (``Replica.versioned``); a
channel encoded since waits for the next one. A new version wakes the followers'
parked fetches, so that a follower gets each one and its changes apply (one it missed
costs the channels encoded twice since: whole).

On the wire, per topic: ``"parts": [[name, gen, base, floor, size, ops_at, ops_len,
data_at, data_len], ...]`` in the head (``size``: the bytes of the channel's whole
state), and in the blob the ops (big-endian 64-bit pairs, ``jsonvalue.Keyed``) and the
bytes of the new pieces one after another. ``base`` = ``gen``: held already; ``base``
= 0: the whole state (its ops are pieces only). A follower asks for parts with
``"parts": 1`` in its fetch; to one that does not, a leader ships the states whole
(``"states"``).

Budgets: a leader keeps the generations of the last VERSIONS_KEPT versions (a dict of
channel names each) to know what a follower holds, and one answer's worth of parts per
version held (at most VERSIONS_KEPT + 1), made on its loop without a walk over any
channel's pieces (``ship`` packs the ops on the storage thread); a follower's loop
walks at most MAX_PIECES ops a channel (a state of more goes whole as one piece) and
takes an answer of more than TAKE_STEP ops a step a turn, its parts are checked against what it holds (ValueError: it keeps the version before and
asks for everything again), and the new pieces are copied out of the frame when they
are under COPY_BELOW bytes in all (else kept as views of it: a frame of 35 MB of states
is not copied on the loop, and its records, at most the fetch's budget, are what it
keeps alive besides).
"""
from __future__ import annotations

import json
import struct
from collections.abc import Generator, Iterator, Sequence
from typing import NamedTuple

from pybroker.cluster.ports import Json, need_int
from pybroker.jsonvalue import Keyed, Piece, apply_ops, grouped, new_gen

VERSIONS_KEPT = 8              # versions whose generations a leader remembers
COPY_BELOW = 1 << 20           # a follower copies the new pieces of an answer under this
# pieces of one channel's state a follower's loop walks at most (a whole state of
# 16,384 pieces: 4.6 ms to take); a state of more goes whole, as one piece
MAX_PIECES = 16_384
# op pairs a follower's take of one answer walks a step (about 2.3 ms; an answer of
# many channels is taken a step a turn: Replica._take_parts)
TAKE_STEP = 8_192


class Shipped(NamedTuple):
    """A leader's encoding of one channel's state (``ship``)."""

    keyed: Keyed
    floor: int          # the lowest offset it still needs
    ops: bytes          # keyed.ops packed (b"": none, the state is whole)
    lit_size: int       # the bytes of keyed.literals
    whole_ops: bytes    # the ops of the whole state: a piece each, or one piece


def ship(keyed: Keyed, floor: int) -> Shipped:
    """A channel's encoding made ready to ship (off the loops: the storage thread).
    A state of over MAX_PIECES pieces (deferred messages far apart: a chunk each) goes
    whole each time, as one piece, so that a follower's loop never walks more than
    MAX_PIECES pieces of a channel; its pieces are joined here into pieces of about
    256 KB (jsonvalue.grouped), so that the leader's loop sends a few hundred, not a million.
    Such a state is a generation of its own (``new_gen``): a follower holds it as one
    piece, so the next encoding's ops, made from the encoding's pieces, are not for it
    (that state goes whole)."""
    if len(keyed.pieces) > MAX_PIECES:
        # (its ops and new pieces are never sent: not kept, a pair or two a piece)
        return Shipped(keyed._replace(gen=new_gen(), base=0, pieces=list(grouped(keyed.pieces)),
                                      ops=[], literals=[]),
                       floor, b"", 0, _pack([-1, keyed.size]))
    return Shipped(keyed, floor, _pack(keyed.ops) if keyed.base else b"",
                   sum(map(len, keyed.literals)),
                   _pack([x for p in keyed.pieces for x in (-1, len(p))]))


def _pack(ops: Sequence[int]) -> bytes:
    return struct.pack(f">{len(ops)}q", *ops)


def whole(shipped: dict[str, Shipped]) -> tuple[list[Piece], int, list[int]]:
    """Every channel's state as one JSON object in pieces, its length and the floors
    (a follower that takes states whole: ``"states"``)."""
    pieces: list[Piece] = [b"{"]
    floors = []
    for n, s in shipped.items():
        pieces += (b", " if len(pieces) > 1 else b"", json.dumps(n).encode(), b": ")
        pieces += s.keyed.pieces
        floors.append(s.floor)
    pieces.append(b"}")
    return pieces, sum(map(len, pieces)), floors


def delta(shipped: dict[str, Shipped],
          held: dict[str, int] | None) -> tuple[list[Json], list[Piece], int]:
    """What a follower holding the generations ``held`` (None: nothing known) needs to
    hold every channel's of ``shipped``: the ``"parts"`` items, the blob's pieces
    (from 0) and their length. No walk over a channel's pieces (``ship`` made the
    ops)."""
    items: list[Json] = []
    blobs: list[Piece] = []
    at = 0
    for name, s in shipped.items():
        k = s.keyed
        h = held.get(name) if held is not None else None
        if h == k.gen:
            items.append([name, k.gen, k.gen, s.floor, k.size, at, 0, at, 0])
            continue
        if s.ops and h == k.base:
            base, ops, lits, size = k.base, s.ops, k.literals, s.lit_size
        else:
            base, ops, lits, size = 0, s.whole_ops, k.pieces, k.size
        items.append([name, k.gen, base, s.floor, k.size, at, len(ops), at + len(ops), size])
        blobs.append(ops)
        blobs += lits
        at += len(ops) + size
    return items, blobs, at


class Part(NamedTuple):
    """One channel's item of a ``"parts"`` answer, checked where it was read."""

    name: str
    gen: int
    base: int
    floor: int
    size: int           # the bytes of its whole state
    ops: memoryview
    data: memoryview


def parts_of(v: Json, blob: memoryview) -> list[Part]:
    """The items of a ``"parts"`` answer, their spans within ``blob`` (ValueError for
    anything malformed or outside the frame)."""
    if not isinstance(v, list):
        raise ValueError("parts are not a list")
    out = []
    for item in v:
        if not isinstance(item, list) or len(item) != 9 or not isinstance(item[0], str):
            raise ValueError("a part is not [name, gen, base, floor, size, 4 spans]")
        nums = [need_int(x) for x in item[1:]]
        oa, ol, da, dl = nums[4:]
        if min(nums) < 0 or oa + ol > len(blob) or da + dl > len(blob) or ol % 16 \
                or ol // 16 > MAX_PIECES:
            raise ValueError(f"a part of {item[0]!r} outside the frame or too large")
        out.append(Part(item[0], nums[0], nums[1], nums[2], nums[3], blob[oa:oa + ol],
                        blob[da:da + dl]))
    return out


class Held(NamedTuple):
    """A follower's copy of one channel's state: the generation, its pieces and their
    length."""

    gen: int
    pieces: list[Piece]
    size: int


def take(held: dict[str, Held], parts: list[Part]) -> dict[str, Held]:
    """The channels a follower holds once it takes ``parts`` (a version: the channels
    it does not name are gone), all at once (``take_steps``' steps run in a row).
    ValueError when they do not fit what it holds."""
    steps = take_steps(held, parts)
    while True:
        try:
            next(steps)
        except StopIteration as end:
            return end.value        # type: ignore[no-any-return]


def ops_of(parts: list[Part]) -> int:
    """The op pairs a take of ``parts`` walks."""
    return sum(len(p.ops) for p in parts) // 16


def take_steps(held: dict[str, Held],
               parts: list[Part]) -> Generator[None, None, dict[str, Held]]:
    """``take`` a step at a time: a step walks about TAKE_STEP op pairs, and at most
    TAKE_STEP + MAX_PIECES (one channel is never cut). ValueError when the parts do not
    fit what is held (then it holds nothing new and asks for everything)."""
    copy = sum(len(p.data) for p in parts) < COPY_BELOW
    out: dict[str, Held] = {}
    walked = 0
    for p in parts:
        if walked >= TAKE_STEP:
            yield
            walked = 0
        out[p.name] = _take_one(held.get(p.name), p, copy)
        walked += len(p.ops) // 16 + 1
    return out


def _take_one(have: Held | None, p: Part, copy: bool) -> Held:
    if p.base == p.gen:
        if have is None or have.gen != p.gen:
            raise ValueError(f"channel {p.name!r}: generation {p.gen} is not held")
        return have
    if p.base and (have is None or have.gen != p.base):
        raise ValueError(f"channel {p.name!r}: generation {p.base} is not held")
    ops = struct.unpack(f">{len(p.ops) // 8}q", p.ops)
    if sum(ops[i + 1] for i in range(0, len(ops), 2) if ops[i] == -1) != len(p.data):
        raise ValueError(f"channel {p.name!r}: its new pieces are not its bytes")
    pieces = apply_ops(have.pieces if p.base and have is not None else (), ops,
                       _literals(p.data, ops, copy))
    # (its size as the leader says: checked when it is copied to take over)
    return Held(p.gen, pieces, p.size)


def _literals(data: memoryview, ops: Sequence[int], copy: bool) -> Iterator[Piece]:
    """The new pieces, one per literal op, cut from ``data`` in order (their sizes
    add up to it: checked by ``take``)."""
    at = 0
    for i in range(0, len(ops) - 1, 2):
        if ops[i] == -1:
            n = ops[i + 1]
            if n < 0:
                raise ValueError("a new piece of a negative size")
            view = data[at:at + n]
            yield bytes(view) if copy else view
            at += n


def joined(held: dict[str, Held]) -> tuple[list[Piece], int]:
    """The channels held as one JSON object (``whole``'s text), in pieces, and its
    length (a follower taking over reads it: pybroker.cluster.takeover)."""
    pieces: list[Piece] = [b"{"]
    size = 2
    for n, h in held.items():
        name = (b", " if len(pieces) > 1 else b"") + json.dumps(n).encode() + b": "
        pieces.append(name)
        pieces += h.pieces
        size += len(name) + h.size
    pieces.append(b"}")
    return pieces, size


__all__ = ["COPY_BELOW", "MAX_PIECES", "TAKE_STEP", "VERSIONS_KEPT", "Held", "Part", "Shipped",
           "delta", "joined", "ops_of", "parts_of", "ship", "take", "take_steps", "whole"]
