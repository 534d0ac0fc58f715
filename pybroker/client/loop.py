"""IOLoop: one thread with a selector, timers and a wakeup socketpair.

Theory of operation: a Consumer or Producer owns one IOLoop. Its thread reads every
connection, flushes their pending output and fires timers; nothing else touches the
selector. Other threads reach it only through ``call_soon_threadsafe()``, which queues a
callable and writes one byte to the wakeup pair. Timers are a heap keyed by
``(deadline, seq)`` on ``time.monotonic()``. ``stop()`` goes through the wakeup pair too.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import selectors
import socket
import threading
import time
from collections import deque
from typing import Any, Callable, Protocol

log = logging.getLogger("pybroker.client")


class Pollable(Protocol):
    """What the loop needs from a connection it watches."""

    def fileno(self) -> int: ...
    def on_readable(self) -> None: ...
    def on_writable(self) -> None: ...


class Timer:
    """A scheduled call; ``cancel()`` is safe from any thread."""

    __slots__ = ("deadline", "fn", "args", "cancelled")

    def __init__(self, deadline: float, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.deadline = deadline
        self.fn = fn
        self.args = args
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class IOLoop:
    """A selector loop on its own named thread. Owned by one Consumer or Producer."""

    def __init__(self, name: str = "nsq-io") -> None:
        self._selector = selectors.DefaultSelector()
        self._rsock, self._wsock = socket.socketpair()
        self._rsock.setblocking(False)
        self._wsock.setblocking(False)
        self._selector.register(self._rsock, selectors.EVENT_READ, None)
        self._calls: deque[tuple[Callable[..., Any], tuple[Any, ...]]] = deque()
        self._timers: list[tuple[float, int, Timer]] = []
        self._seq = itertools.count()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._started = False
        self._lock = threading.Lock()

    # -- any thread ------------------------------------------------------------------
    def start(self) -> None:
        with self._lock:
            if not self._started:
                self._started = True
                self._thread.start()

    def in_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def call_soon_threadsafe(self, fn: Callable[..., Any], *args: Any) -> None:
        self._calls.append((fn, args))
        self._wake()

    def call_later(self, delay_s: float, fn: Callable[..., Any], *args: Any) -> Timer:
        """Run ``fn(*args)`` on the loop thread after ``delay_s`` seconds."""
        timer = Timer(time.monotonic() + max(0.0, delay_s), fn, args)
        self.call_soon_threadsafe(self._add_timer, timer)
        return timer

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the loop thread and close the selector; idempotent."""
        self._stopping = True
        self._wake()
        if self._started and not self.in_loop_thread():
            self._thread.join(timeout_s)

    def _wake(self) -> None:
        try:
            self._wsock.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # already awake (buffer full) or closed

    # -- loop thread only ------------------------------------------------------------
    def register(self, conn: Pollable, write: bool = False) -> None:
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if write else 0)
        self._selector.register(conn.fileno(), events, conn)

    def modify(self, conn: Pollable, write: bool) -> None:
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if write else 0)
        try:
            self._selector.modify(conn.fileno(), events, conn)
        except (KeyError, ValueError):
            pass  # unregistered meanwhile

    def unregister(self, fileno: int) -> None:
        try:
            self._selector.unregister(fileno)
        except (KeyError, ValueError):
            pass

    def _add_timer(self, timer: Timer) -> None:
        heapq.heappush(self._timers, (timer.deadline, next(self._seq), timer))

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._turn()
        finally:
            self._selector.close()
            self._rsock.close()
            self._wsock.close()

    def _turn(self) -> None:
        timeout: float | None = None
        if self._calls:
            timeout = 0.0
        elif self._timers:
            timeout = max(0.0, self._timers[0][0] - time.monotonic())
        for key, mask in self._selector.select(timeout):
            conn = key.data
            if conn is None:
                try:
                    while self._rsock.recv(4096):
                        pass
                except BlockingIOError:
                    pass
                continue
            self._guard(conn.on_readable if mask & selectors.EVENT_READ else None)
            if mask & selectors.EVENT_WRITE:
                self._guard(conn.on_writable)
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            _, _, timer = heapq.heappop(self._timers)
            if not timer.cancelled:
                self._guard(timer.fn, *timer.args)
        for _ in range(len(self._calls)):
            fn, args = self._calls.popleft()
            self._guard(fn, *args)

    @staticmethod
    def _guard(fn: Callable[..., Any] | None, *args: Any) -> None:
        if fn is None:
            return
        try:
            fn(*args)
        except Exception:  # a bug in a callback must not kill the loop
            log.exception("unhandled error in IO loop callback %r", fn)
