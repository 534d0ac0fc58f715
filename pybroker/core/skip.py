"""Skip: the offsets a rewind (or a restored state) leaves held at or after a channel's
cursor, ascending. Each is delivered through its own state (in flight, deferred,
requeued, dying), so the cursor passes over them (core/lifecycle.py).

One array of int64 read from a head index, not a deque of Python ints: a rewind over
250,000 offsets in flight spent 4-6 ms of its owner loop (of 7.5-12 ms in all) making
the deque of them from the array the C sort returns (``InFlight.sorted_from``), each
snapshot listed them again on the loop, and an empty freed them in steps. Now the
rewind keeps that array as it is, the cursor passing moves the head, a snapshot takes
a C-level copy, and an empty drops one object.

The array is never changed in place (so a memoryview iterates it without a copy); once
most of it is behind the head it is copied shorter (amortized: a copy of at most half
of it per COMPACT_AT offsets passed). Owned by the channel's owner loop.
"""
from __future__ import annotations

import array
import bisect
from collections.abc import Iterable, Iterator

COMPACT_AT = 65_536     # offsets behind the head before a shorter copy is made


class Skip:
    """Ascending offsets, read from the front (``first``, ``popleft``, ``drop_below``)."""

    __slots__ = ("_a", "_i")

    def __init__(self, offsets: array.array[int] | Iterable[int] = ()) -> None:
        """offsets: ascending, each once (an ``array('q')`` is taken as it is)."""
        self._a = offsets if isinstance(offsets, array.array) else array.array("q", offsets)
        self._i = 0

    def __len__(self) -> int:
        return len(self._a) - self._i

    def __bool__(self) -> bool:
        return len(self._a) > self._i

    def __iter__(self) -> Iterator[int]:
        return iter(memoryview(self._a)[self._i:])

    def __repr__(self) -> str:
        return f"Skip({self.tolist()!r})"

    def first(self) -> int:
        """The lowest offset (IndexError when empty)."""
        return self._a[self._i]

    def last(self) -> int:
        """The highest offset (IndexError when empty)."""
        if not self:
            raise IndexError("empty skip")
        return self._a[-1]

    def span(self, lo: int, hi: int) -> memoryview:
        """The offsets from lo to hi, both included, ascending, as a view of the
        int64s (two bisections; no Python object per offset)."""
        a = self._a
        i = bisect.bisect_left(a, lo, self._i)
        return memoryview(a)[i:bisect.bisect_right(a, hi, i)]

    def popleft(self) -> int:
        """Take the lowest offset off (IndexError when empty)."""
        off = self._a[self._i]
        self._i += 1
        self._compact()
        return off

    def drop_below(self, to: int) -> None:
        """Take every offset below ``to`` off (one bisection)."""
        self._i = bisect.bisect_left(self._a, to, self._i)
        self._compact()

    def copy(self) -> array.array[int]:
        """The offsets, as a new array (a C-level copy)."""
        return self._a[self._i:]

    def tolist(self) -> list[int]:
        return self._a[self._i:].tolist()

    def _compact(self) -> None:
        i = self._i
        if i == len(self._a):
            if i:
                self._a = array.array("q")     # all passed: nothing held
                self._i = 0
        elif i >= COMPACT_AT and 2 * i >= len(self._a):
            self._a = self._a[i:]
            self._i = 0


__all__ = ["COMPACT_AT", "Skip"]
