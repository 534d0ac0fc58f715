"""Message ids: 16 lowercase hex bytes, unique per topic and across restarts.

Like nsqd's guid, an id is a 64-bit number whose high bits come from the clock: a
topic's counter starts at the wall clock in nanoseconds shifted to leave room for a
node id, and counts up; a restart starts above every id issued before it as long as
fewer than ~1e9/1024 ids per second were issued.
"""
from __future__ import annotations

import itertools


class IdGenerator:
    """Hands out ids for one topic. Callers serialise access (the topic's lock)."""

    __slots__ = ("_next",)

    def __init__(self, node_id: int, now_ns: int) -> None:
        # 54 bits of clock (ns / 1024), 10 bits of node id
        self._next = itertools.count(((now_ns >> 10) << 10 | (node_id & 0x3FF)) << 0, 1024)

    def next_ids(self, n: int) -> list[bytes]:
        nxt = self._next
        return [b"%016x" % (next(nxt) & 0xFFFFFFFFFFFFFFFF) for _ in range(n)]

    def next_id(self) -> bytes:
        return b"%016x" % (next(self._next) & 0xFFFFFFFFFFFFFFFF)
