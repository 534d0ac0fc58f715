"""LogReader: the ``logread`` thread, where HTTP requests read the topic logs.

A log read (``/topic/read``: up to 4 MiB) or a lookup by time (``/topic/offsets?ts=``,
``/channel/rewind?ts=``) may touch the disk; on the HTTP thread it would delay /ping,
/stats and every HTTP publish behind it. So these requests are Gathers whose job runs
here (``call_soon_threadsafe``, the same interface as an event loop's), and their answer
comes back through the HTTP server's completion path. One thread, started on first
use: reads are short (a lookup is a bisect and one read of at most 64 KiB plus a
record, a log read at most 4 MiB), and a thread of its own keeps them off the storage
thread, whose fsyncs publishers wait for.

Budget: at most ``MAX_QUEUED`` jobs wait; a request beyond that is refused at once
(503 ``TOO_MANY_READS``) rather than queued without bound. ``then`` chains a second
step on another thread (a lookup here, then the rewind on the channel's owner loop).
"""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from pybroker.http.gather import MISSING, Job, run_jobs

log = logging.getLogger("pybroker")
MAX_QUEUED = 64
_STOP = object()


class LogReader:
    def __init__(self, name: str = "logread") -> None:
        self.name = name
        self._jobs: queue.Queue[Any] = queue.Queue()
        self._lock = threading.Lock()       # between HTTP (start) and stop
        self._thread: threading.Thread | None = None
        self._stopped = False

    def busy(self) -> bool:
        """Too many reads wait already: refuse the next one."""
        return self._jobs.qsize() >= MAX_QUEUED

    def call_soon_threadsafe(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run fn(*args) on the reader thread (started on first use)."""
        with self._lock:
            if self._stopped:
                raise RuntimeError("log reader stopped")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
        self._jobs.put((fn, args))

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is _STOP:
                return
            fn, args = item
            if self._stopped:
                continue        # shutting down: nobody waits for the answer
            try:
                fn(*args)
            except Exception:
                log.exception("HTTP: a log read failed")

    def stop(self, timeout_s: float = 5.0) -> None:
        with self._lock:
            self._stopped = True
            thread = self._thread
        if thread is not None:
            self._jobs.put(_STOP)
            thread.join(timeout_s)


class _Then:
    """A Gather job target: ``first(*args)`` on one thread, then ``second(result)`` on
    another; the job's result is the second's."""

    __slots__ = ("reader", "first", "args", "loop", "second")

    def __init__(self, reader: Any, first: Callable[..., Any], args: tuple[Any, ...],
                 loop: Any, second: Callable[[Any], Any]) -> None:
        self.reader = reader
        self.first = first
        self.args = args
        self.loop = loop
        self.second = second

    def call_soon_threadsafe(self, _run_jobs: Any, jobs: list[tuple[Any, Any, Any]]) -> None:
        """Posted like a loop's jobs (``run_jobs, [(fn, args, deliver)]``); runs its own
        two steps for each, delivering the second's result."""
        for _fn, _args, deliver in jobs:
            self._post(deliver)

    def _post(self, deliver: Callable[[Any], None]) -> None:
        def step() -> None:
            try:
                got = self.first(*self.args)
            except Exception:
                log.exception("HTTP: a log read failed")
                deliver(MISSING)
                return
            self.loop.call_soon_threadsafe(run_jobs, [(self.second, (got,), deliver)])

        self.reader.call_soon_threadsafe(step)


def then(reader: Any, first: Callable[..., Any], args: tuple[Any, ...], loop: Any,
         second: Callable[[Any], Any]) -> Job:
    """A Gather job that runs first(*args) on reader, then second(result) on loop."""
    return (_Then(reader, first, args, loop, second), _unused, ())


def _unused() -> None:
    """Never called: _Then runs its own two steps."""
