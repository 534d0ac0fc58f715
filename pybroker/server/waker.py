"""CallQueue: how other threads hand work to a selector loop's thread.

A deque of calls plus one byte written to a socketpair registered with the loop's
selector; the byte is written only when the loop may be asleep (``_pending`` is clear).
The owner drains the socket first and clears the flag after: a call queued while the
flag was still set sent no byte, but it is run by the drain of the calls that follows
in the same turn (clearing first could swallow a fresh byte: a lost wake-up).
"""
from __future__ import annotations

import logging
import selectors
import socket
from collections import deque
from typing import Any, Callable

log = logging.getLogger("pybroker")


class CallQueue:
    def __init__(self, selector: selectors.BaseSelector, token: object = None) -> None:
        self._calls: deque[tuple[Callable[..., Any], tuple[Any, ...]]] = deque()
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)
        self._w.setblocking(False)
        self._pending = False
        selector.register(self._r, selectors.EVENT_READ, token)

    def __bool__(self) -> bool:
        return bool(self._calls)

    def call_soon_threadsafe(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue fn(*args) for the owner's thread (any thread)."""
        self._calls.append((fn, args))
        if not self._pending:
            self._pending = True
            try:
                self._w.send(b"\0")
            except OSError:
                pass  # already full of wake-ups, or closing

    def drain_wakeups(self) -> None:
        """The socket was readable (owner thread)."""
        try:
            while self._r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        self._pending = False

    def run(self, owner: str) -> None:
        """Run every queued call (owner thread); an error is logged, never raised."""
        calls = self._calls
        while calls:
            fn, args = calls.popleft()
            try:
                fn(*args)
            except Exception:
                log.exception("%s: error in a cross-thread call %r", owner, fn)

    def close(self) -> None:
        self._r.close()
        self._w.close()
