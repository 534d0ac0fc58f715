"""IOLoop: the client library's event loop thread (a pybroker.evloop.SelectorLoop).

Theory of operation: a Consumer or Producer owns one IOLoop. Its thread reads every
connection, flushes their pending output and fires timers; nothing else touches the
selector. Other threads reach it only through ``call_soon_threadsafe()`` (the
SelectorLoop's call queue and wake-up pair). Unlike the server's loops, ``call_later``
takes seconds and may be called from any thread: it returns a Timer whose
``cancel()`` is safe from any thread too. ``stop()`` goes through the call queue and
joins the thread. ``end_of_turn``, given by the owner, runs on the loop thread after
every turn, just before the loop sleeps in ``select()`` again: a Consumer hands the
turn's messages to its handler threads there (Consumer._hand_over).
"""
from __future__ import annotations

import logging
import selectors
import threading
import time
from typing import Callable, Protocol, Unpack

from pybroker.evloop import SelectorLoop, Ts

log = logging.getLogger("pybroker.client")


class Pollable(Protocol):
    """What the loop needs from a connection it watches."""

    def fileno(self) -> int: ...
    def on_readable(self) -> None: ...
    def on_writable(self) -> None: ...


class Timer:
    """A scheduled call; ``cancel()`` is safe from any thread."""

    __slots__ = ("deadline_ns", "fn", "args", "cancelled")

    def __init__(self, deadline_ns: int, fn: Callable[..., object],
                 args: tuple[object, ...]) -> None:
        self.deadline_ns = deadline_ns
        self.fn = fn
        self.args = args
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    def fire(self) -> None:
        if not self.cancelled:
            self.fn(*self.args)


class IOLoop(SelectorLoop):
    """A selector loop on its own named thread. Owned by one Consumer or Producer."""

    def __init__(self, name: str = "nsq-io",
                 end_of_turn: Callable[[], object] | None = None) -> None:
        super().__init__(name)
        self._end_of_turn = end_of_turn
        self._started = False
        self._closed = False
        self._released = False
        self._lock = threading.Lock()

    # -- any thread ------------------------------------------------------------------
    def start(self) -> None:
        with self._lock:
            if not self._started and not self._closed:
                self._started = True
                super().start()

    def call_later(self, delay_s: float, fn: Callable[[Unpack[Ts]], object],
                   *args: Unpack[Ts]) -> Timer:
        """Run ``fn(*args)`` on the loop thread after ``delay_s`` seconds (any thread)."""
        timer = Timer(time.monotonic_ns() + int(max(0.0, delay_s) * 1e9), fn, args)
        self.call_soon_threadsafe(self._arm, timer)
        return timer

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the loop thread and close the selector; idempotent."""
        with self._lock:
            started, self._closed = self._started, True
        if not started:
            self._close_once()
            return
        super().stop()
        if not self.in_loop_thread() and self.thread is not None:
            self.thread.join(timeout_s)

    # -- loop thread only ------------------------------------------------------------
    def _arm(self, timer: Timer) -> None:
        if not timer.cancelled:
            self.timers.add(timer.deadline_ns, (timer.fire, ()))

    def register(self, conn: Pollable, write: bool = False) -> None:
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if write else 0)
        self.selector.register(conn.fileno(), events, conn)

    def modify(self, conn: Pollable, write: bool) -> None:
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if write else 0)
        try:
            self.selector.modify(conn.fileno(), events, conn)
        except (KeyError, ValueError):
            pass  # unregistered meanwhile

    def unregister(self, fileno: int) -> None:
        try:
            self.selector.unregister(fileno)
        except (KeyError, ValueError):
            pass

    def run(self) -> None:
        try:
            super().run()
        finally:
            self._close_once()

    def end_of_turn(self) -> None:
        if self._end_of_turn is not None:
            self._end_of_turn()

    def on_error(self, obj: object) -> None:
        log.exception("unhandled error in IO loop callback of %r", obj)

    def _close_once(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
        self.close()
