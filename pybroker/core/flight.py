"""What a channel keeps per delivery: the Consumer it needs from a client, a Flight (a
slice of messages sent together), a Deferred message (a tuple), and message id <->
log offset.
The states these take part in are core/lifecycle.py's.
"""
from __future__ import annotations

from typing import Protocol

from pybroker.core.stats import StatsClient
from pybroker.core.timeouts import Handle


class Consumer(StatsClient, Protocol):
    """What a channel needs from a subscribed client (implemented by the server): its
    flow control and output, and what /stats shows of it (``StatsClient``)."""

    msg_timeout_ns: int
    sample_rate: int
    in_flight_count: int

    def ready_room(self) -> int:
        """How many more messages the client may take now (RDY minus in flight)."""

    def send_frames(self, frames: bytes | bytearray, n: int) -> None:
        """Queue n encoded message frames for this client (already in flight)."""


class Flight:
    """One slice of messages sent to one client together: the offsets that still map to
    it in ``in_flight`` (an InFlight table, which gives it ``slot``) are in flight.
    ``attempts`` counts this channel's deliveries of each of them in their current life
    (a record's stored attempts come on top)."""

    __slots__ = ("client", "first", "n", "slot", "attempts", "delivery_ns", "handle", "gen")

    def __init__(self, client: Consumer | None, first: int, n: int, attempts: int,
                 delivery_ns: int, gen: int = 0) -> None:
        self.client = client
        self.first = first
        self.n = n
        self.slot = -1
        self.attempts = attempts
        self.delivery_ns = delivery_ns
        self.handle: Handle | None = None
        self.gen = gen       # the channel's rewinds before it went out (Lifecycle.gen)


# A message waiting for its time: a REQ with a delay or a DPUB read at the cursor
# before it was due: (offset, attempts, due_wall_ns), due by the wall clock so that a
# restart keeps it. An exact tuple of ints, on purpose: it is also its entry in the
# channel's saved state ("pending"), shared with the snapshots that list it, and the
# garbage collector stops tracking such a tuple at its first pass. A class instance
# stays tracked, and every full collection walked all of them with every loop held:
# 1,000,000 deferred messages as objects cost a full collection 323 ms, as tuples
# 14 ms (docs/storage.md, "Deferred messages and the garbage collector").
Deferred = tuple[int, int, int]


def offset_of(msg_id: bytes) -> int:
    """The log offset a message id names (16 lowercase hex digits); -1 otherwise."""
    if len(msg_id) != 16 or not _HEX_LOWER.issuperset(msg_id):
        return -1
    off = int(msg_id, 16)
    return off if off < 1 << 63 else -1


_HEX_LOWER = frozenset(b"0123456789abcdef")
