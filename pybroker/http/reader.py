"""LogReader: the ``logread`` thread, where HTTP requests read the topic logs.

A log read (``/topic/read``: up to 4 MiB) or a lookup by time (``/topic/offsets?ts=``,
``/channel/rewind?ts=``) may touch the disk; on the HTTP thread it would delay /ping,
/stats and every HTTP publish behind it. So these requests are Gathers whose job runs
here (``call_soon_threadsafe``, the same interface as an event loop's), and their answer
comes back through the HTTP server's completion path. One thread, started on first
use: reads are short (a lookup is a bisect and one read of at most 64 KiB plus a
record, a log read at most 4 MiB), and a thread of its own keeps them off the storage
thread, whose fsyncs publishers wait for.

It also finishes the Gathers whose finish is long (``Gather.off_thread``: /stats and
/metrics, planned, gathered from the loops and encoded here; HttpServer._finish), which
offer the GIL as they go, one at a time (an answer shared by the requests of its form
that waited for it: collect.SharedAnswers).

Budget: a read finding ``MAX_QUEUED`` jobs waiting, or a long finish finding
``MAX_FINISHES``, is refused at once (503 ``TOO_MANY_READS``) rather than queued without
bound (a long finish never runs on the HTTP thread). ``then`` chains a second
step on another thread (a lookup here, then the rewind on the channel's owner loop).

``cursors``: the log cursors (storage/cursor.py) that /topic/read pages left off with,
kept for the page that starts where one ended (a Spark source reads a range page by
page), so a sequential reader reads each byte once and seeks only on its first page.
At most ``CURSORS`` are kept (a descriptor and at most a page's buffer each, 4 MiB),
the least recently used released first, and all of them when no read came for
``IDLE_S`` (so a segment that retention deletes is not kept open for long).
"""
from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Generic, TypeVar, Unpack, cast

from pybroker.http.gather import MISSING, Job, Posted, Poster, run_jobs
from pybroker.evloop import Call, Ts

if TYPE_CHECKING:
    from pybroker.core.seams import Log, LogReader as LogCursor

log = logging.getLogger("pybroker")
MAX_QUEUED = 64
# long finishes (/stats, /metrics) that may wait: most are answered at once by an answer
# made for the one before them (collect.SharedAnswers), so more of them may wait
MAX_FINISHES = 1_024
CURSORS = 8
IDLE_S = 30.0
R = TypeVar("R")


class CursorCache:
    """Log cursors kept between /topic/read pages, keyed by (log, the offset the next
    page starts at). Used by the reader thread only."""

    def __init__(self, size: int = CURSORS) -> None:
        self.size = size
        self._items: OrderedDict[tuple[int, int], tuple[Log, LogCursor]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def take(self, log: Log, offset: int) -> LogCursor | None:
        """The cursor a page of ``log`` left at ``offset`` (now the caller's), or None."""
        got = self._items.pop((id(log), offset), None)
        if got is None or got[0] is not log:
            return None
        return got[1]

    def put(self, log: Log, cursor: LogCursor, offset: int) -> None:
        """Keep cursor for the page of log that starts at offset."""
        old = self._items.pop((id(log), offset), None)
        if old is not None:
            old[1].release()
        self._items[(id(log), offset)] = (log, cursor)   # the log kept: its id stays its own
        while len(self._items) > self.size:
            _, (_, c) = self._items.popitem(last=False)
            c.release()

    def clear(self) -> None:
        while self._items:
            _, (_, c) = self._items.popitem()
            c.release()


class LogReader:
    def __init__(self, name: str = "logread") -> None:
        self.name = name
        self._jobs: queue.Queue[Call | None] = queue.Queue()   # None: stop
        self._lock = threading.Lock()       # between HTTP (start) and stop
        self._thread: threading.Thread | None = None
        self._stopped = False
        self.cursors = CursorCache()        # the reader thread's (see the docstring)

    def busy(self, limit: int = MAX_QUEUED) -> bool:
        """Too many jobs wait already (``limit``): refuse the next one."""
        return self._jobs.qsize() >= limit

    def call_soon_threadsafe(self, fn: Callable[[Unpack[Ts]], object],
                             *args: Unpack[Ts]) -> None:
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
            try:
                item = self._jobs.get(timeout=IDLE_S if len(self.cursors) else None)
            except queue.Empty:
                self.cursors.clear()        # idle: no descriptor or buffer kept
                continue
            if item is None:
                self.cursors.clear()
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
            self._jobs.put(None)
            thread.join(timeout_s)


class _Then(Generic[R]):
    """A Gather job target: ``first(*args)`` on one thread, then ``second(result)`` on
    another; the job's result is the second's."""

    __slots__ = ("reader", "first", "args", "loop", "second")

    def __init__(self, reader: Poster, first: Callable[..., R], args: tuple[object, ...],
                 loop: Poster, second: Callable[[R], object]) -> None:
        self.reader = reader
        self.first = first
        self.args = args
        self.loop = loop
        self.second = second

    def call_soon_threadsafe(self, _run_jobs: Callable[[list[Posted]], None],
                             jobs: list[Posted]) -> None:
        """Posted like a loop's jobs (``run_jobs, [(fn, args, deliver)]``); runs its own
        two steps for each, delivering the second's result."""
        for _fn, _args, deliver in jobs:
            self._post(deliver)

    def _post(self, deliver: Callable[[object], None]) -> None:
        def step() -> None:
            try:
                got = self.first(*self.args)
            except Exception:
                log.exception("HTTP: a log read failed")
                deliver(MISSING)
                return
            posted: list[Posted] = [(self.second, (got,), deliver)]
            self.loop.call_soon_threadsafe(run_jobs, posted)

        self.reader.call_soon_threadsafe(step)


def then(reader: Poster, first: Callable[..., R], args: tuple[object, ...], loop: Poster,
         second: Callable[[R], object]) -> Job:
    """A Gather job that runs first(*args) on reader, then second(result) on loop."""
    return (cast(Poster, _Then(reader, first, args, loop, second)), _unused, ())  # posts like one


def _unused() -> None:
    """Never called: _Then runs its own two steps."""
