"""Message: one copy of a published message, as one channel holds it."""
from __future__ import annotations

from typing import Any


class Message:
    """A message in one channel (each channel gets its own copy; bodies are shared).

    ``ts_ns`` is the wall-clock publish time and survives requeues; ``attempts`` counts
    deliveries (incremented just before each send, as nsqd does). The remaining slots
    are in-flight/deferred bookkeeping owned by the channel that holds the message.
    """

    __slots__ = ("id", "body", "ts_ns", "attempts", "defer_ns", "client", "entry",
                 "delivery_ns")

    def __init__(self, id: bytes, body: bytes, ts_ns: int, attempts: int = 0,
                 defer_ns: int = 0) -> None:
        self.id = id
        self.body = body
        self.ts_ns = ts_ns
        self.attempts = attempts
        self.defer_ns = defer_ns
        self.client: Any = None
        self.entry: tuple | None = None
        self.delivery_ns = 0

    def copy(self) -> "Message":
        return Message(self.id, self.body, self.ts_ns, self.attempts, self.defer_ns)

    def __repr__(self) -> str:
        return f"Message({self.id!r}, attempts={self.attempts}, {len(self.body)} bytes)"
