"""Message: one delivery, with go-nsq's finish/requeue/touch and auto-response switch.

A message is owned by the handler that received it; exactly one of ``finish()`` and
``requeue()`` takes effect (later calls are ignored, as in go-nsq). ``touch()`` may be
called any number of times before that.
"""
from __future__ import annotations

import threading
from typing import Protocol


class MessageDelegate(Protocol):
    """The connection a message came from; it sends FIN/REQ/TOUCH and keeps counts."""

    def on_finish(self, message: "Message") -> None: ...
    def on_requeue(self, message: "Message", delay_s: float | None, backoff: bool) -> None: ...
    def on_touch(self, message: "Message") -> None: ...


class Message:
    """A message delivered by nsqd.

    Attributes:
        id: the 16-byte ASCII-hex message id.
        body: the payload.
        timestamp: publish time, nanoseconds since the epoch (set by the server).
        attempts: delivery count, 1 for the first delivery.
        nsqd_address: "host:port" of the connection it came from.

    ``offset`` is the message's position in its topic's log on a pybroker server,
    where a message id is the offset in 16 hex digits (see ``pybroker rewind``). An
    id from nsqd is an opaque GUID: there ``offset`` means nothing.
    """

    __slots__ = ("id", "body", "timestamp", "attempts", "nsqd_address", "delegate",
                 "_auto_response", "_responded", "_lock")

    def __init__(self, id: bytes, body: bytes, timestamp: int, attempts: int,
                 nsqd_address: str = "", delegate: MessageDelegate | None = None) -> None:
        self.id = id
        self.body = body
        self.timestamp = timestamp
        self.attempts = attempts
        self.nsqd_address = nsqd_address
        self.delegate = delegate
        self._auto_response = True
        self._responded = False
        self._lock = threading.Lock()

    @property
    def offset(self) -> int:
        """The topic-log offset named by the id (pybroker servers; see the class doc)."""
        return int(self.id, 16)

    def __repr__(self) -> str:
        return (f"Message(id={self.id!r}, attempts={self.attempts}, "
                f"body={self.body[:32]!r}{'...' if len(self.body) > 32 else ''})")

    # -- response control --------------------------------------------------------------
    def disable_auto_response(self) -> None:
        """The handler will call finish()/requeue() itself, possibly after returning."""
        self._auto_response = False

    def is_auto_response_disabled(self) -> bool:
        return not self._auto_response

    def has_responded(self) -> bool:
        return self._responded

    def _claim(self) -> bool:
        with self._lock:
            if self._responded:
                return False
            self._responded = True
            return True

    def finish(self) -> None:
        """Send FIN: the message is done. Ignored if already finished or requeued."""
        if self._claim() and self.delegate is not None:
            self.delegate.on_finish(self)

    def requeue(self, delay_s: float | None = None, backoff: bool = True) -> None:
        """Send REQ: deliver again after ``delay_s`` seconds.

        Args:
            delay_s: None for the consumer's default (``default_requeue_delay`` times
                ``attempts``, capped at ``max_requeue_delay``), else seconds (0 = now).
            backoff: also signal the consumer to back off (go-nsq's Requeue);
                ``requeue_without_backoff()`` passes False.
        """
        if self._claim() and self.delegate is not None:
            self.delegate.on_requeue(self, delay_s, backoff)

    def requeue_without_backoff(self, delay_s: float | None = None) -> None:
        self.requeue(delay_s, backoff=False)

    def touch(self) -> None:
        """Send TOUCH: reset the server's timeout for this message."""
        if not self._responded and self.delegate is not None:
            self.delegate.on_touch(self)
