"""TimeoutWheel: items ordered by deadline, for in-flight, deferred and timer queues.

Theory of operation: deadlines are rounded *up* to a bucket of ``resolution_ns``
(1 ms by default), so an item never fires early and at most one resolution late. A
sortedcontainers.SortedList holds the bucket numbers that exist; each bucket is a dict
``seq -> item`` in insertion order. Adding or removing an item is a dict operation
(O(1)); the SortedList only changes once per bucket, not per item, which keeps per-message
cost flat at high rates. ``add`` returns the handle ``(bucket, seq)`` that ``remove``
takes. Expiry pops every bucket up to now in one slice. Only ``add`` (and ``add_all``), ``remove``,
``pop_expired`` and ``next_deadline`` are needed by callers, so a switch to another
structure stays local. Not thread-safe: the owner (a Channel under its lock, or an
EventLoop) serialises calls.
"""
from __future__ import annotations

from typing import Generic, TypeVar

from sortedcontainers import SortedList  # type: ignore[import-untyped]

T = TypeVar("T")
Handle = tuple[int, int]  # (bucket, seq)


class TimeoutWheel(Generic[T]):
    __slots__ = ("_keys", "_buckets", "_seq", "_len", "_res")

    def __init__(self, resolution_ns: int = 1_000_000) -> None:
        self._keys: SortedList = SortedList()
        self._buckets: dict[int, dict[int, T]] = {}
        self._seq = 0
        self._len = 0
        self._res = resolution_ns

    def __len__(self) -> int:
        return self._len

    def add(self, deadline_ns: int, item: T) -> Handle:
        """Schedule item at deadline_ns; returns the handle that remove() takes."""
        b = -(-deadline_ns // self._res)
        bucket = self._buckets.get(b)
        if bucket is None:
            bucket = self._buckets[b] = {}
            self._keys.add(b)
        self._seq += 1
        bucket[self._seq] = item
        self._len += 1
        return (b, self._seq)

    def add_all(self, deadline_ns: int, items: list[T]) -> list[Handle]:
        """``add`` for several items with one deadline (a dispatch pass's flights):
        their handles, in order."""
        if not items:
            return []
        b = -(-deadline_ns // self._res)
        bucket = self._buckets.get(b)
        if bucket is None:
            bucket = self._buckets[b] = {}
            self._keys.add(b)
        seq = self._seq
        handles: list[Handle] = []
        for item in items:
            seq += 1
            bucket[seq] = item
            handles.append((b, seq))
        self._seq = seq
        self._len += len(items)
        return handles

    def remove(self, handle: Handle) -> bool:
        """Drop a scheduled entry; False if it already expired or was removed."""
        bucket = self._buckets.get(handle[0])
        if bucket is None or handle[1] not in bucket:
            return False
        del bucket[handle[1]]
        self._len -= 1
        return True

    def pop_expired(self, now_ns: int, limit: int = 0) -> list[T]:
        """Remove and return every item whose deadline is <= now_ns, earliest first (at
        most ``limit`` when it is > 0: the rest stay, due, for the next call)."""
        keys = self._keys
        if not keys or keys[0] * self._res > now_ns:
            return []
        idx = keys.bisect_right(now_ns // self._res)
        out: list[T] = []
        buckets = self._buckets
        done = 0
        for b in keys.islice(0, idx):
            bucket = buckets[b]
            if limit and len(out) + len(bucket) > limit:
                for k in list(bucket)[:limit - len(out)]:
                    out.append(bucket.pop(k))
                break
            out.extend(bucket.values())
            del buckets[b]
            done += 1
            if limit and len(out) >= limit:
                break
        del keys[:done]
        self._len -= len(out)
        return out

    def deadline_of(self, handle: Handle) -> int:
        """The (rounded-up) time at which the entry behind handle fires."""
        return handle[0] * self._res

    def next_deadline(self) -> int | None:
        """The earliest bucket's time (it may have emptied: waking then finds nothing)."""
        return self._keys[0] * self._res if self._keys else None

    def items(self) -> list[T]:
        """Every scheduled item, earliest first (for shutdown and stats)."""
        return [item for b in self._keys for item in self._buckets[b].values()]

    def clear(self) -> None:
        self.drop_all()

    def drop_all(self) -> dict[int, dict[int, T]]:
        """``clear``, handing over its buckets instead of freeing them (the caller
        frees them a step at a time)."""
        old = self._buckets
        self._buckets = {}
        self._keys.clear()
        self._len = 0
        return old
