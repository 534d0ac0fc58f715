"""Message: one copy of a published message, as one channel holds it."""
from __future__ import annotations

import struct
from typing import Any

# A message as a disk record: [int64 deliver_at_ns (wall clock; 0 = ready now)]
# [int64 ts_ns][uint16 attempts][16-byte id][body]. The last three fields are nsqd's own
# message encoding; deliver_at keeps a deferred message's time across restarts.
_RECORD = struct.Struct(">qqH16s")
RECORD_HEADER = _RECORD.size


class Message:
    """A message in one channel (each channel gets its own copy; bodies are shared).

    ``ts_ns`` is the wall-clock publish time and survives requeues; ``attempts`` counts
    deliveries (incremented just before each send, as nsqd does). The remaining slots
    are in-flight/deferred bookkeeping owned by the channel that holds the message.
    """

    __slots__ = ("id", "body", "ts_ns", "attempts", "defer_ns", "client", "entry",
                 "delivery_ns", "seq")

    def __init__(self, id: bytes, body: bytes, ts_ns: int, attempts: int = 0,
                 defer_ns: int = 0) -> None:
        self.id = id
        self.body = body
        self.ts_ns = ts_ns
        self.attempts = attempts
        self.defer_ns = defer_ns
        self.client: Any = None
        self.entry: tuple[int, int] | None = None  # its TimeoutWheel handle
        self.delivery_ns = 0
        self.seq: int | None = None  # its record's seq in the owning queue's backend

    def copy(self) -> "Message":
        return Message(self.id, self.body, self.ts_ns, self.attempts, self.defer_ns)

    def __repr__(self) -> str:
        return f"Message({self.id!r}, attempts={self.attempts}, {len(self.body)} bytes)"


def to_record(m: Message, deliver_at_ns: int | None = None) -> bytes:
    """The disk record of m (layout above). By default a DPUB'd message is due its
    publish time plus its delay."""
    if deliver_at_ns is None:
        deliver_at_ns = m.ts_ns + m.defer_ns if m.defer_ns else 0
    return _RECORD.pack(deliver_at_ns, m.ts_ns, m.attempts, m.id) + m.body


def from_record(rec: bytes) -> tuple[Message, int]:
    """(message, deliver_at_ns) from a disk record; raises ValueError if too short."""
    if len(rec) < RECORD_HEADER:
        raise ValueError(f"record of {len(rec)} bytes is too short")
    deliver_at, ts, attempts, mid = _RECORD.unpack_from(rec)
    return Message(mid, rec[RECORD_HEADER:], ts, attempts), deliver_at
