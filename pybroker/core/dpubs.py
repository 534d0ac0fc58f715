"""A topic's deferred publishes not yet read by every channel: offset -> deliver-at
(wall-clock ns), with the count a channel's /stats asks for answered without a walk
over them.

A channel counts the DPUBs between its cursor and the topic's ``released`` that are not
yet due as deferred, not as depth (nsqd puts a DPUB in each channel's deferred queue at
once, so its count is a length). Counted one by one, 1,000,000 DPUBs an hour away cost
the channel's owner loop 93-123 ms at every /stats (nsqadmin asks every few seconds),
per channel. Here the deliver-at times are also kept sorted per chunk of CHUNK offsets:
a chunk wholly inside the range is counted with one bisection, and only the two chunks
at its ends are walked (at most 2 * CHUNK entries). Budget: a count costs one bisection
per chunk the range spans (245 for 1,000,000 consecutive DPUBs) and at most 2 * CHUNK
lookups; an insert or a removal moves at most CHUNK references; pruning k offsets
(``drop_below``) is k dict deletions and a move of ``_lo``.

Owned as the topic's ``dpubs`` was (the topic's lock, or its owner loop); the API is
the part of sortedcontainers.SortedDict the broker used, which it replaces: pruning
500,000 from it one ``popitem`` at a time took 313 ms under the topic's lock.
"""
from __future__ import annotations

import array
import bisect
from collections.abc import Iterable, Iterator

from pybroker._native.inflight import intersect


CHUNK_BITS = 12
CHUNK = 1 << CHUNK_BITS


class DpubIndex:
    """offset -> deliver-at (wall ns), in offset order, with ``not_due``.

    Offsets come in rising order (a topic's publishes, a follower's appends; after a
    truncation, from its end on): kept in an array read from ``_lo`` on, so that
    pruning the oldest is moving ``_lo`` (the array is cut once half of it is behind),
    with their deliver-at times beside them in a second array (``among``: a merge in
    C)."""

    __slots__ = ("_offs", "_ats", "_lo", "_at", "_dues", "changes")

    def __init__(self, items: Iterable[tuple[int, int]] = ()) -> None:
        self._offs = array.array("q")
        self._ats = array.array("q")      # _ats[i]: the deliver-at of _offs[i]
        self._lo = 0
        self._at: dict[int, int] = {}
        self._dues: dict[int, list[int]] = {}      # chunk -> its deliver-at times, sorted
        # changes other than appends and pruning below an offset (a time changed, an
        # offset deleted, all cleared): what was read of it before may be wrong now
        self.changes = 0
        for off, at in items:
            self[off] = at

    def __len__(self) -> int:
        return len(self._at)

    def __bool__(self) -> bool:
        return bool(self._at)

    def __contains__(self, off: object) -> bool:
        return off in self._at

    def __getitem__(self, off: int) -> int:
        return self._at[off]

    def get(self, off: int, default: int = 0, /) -> int:
        return self._at.get(off, default)

    def __setitem__(self, off: int, at: int) -> None:
        old = self._at.get(off)
        offs = self._offs
        if old is not None:
            self._drop_due(off, old)
            self.changes += 1
            self._ats[bisect.bisect_left(offs, off, self._lo)] = at
        elif len(offs) > self._lo and off < offs[-1]:
            i = bisect.bisect_left(offs, off, self._lo)    # (out of order: not expected)
            offs.insert(i, off)
            self._ats.insert(i, at)
        else:
            offs.append(off)
            self._ats.append(at)
        self._at[off] = at
        bisect.insort(self._dues.setdefault(off >> CHUNK_BITS, []), at)

    def __delitem__(self, off: int) -> None:
        at = self._at.pop(off)
        self.changes += 1
        offs = self._offs
        if offs[-1] == off:
            offs.pop()
            self._ats.pop()
        else:
            i = bisect.bisect_left(offs, off, self._lo)
            del offs[i], self._ats[i]
        self._drop_due(off, at)
        self._settle()

    def _drop_due(self, off: int, at: int) -> None:
        c = off >> CHUNK_BITS
        dues = self._dues[c]
        del dues[bisect.bisect_left(dues, at)]
        if not dues:
            del self._dues[c]

    def _settle(self) -> None:
        if not self._at:
            self._offs, self._ats, self._lo = array.array("q"), array.array("q"), 0
        elif self._lo > 1024 and self._lo * 2 > len(self._offs):
            del self._offs[:self._lo], self._ats[:self._lo]
            self._lo = 0

    def among(self, offsets: memoryview | array.array[int]
              ) -> tuple[array.array[int], array.array[int]]:
        """Those of ``offsets`` (int64s, ascending, each once) that are DPUBs here, and
        their deliver-at times: one merge in C over the DPUBs within their span (a
        lookup each of 250,000 offsets of a rewind's skip took 65 ms; this, about 1)."""
        mv = memoryview(offsets)
        offs = self._offs
        if not mv.nbytes or len(offs) <= self._lo:
            return array.array("q"), array.array("q")
        a = bisect.bisect_left(offs, mv[0], self._lo)
        b = bisect.bisect_right(offs, mv[-1], a)
        return intersect(mv, offs[a:b], self._ats[a:b])

    def irange(self, lo: int | None = None, hi: int | None = None,
               inclusive: tuple[bool, bool] = (True, True)) -> Iterator[int]:
        """The offsets from lo to hi (None: no bound), in order; a list taken now."""
        offs = self._offs
        a = self._lo if lo is None else (bisect.bisect_left if inclusive[0]
                                         else bisect.bisect_right)(offs, lo, self._lo)
        b = len(offs) if hi is None else (bisect.bisect_right if inclusive[1]
                                          else bisect.bisect_left)(offs, hi, self._lo)
        return iter(offs[a:b])

    def peekitem(self, index: int = 0) -> tuple[int, int]:
        off = self._offs[self._lo if index == 0 else index]
        return off, self._at[off]

    def drop_below(self, below: int, most: int | None = None) -> int:
        """Forget the DPUBs below ``below`` (all channels read past them), at most
        ``most`` of them (the lowest); returns how many. The chunks wholly below go
        whole."""
        offs, lo = self._offs, self._lo
        end = bisect.bisect_left(offs, below, lo)
        if most is not None:
            end = min(end, lo + most)
        if end == lo:
            return 0
        at = self._at
        last = offs[end - 1]
        c = (last + 1) >> CHUNK_BITS           # chunks below c are wholly gone
        for off in offs[max(lo, bisect.bisect_left(offs, c << CHUNK_BITS, lo)):end]:
            self._drop_due(off, at[off])       # the chunk it stops in: entry by entry
        for gone in [x for x in self._dues if x < c]:
            del self._dues[gone]
        for off in offs[lo:end]:
            del at[off]
        self._lo = end
        self._settle()
        return end - lo

    def clear(self) -> None:
        self.changes += 1
        self._offs, self._ats, self._lo = array.array("q"), array.array("q"), 0
        self._at.clear()
        self._dues.clear()

    def keys(self) -> list[int]:
        return self._offs[self._lo:].tolist()

    def __iter__(self) -> Iterator[int]:
        return iter(self._offs[self._lo:])

    def items(self) -> list[tuple[int, int]]:
        lo = self._lo
        return list(zip(self._offs[lo:], self._ats[lo:]))

    def not_due(self, lo: int, hi: int, wall_ns: int) -> int:
        """How many DPUBs in [lo, hi) are due after ``wall_ns``."""
        if lo >= hi or not self._at:
            return 0
        first, last = lo >> CHUNK_BITS, (hi - 1) >> CHUNK_BITS
        at = self._at
        if first == last:
            return sum(1 for off in self.irange(lo, hi, (True, False)) if at[off] > wall_ns)
        n = sum(1 for off in self.irange(lo, (first + 1) << CHUNK_BITS, (True, False))
                if at[off] > wall_ns)
        n += sum(1 for off in self.irange(last << CHUNK_BITS, hi, (True, False))
                 if at[off] > wall_ns)
        dues = self._dues
        if last - first - 1 <= len(dues):
            inner: Iterable[int] = range(first + 1, last)
        else:            # a long range over few chunks: only the chunks there are
            inner = (c for c in dues if first < c < last)
        for c in inner:
            d = dues.get(c)
            if d:
                n += len(d) - bisect.bisect_right(d, wall_ns)
        return n


__all__ = ["CHUNK", "DpubIndex"]
