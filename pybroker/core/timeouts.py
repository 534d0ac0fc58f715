"""TimeoutWheel: items ordered by deadline, for in-flight, deferred and timer queues.

Theory of operation: entries are ``(deadline_ns, seq, item)`` tuples in a
sortedcontainers.SortedList. ``seq`` is unique per wheel, so two entries never compare
their items, and the tuple itself is the handle used to remove an entry. Expiry pops a
prefix of the list in one slice. Only ``add``, ``remove``, ``pop_expired`` and
``next_deadline`` are public, so a switch to another structure stays local.
Not thread-safe: the owner (a Channel under its lock, or an EventLoop) serialises calls.
"""
from __future__ import annotations

from typing import Generic, TypeVar

from sortedcontainers import SortedList

T = TypeVar("T")
Entry = tuple  # (deadline_ns, seq, item)


class TimeoutWheel(Generic[T]):
    __slots__ = ("_entries", "_seq")

    def __init__(self) -> None:
        self._entries: SortedList = SortedList()
        self._seq = 0

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, deadline_ns: int, item: T) -> Entry:
        """Schedule item at deadline_ns; returns the handle that remove() takes."""
        self._seq += 1
        entry = (deadline_ns, self._seq, item)
        self._entries.add(entry)
        return entry

    def remove(self, entry: Entry) -> bool:
        """Drop a scheduled entry; False if it already expired or was removed."""
        try:
            self._entries.remove(entry)
        except ValueError:
            return False
        return True

    def pop_expired(self, now_ns: int) -> list[T]:
        """Remove and return every item whose deadline is <= now_ns, earliest first."""
        entries = self._entries
        if not entries or entries[0][0] > now_ns:
            return []
        idx = entries.bisect_left((now_ns + 1,))
        expired = [e[2] for e in entries.islice(0, idx)]
        del entries[:idx]
        return expired

    def next_deadline(self) -> int | None:
        return self._entries[0][0] if self._entries else None

    def items(self) -> list[T]:
        """Every scheduled item, earliest first (for shutdown and stats)."""
        return [e[2] for e in self._entries]

    def clear(self) -> None:
        self._entries.clear()
