"""The in-flight table: which of a channel's offsets are in flight, and in which
Flight. ``nsqf_if_*`` in csrc/inflight.c (declared in csrc/nsqframe.h) hold offset ->
flight slot in arrays this module owns; the Flight objects stay in a Python list, one
per slot. With the pure-Python codec (or a compiled module built before the table
existed) a dict does the same.

Why: a dict entry per message in flight (``dict.fromkeys`` over a flight's offsets,
then a lookup and a ``del`` per FIN, each in a Python loop) was about a fifth of the
loop thread's time in the writer-and-reader flow (py-spy; docs/io.md). Here a flight
costs one call, a batch of FINs one call, a timed-out flight one call.

Owned by the channel's owner loop; ``InFlight`` reads like the dict it replaces
(``get``, ``in``, ``len``, iteration over offsets, ``items``) and adds the batched
operations: ``add_flights``, ``finish``, ``take``.
"""
from __future__ import annotations

import array
import bisect
import functools
import itertools
import struct
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Generic, Protocol, TypeVar

from pybroker._native import BACKEND, _ffi, _lib

CData = Any     # cffi's cdata: untyped, as _native's ffi and lib
_C = BACKEND == "c" and hasattr(_lib, "nsqf_if_fin")
_SORT = _C and hasattr(_lib, "nsqf_sort_from")
_SORT_PAIRS = _C and hasattr(_lib, "nsqf_sort_pairs")
_SORT_ORDER = _C and hasattr(_lib, "nsqf_sort_order")
_GATHER = _C and hasattr(_lib, "nsqf_gather_i32")
_INTERSECT = _C and hasattr(_lib, "nsqf_intersect_i64")
MIN_CAP = 64          # table entries of a new table (a power of two)
SMALL = 8             # at most this many flights or FINs: one call each, no arrays
SHRINK_FROM = 4096    # a table this large or larger shrinks when 1/16 full


class FlightLike(Protocol):
    """What the table needs of a Flight (core/flight.py)."""

    @property
    def client(self) -> object: ...
    @property
    def first(self) -> int: ...
    @property
    def n(self) -> int: ...
    @property
    def attempts(self) -> int: ...
    slot: int


F = TypeVar("F", bound=FlightLike)


def sorted_pairs(offs: bytes, slots: bytes) -> tuple[array.array[int], array.array[int]]:
    """A table's dump (int64 offsets, int32 slots, as ``dump_raw`` gives them) as two
    arrays in offset order (``sort_pairs``)."""
    keys, vals = array.array("q"), array.array("i")
    keys.frombytes(offs)
    vals.frombytes(slots)
    sort_pairs(keys, vals)
    return keys, vals


def sort_order(keys: array.array[int]) -> array.array[int] | None:
    """Sort keys (int64, 'q') in place and return the index each had ('i'): the
    permutation that sorts a list by them, equal keys in their order; None when they
    were in order already. One pass and, if need be, a radix sort in C
    (``nsqf_sort_order``, the GIL released meanwhile), else Python's sort."""
    n = len(keys)
    if n < 2:
        return None
    if not _SORT_ORDER:
        perm = _python_sort(keys)
        return None if perm is None else array.array("i", perm)
    order = array.array("i", bytes(4 * n))
    if _lib.nsqf_sort_order(_ffi.from_buffer("int64_t[]", keys),
                            _ffi.from_buffer("int32_t[]", order),
                            _ffi.new("int64_t[]", n), _ffi.new("int32_t[]", n), n):
        return None
    return order


def sort_pairs(keys: array.array[int], vals: array.array[int]) -> None:
    """Sort the pairs (keys[i], vals[i]) by key in place, equal keys in their order:
    one radix sort in C (``nsqf_sort_pairs``: no Python object per entry, and the GIL
    released meanwhile), else Python's sort. keys: int64 ('q'); vals: int32 ('i')."""
    n = len(keys)
    if n < 2:
        return
    if not _SORT_PAIRS:
        perm = _python_sort(keys)
        if perm is not None:
            vals[:] = array.array("i", [vals[i] for i in perm])
        return
    _lib.nsqf_sort_pairs(_ffi.from_buffer("int64_t[]", keys), _ffi.from_buffer("int32_t[]", vals),
                         _ffi.new("int64_t[]", n), _ffi.new("int32_t[]", n), n)


def gather(table: array.array[int], idx: array.array[int]) -> array.array[int]:
    """table[i] for each i of idx, 0 for an i outside the table (int32 arrays, 'i'):
    one call in C (``nsqf_gather_i32``, the GIL released meanwhile), else a Python
    pass."""
    n = len(idx)
    if not _GATHER:
        size = len(table)
        return array.array("i", [table[k] if 0 <= k < size else 0 for k in idx])
    out = array.array("i", bytes(4 * n))
    if n:
        _lib.nsqf_gather_i32(_ffi.from_buffer("int32_t[]", table) if table else _ffi.NULL,
                             len(table), _ffi.from_buffer("int32_t[]", idx),
                             _ffi.from_buffer("int32_t[]", out), n)
    return out


def intersect(a: memoryview | array.array[int], b: array.array[int], vb: array.array[int]
              ) -> tuple[array.array[int], array.array[int]]:
    """The keys of a (int64s, ascending, each once) that b (int64, ascending, each
    once) holds too, and beside each the value vb (int64) has for it: one merge in C
    (``nsqf_intersect_i64``), else in Python."""
    keys, vals = array.array("q"), array.array("q")
    na = memoryview(a).nbytes // 8
    nb = len(b)
    if not na or not nb:
        return keys, vals
    if not _INTERSECT:
        at = dict(zip(b, vb))
        keys.extend(k for k in memoryview(a) if k in at)
        vals.extend(at[k] for k in keys)
        return keys, vals
    room = min(na, nb)
    keys.frombytes(bytes(8 * room))
    vals.frombytes(bytes(8 * room))
    n = _lib.nsqf_intersect_i64(_ffi.from_buffer("int64_t[]", a), na,
                                _ffi.from_buffer("int64_t[]", b),
                                _ffi.from_buffer("int64_t[]", vb), nb,
                                _ffi.from_buffer("int64_t[]", keys),
                                _ffi.from_buffer("int64_t[]", vals))
    del keys[n:], vals[n:]
    return keys, vals


def _python_sort(keys: array.array[int]) -> list[int] | None:
    """keys sorted in place by Python's (stable) sort; the permutation, or None when
    they were in order already (the pure-Python twin of the two above)."""
    perm = sorted(range(len(keys)), key=keys.__getitem__)
    if all(i == p for i, p in enumerate(perm)):
        return None
    keys[:] = array.array("q", [keys[i] for i in perm])
    return perm


def pack_offsets(offsets: Iterable[int], n: int) -> bytes:
    """The ``n`` offsets as native int64s, for an ``array("q").frombytes``: one C pass
    (``array("q", offsets)`` converts and appends them one at a time: about twice as
    long; a listing of 250,000 for a rewind took 10 ms that way)."""
    return struct.pack(f"{n}q", *offsets)


def _sorted_from(offsets: Iterable[int], more: Iterable[int], offset: int
                 ) -> array.array[int]:
    return array.array("q", sorted({o for o in offsets if o >= offset}
                                   | {o for o in more if o >= offset}))


class _PureTable:
    """The table as dicts (PYBROKER_PURE=1, or no compiled module)."""

    def __init__(self) -> None:
        self.where: dict[int, int] = {}
        self.live: list[int] = []
        self.tags: list[int] = []

    def slots(self, n: int) -> None:
        grow = n - len(self.live)
        if grow > 0:
            self.live += [0] * grow
            self.tags += [0] * grow

    def add(self, firsts: Sequence[int], ns: Sequence[int], slots: Sequence[int],
            tags: Sequence[int], total: int) -> int:
        where = self.where
        again = 0
        for first, n, slot, tag in zip(firsts, ns, slots, tags):
            self.live[slot] = n
            self.tags[slot] = tag
            for off in range(first, first + n):
                old = where.get(off)
                if old is not None:
                    self.live[old] -= 1
                    again += 1
                where[off] = slot
        return again

    def fin(self, tags: Sequence[int], offs: Sequence[int]) -> tuple[list[int], list[int]]:
        where = self.where
        failed: list[int] = []
        emptied: list[int] = []
        for i, (off, tag) in enumerate(zip(offs, tags)):
            slot = where.get(off)
            if slot is None:
                failed.append(2 * i)
            elif self.tags[slot] != tag:
                failed.append(2 * i + 1)
            else:
                del where[off]
                self.live[slot] -= 1
                if not self.live[slot]:
                    emptied.append(slot)
        return failed, emptied

    def add1(self, first: int, n: int, slot: int, tag: int) -> int:
        return self.add((first,), (n,), (slot,), (tag,), n)

    def fin1(self, tag: int, off: int) -> int:
        slot = self.where.get(off)
        if slot is None:
            return -1
        if self.tags[slot] != tag:
            return -2
        del self.where[off]
        self.live[slot] -= 1
        return 4 * slot + (0 if self.live[slot] else 2)

    def get(self, off: int) -> int:
        return self.where.get(off, -1)

    def pop(self, off: int) -> int:
        slot = self.where.pop(off, -1)
        if slot >= 0:
            self.live[slot] -= 1
        return slot

    def take(self, first: int, n: int, slot: int) -> list[int]:
        where = self.where
        got = [off for off in range(first, first + n) if where.get(off) == slot]
        for off in got:
            del where[off]
        self.live[slot] -= len(got)
        return got

    def dump(self) -> tuple[list[int], list[int]]:
        return list(self.where), list(self.where.values())

    def dump_raw(self) -> tuple[bytes, bytes]:
        return (array.array("q", self.where).tobytes(),
                array.array("i", self.where.values()).tobytes())

    def low(self) -> int:
        return min(self.where) if self.where else -1

    def sorted_from(self, offset: int, more: array.array[int]) -> array.array[int]:
        return _sorted_from(self.where, more, offset)

    def count(self) -> int:
        return len(self.where)

    def clear(self) -> None:
        self.where.clear()
        self.live = [0] * len(self.live)


class _CTable:
    """The table in C arrays (nsqf_if_*); scratch arrays for the calls' outputs."""

    def __init__(self) -> None:
        # one struct for the table's life (resizing changes its fields), so that the
        # one-offset calls can be bound to it once
        self.t: CData = _ffi.new("nsqf_inflight *")
        self._keys: CData = None
        self._slots: CData = None
        self._live: CData = None
        self._tags: CData = None
        # the outputs of nsqf_if_fin: made now (a call with no offset needs them too)
        self._scratch = 64
        self._failed: CData = _ffi.new("int32_t[]", self._scratch)
        self._emptied: CData = _ffi.new("int32_t[]", self._scratch)
        self._nfailed: CData = _ffi.new("int *")
        self._resize(MIN_CAP)
        self.fin1 = functools.partial(_lib.nsqf_if_fin1, self.t)

    @property
    def live(self) -> CData:
        return self._live

    def _resize(self, cap: int) -> None:
        keys = _ffi.new("int64_t[]", cap)
        _ffi.buffer(keys)[:] = b"\xff" * (8 * cap)     # -1: empty
        slots = _ffi.new("int32_t[]", cap)
        t = _ffi.new("nsqf_inflight *")
        t.keys, t.slots, t.cap, t.used = keys, slots, cap, 0
        t.live, t.tags, t.nslots = self.t.live, self.t.tags, self.t.nslots
        if self._keys is not None:
            _lib.nsqf_if_rehash(self.t, t)
        self.t.keys, self.t.slots, self.t.cap, self.t.used = keys, slots, cap, t.used
        self._keys, self._slots = keys, slots

    def slots(self, n: int) -> None:
        t = self.t
        if n <= t.nslots:
            return
        size = max(n, 2 * t.nslots, 64)
        live = _ffi.new("int64_t[]", size)
        tags = _ffi.new("uint64_t[]", size)
        if t.nslots:
            _ffi.memmove(live, t.live, 8 * t.nslots)
            _ffi.memmove(tags, t.tags, 8 * t.nslots)
        t.live, t.tags, t.nslots = live, tags, size
        self._live, self._tags = live, tags

    def _room(self, more: int) -> None:
        t = self.t
        need = t.used + more
        if 2 * need > t.cap:
            cap = t.cap
            while 2 * need > cap:
                cap *= 2
            self._resize(cap)

    def _shrink(self) -> None:
        t = self.t
        if t.cap >= SHRINK_FROM and 16 * t.used < t.cap:
            cap = MIN_CAP
            while cap < 4 * t.used:
                cap *= 2
            self._resize(cap)

    def add(self, firsts: Sequence[int], ns: Sequence[int], slots: Sequence[int],
            tags: Sequence[int], total: int) -> int:
        self._room(total)
        fa, na = array.array("q", firsts), array.array("q", ns)
        sa, ta = array.array("i", slots), array.array("Q", tags)
        with _ffi.from_buffer("int64_t[]", fa) as fp, \
                _ffi.from_buffer("int64_t[]", na) as np_, \
                _ffi.from_buffer("int32_t[]", sa) as sp, \
                _ffi.from_buffer("uint64_t[]", ta) as tp:
            return int(_lib.nsqf_if_add(self.t, fp, np_, sp, tp, len(fa)))

    def fin(self, tags: "array.array[int]", offs: "array.array[int]"
            ) -> tuple[list[int], list[int]]:
        n = len(offs)
        if n > self._scratch:
            self._scratch = max(n, 2 * self._scratch, 64)
            self._failed = _ffi.new("int32_t[]", self._scratch)
            self._emptied = _ffi.new("int32_t[]", self._scratch)
        with _ffi.from_buffer("int64_t[]", offs) as op, \
                _ffi.from_buffer("uint64_t[]", tags) as tp:
            ne = _lib.nsqf_if_fin(self.t, tp, op, n, self._failed, self._nfailed,
                                  self._emptied)
        nf = self._nfailed[0]
        failed = _ffi.unpack(self._failed, nf) if nf else []
        emptied = _ffi.unpack(self._emptied, ne) if ne else []
        self._shrink()
        return failed, emptied

    def add1(self, first: int, n: int, slot: int, tag: int) -> int:
        self._room(n)
        return int(_lib.nsqf_if_add1(self.t, first, n, slot, tag))

    def get(self, off: int) -> int:
        return int(_lib.nsqf_if_get(self.t, off))

    def pop(self, off: int) -> int:
        return int(_lib.nsqf_if_pop(self.t, off))

    def take(self, first: int, n: int, slot: int) -> list[int]:
        out = _ffi.new("int64_t[]", n)
        got = _lib.nsqf_if_take(self.t, first, n, slot, out)
        self._shrink()
        return list(_ffi.unpack(out, got))

    def dump(self) -> tuple[list[int], list[int]]:
        n = self.t.used
        offs = _ffi.new("int64_t[]", max(n, 1))
        slots = _ffi.new("int32_t[]", max(n, 1))
        got = _lib.nsqf_if_dump(self.t, offs, slots)
        return list(_ffi.unpack(offs, got)), list(_ffi.unpack(slots, got))

    def dump_raw(self) -> tuple[bytes, bytes]:
        """``dump`` as the arrays' bytes (int64 offsets, int32 slots): no Python
        object per entry."""
        n = self.t.used
        offs = _ffi.new("int64_t[]", max(n, 1))
        slots = _ffi.new("int32_t[]", max(n, 1))
        got = _lib.nsqf_if_dump(self.t, offs, slots)
        return bytes(_ffi.buffer(offs, 8 * got)), bytes(_ffi.buffer(slots, 4 * got))

    def low(self) -> int:
        return int(_lib.nsqf_if_min(self.t))

    def sorted_from(self, offset: int, more: array.array[int]) -> array.array[int]:
        """The table's offsets and ``more``'s at or after offset, ascending, once each
        (two C calls: a pass over the table, then a radix sort; no Python object per
        offset)."""
        if not _SORT:            # (a compiled module built before nsqf_sort_from)
            return _sorted_from(self.dump()[0], more, offset)
        used = self.t.used
        n = used + len(more)
        a = _ffi.new("int64_t[]", max(n, 1))
        got = _lib.nsqf_if_from(self.t, offset, a)
        if len(more):
            _ffi.memmove(a + got, more, 8 * len(more))
        tmp = _ffi.new("int64_t[]", max(n, 1))
        kept = _lib.nsqf_sort_from(a, tmp, got + len(more), offset)
        out = array.array("q")
        out.frombytes(_ffi.buffer(a, 8 * kept))
        return out

    def count(self) -> int:
        return int(self.t.used)

    def clear(self) -> None:
        t = self.t
        self._keys = None     # no rehash: a fresh table
        self._resize(MIN_CAP)
        if t.nslots:
            _ffi.buffer(self.t.live, 8 * t.nslots)[:] = bytes(8 * t.nslots)


class InFlightCopy(Generic[F]):
    """An InFlight's contents at one moment (``InFlight.copy``): its one-message
    flights (a copy of their dict), its table's offsets and slots as bytes, and the
    flight of each slot. Never changed; equal to another copy of the same contents (the flights compared as
    objects). A Flight's offsets and attempts never change, so its pairs can be made
    on any thread, any time later."""

    __slots__ = ("one", "offs", "slots", "flights")

    def __init__(self, one: dict[int, F], offs: bytes, slots: bytes,
                 flights: tuple[F | None, ...]) -> None:
        self.one = one
        self.offs = offs
        self.slots = slots
        self.flights = flights

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, InFlightCopy):
            return NotImplemented
        return (self.offs == other.offs and self.slots == other.slots
                and self.one == other.one and self.flights == other.flights)

    __hash__ = None  # type: ignore[assignment]

    def __len__(self) -> int:
        return len(self.one) + len(self.offs) // 8

    def items(self) -> list[tuple[int, F]]:
        """(offset, flight) of each offset in flight, as ``InFlight.items`` had them."""
        out = list(self.one.items())
        offs, slots = array.array("q"), array.array("i")
        offs.frombytes(self.offs)
        slots.frombytes(self.slots)
        flights = self.flights
        for off, slot in zip(offs, slots):
            f = flights[slot]
            assert f is not None
            out.append((off, f))
        return out

    def entries(self) -> list[tuple[int, int, int]]:
        """(offset, attempts, 0) of each offset in flight, a channel state's pending
        entries (core/lifecycle.py ``pending_chunks``), in one pass: the flights of one
        message first, in the order they went out, then the table's in offset order
        (sorted in C here, so that with no flight of one the entries need no sort
        there)."""
        out = [(off, f.attempts, 0) for off, f in self.one.items()]
        offs, slots = sorted_pairs(self.offs, self.slots)
        out += zip(offs, gather(self._slot_attempts(), slots), itertools.repeat(0))
        return out

    def columns(self) -> tuple[array.array[int], array.array[int]]:
        """The offsets in flight ('q') and the attempts of each ('i'), in no order
        (the flights of one first, then the table's): ``entries`` as two arrays, with
        no Python object per entry in the table (its attempts gathered in C)."""
        offs = array.array("q", self.one)
        attempts = array.array("i", [f.attempts for f in self.one.values()])
        offs.frombytes(self.offs)
        slots = array.array("i")
        slots.frombytes(self.slots)
        attempts += gather(self._slot_attempts(), slots)
        return offs, attempts

    def _slot_attempts(self) -> array.array[int]:
        """The attempts of each slot's flight (0 for a free slot)."""
        return array.array("i", [0 if f is None else f.attempts for f in self.flights])


class InFlight(Generic[F]):
    """offset -> the Flight it went out in, for one channel (see the module).

    A flight of one message (a consumer at RDY 1, a TOUCHed message) is a dict entry:
    a store and a lookup cost less than a call into C with its arrays. Larger flights
    are in the table; slots of flights with nothing left in flight are given to new
    ones. An offset is in one of the two at most."""

    __slots__ = ("_one", "_t", "_flights", "_free")

    def __init__(self, pure: bool = False) -> None:
        self._one: dict[int, F] = {}
        self._t: _CTable | _PureTable = _CTable() if _C and not pure else _PureTable()
        self._flights: list[F | None] = []
        self._free: list[int] = []

    # -- adding ------------------------------------------------------------------------
    def _slot(self, f: F) -> int:
        if self._free:
            slot = self._free.pop()
            self._flights[slot] = f
        else:
            slot = len(self._flights)
            self._flights.append(f)
            self._t.slots(slot + 1)
        f.slot = slot
        return slot

    def add_flights(self, flights: Sequence[F]) -> None:
        """Each flight's offsets [first, first + n) are in flight in it (none of them
        may be in flight already)."""
        one = self._one
        many: list[F] = []
        for f in flights:
            if f.n == 1:
                one[f.first] = f
            else:
                many.append(f)
        if not many:
            return
        if len(many) <= SMALL:
            add1 = self._t.add1
            for f in many:
                if add1(f.first, f.n, self._slot(f), id(f.client)):
                    raise RuntimeError(f"offsets of {f.first}+{f.n} put in flight twice")
            return
        slots = [self._slot(f) for f in many]
        total = sum(f.n for f in many)
        again = self._t.add([f.first for f in many], [f.n for f in many], slots,
                            [id(f.client) for f in many], total)
        if again:
            raise RuntimeError(f"{again} offsets put in flight twice")

    # -- removing ----------------------------------------------------------------------
    def _release(self, slots: Sequence[int]) -> list[F]:
        flights = self._flights
        out = []
        for slot in slots:
            f = flights[slot]
            assert f is not None
            out.append(f)
            flights[slot] = None
            self._free.append(slot)
        return out

    def finish(self, runs: Sequence[tuple[object, Sequence[int]]]
               ) -> tuple[list[list[tuple[int, bool]]], list[F]]:
        """FIN batches of several clients (a loop turn's) at once: each run's offsets
        in flight to its client leave, in order. Returns each run's failures, (index in
        its offsets, True: in flight to another client / False: not in flight), and the
        flights that have nothing left in flight."""
        if self._one:
            return self._finish_each(runs)
        if len(runs) <= SMALL and sum(len(run) for _, run in runs) <= SMALL:
            return self._finish_each(runs)
        offs = array.array("q")
        tags = array.array("Q")
        for client, run in runs:
            tag = id(client)     # a flight's client is its tag in the table
            if len(run) == 1:
                offs.append(run[0])
                tags.append(tag)
            else:
                offs.extend(run)
                tags.extend(array.array("Q", (tag,)) * len(run))
        failed, emptied = self._t.fin(tags, offs)
        out: list[list[tuple[int, bool]]] = [[] for _ in runs]
        if failed:
            starts = list(itertools.accumulate((len(run) for _, run in runs), initial=0))
            for v in failed:
                i = v >> 1
                r = bisect.bisect_right(starts, i) - 1
                out[r].append((i - starts[r], bool(v & 1)))
        return out, self._release(emptied) if emptied else []

    def finish_singles(self, clients: Sequence[object], offs: Sequence[int]
                       ) -> tuple[list[F], list[int]]:
        """FIN one offset for each client, in order (a turn's FINs at RDY 1), while
        each is a flight of one message of that client's: returns those flights, gone,
        and the indices from the first offset that is not (left as they were, for
        ``finish`` to take on in order: it says why, or finishes them in a flight of
        several)."""
        one = self._one
        gone: list[F] = []
        for i, off in enumerate(offs):
            f = one.get(off)
            if f is None or f.client is not clients[i]:
                return gone, list(range(i, len(offs)))
            del one[off]
            gone.append(f)
        return gone, []

    def _finish_each(self, runs: Sequence[tuple[object, Sequence[int]]]
                     ) -> tuple[list[list[tuple[int, bool]]], list[F]]:
        """finish one offset at a time: the dict's, else the table's (one call each)."""
        one = self._one
        fin1 = self._t.fin1 if self._t.count() else None
        out: list[list[tuple[int, bool]]] = []
        gone: list[F] = []
        emptied: list[int] = []
        for client, run in runs:
            tag = id(client)
            bad: list[tuple[int, bool]] = []
            i = 0
            for off in run:
                f = one.get(off)
                if f is not None:
                    if f.client is client:
                        del one[off]
                        gone.append(f)
                    else:
                        bad.append((i, True))
                elif fin1 is None:
                    bad.append((i, False))
                else:
                    v = fin1(tag, off)
                    if v < 0:
                        bad.append((i, v == -2))
                    elif v & 2:
                        emptied.append(v >> 2)
                i += 1
            out.append(bad)
        if emptied:
            gone += self._release(emptied)
        return out, gone

    def pop(self, off: int) -> tuple[F, bool]:
        """Remove one offset: its flight and whether that has nothing left in flight
        (KeyError if it is not in flight)."""
        f = self._one.pop(off, None)
        if f is not None:
            return f, True
        slot = self._t.pop(off)
        if slot < 0:
            raise KeyError(off)
        g = self._flights[slot]
        assert g is not None
        if self._t.live[slot] == 0:
            self._release([slot])
            return g, True
        return g, False

    def take(self, f: F) -> list[int]:
        """Remove every offset of f still in flight in it; returns them, in order."""
        if f.n == 1:
            if self._one.get(f.first) is f:
                del self._one[f.first]
                return [f.first]
            return []
        slot = f.slot
        if slot < 0 or slot >= len(self._flights) or self._flights[slot] is not f:
            return []       # (a flight found before the table was cleared: none now)
        got = self._t.take(f.first, f.n, slot)
        if self._t.live[slot] == 0:
            self._release([slot])
        return got

    def clear(self) -> None:
        self.drop_all()

    def drop_all(self) -> list[dict[int, F] | list[F | None]]:
        """``clear``, handing over the containers of its flights instead of freeing
        them (the caller frees them a step at a time: a Python object per flight)."""
        old: list[dict[int, F] | list[F | None]] = [self._one, self._flights]
        self._one = {}
        self._flights = []
        self._free = []
        self._t.clear()
        return old

    # -- reading -----------------------------------------------------------------------
    def get(self, off: int) -> F | None:
        f = self._one.get(off)
        if f is not None or not self._t.count():
            return f
        slot = self._t.get(off)
        return None if slot < 0 else self._flights[slot]

    def live(self, f: F) -> int:
        """How many of f's offsets are in flight in it."""
        if f.n == 1:
            return 1 if self._one.get(f.first) is f else 0
        slot = f.slot
        if slot < 0 or slot >= len(self._flights) or self._flights[slot] is not f:
            return 0
        return int(self._t.live[slot])

    def flights(self) -> list[F]:
        """The flights with something in flight."""
        return [*self._one.values(), *(f for f in self._flights if f is not None)]

    def min(self) -> int:
        """The lowest offset in flight (-1: none)."""
        low = self._t.low() if self._t.count() else -1
        if self._one:
            first = min(self._one)
            low = first if low < 0 else min(low, first)
        return low

    def items(self) -> list[tuple[int, F]]:
        return self.copy().items()

    def sorted_from(self, offset: int, more: array.array[int] | None = None
                    ) -> array.array[int]:
        """The offsets in flight at or after ``offset``, and those of ``more`` (which
        this extends), in ascending order, each once (a rewind's: 250,000 in flight
        made and sorted in Python took 30 ms)."""
        extra = array.array("q") if more is None else more
        if self._one:
            extra.frombytes(pack_offsets(self._one, len(self._one)))
        return self._t.sorted_from(offset, extra)

    def copy(self) -> InFlightCopy[F]:
        """What is in flight now, copied without a Python object per offset (C-level
        copies: a channel with 250,000 in flight took ``items`` and a list per entry
        52-84 ms on its loop at each snapshot); ``InFlightCopy.items`` makes the pairs
        later, on any thread."""
        offs, slots = self._t.dump_raw()
        return InFlightCopy(self._one.copy(), offs, slots, tuple(self._flights))

    def __iter__(self) -> Iterator[int]:
        return itertools.chain(list(self._one), self._t.dump()[0])

    def __contains__(self, off: object) -> bool:
        return off in self._one or (isinstance(off, int) and self._t.get(off) >= 0)

    def __len__(self) -> int:
        return len(self._one) + self._t.count()

    def __bool__(self) -> bool:
        return bool(self._one) or self._t.count() > 0


__all__ = ["InFlight", "InFlightCopy", "intersect", "pack_offsets"]
