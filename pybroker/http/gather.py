"""Gather: work that must run on event-loop threads before a request can be answered.

A loop's thread owns its connections and channels, so reads that need a consistent view
(channel counts, clients, producers) and channel changes (pause, empty) are posted to
the owning loops with ``call_soon_threadsafe``. A Gather lists those jobs and a
``finish(results)`` that turns their results into the answer. The HTTP thread runs a
Gather without blocking (HttpServer.submit); other threads, such as the statsd pusher,
wait for one with a deadline (``run_blocking``). A job that did not answer in time, or
failed, yields ``MISSING``.

A job whose result is known only later on its loop (a publish: when the write, and in
fsync mode the fsync, that carried it is settled) returns a ``Later``; its result is
delivered when the loop resolves it, and the HTTP thread waits for it like for any job.
"""
from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Final, Generic, Protocol, TypeVar, Unpack

from pybroker.evloop import Ts

log = logging.getLogger("pybroker")
T = TypeVar("T")
U = TypeVar("U")


class Poster(Protocol):
    """Where a job runs: an event loop, the storage thread, the log reader."""

    def call_soon_threadsafe(self, fn: Callable[[Unpack[Ts]], object],
                             *args: Unpack[Ts]) -> None: ...


Job = tuple[Poster, Callable[..., object], tuple[object, ...]]  # (loop, fn, args)


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Final = _Missing()


class Gather(Generic[T]):
    """``off_thread``: its finish is long (a /stats of 10,000 topics: about 40 ms of
    Python and a 6 MB JSON body) or may wait (for jobs it posts itself: /stats and
    /metrics plan and gather there): the HTTP server runs it on the log reader's thread,
    never its own, and refuses it when that thread's queue is full (HttpServer._finish)."""

    __slots__ = ("finish", "jobs", "off_thread", "timeout_s")

    def __init__(self, jobs: list[Job], finish: Callable[[list[object]], T],
                 timeout_s: float = 2.0, off_thread: bool = False) -> None:
        self.jobs = jobs
        self.finish = finish
        self.timeout_s = timeout_s
        self.off_thread = off_thread

    def then(self, fn: Callable[[T], U], off_thread: bool | None = None) -> Gather[U]:
        """A Gather with the same jobs whose answer is fn(this one's answer)."""
        inner = self.finish
        return Gather(self.jobs, lambda results: fn(inner(results)), self.timeout_s,
                      self.off_thread if off_thread is None else off_thread)


class Later:
    """A job's result that its loop gives later (loop thread only): ``resolve(value)``
    hands it to whoever waits (once; later calls are ignored)."""

    __slots__ = ("_deliver", "_value", "_done")

    def __init__(self) -> None:
        self._deliver: Callable[[object], None] | None = None
        self._value: object = MISSING
        self._done = False

    def resolve(self, value: object) -> None:
        if self._done:
            return
        self._done = True
        if self._deliver is not None:
            self._deliver(value)
        else:
            self._value = value

    def then(self, deliver: Callable[[object], None]) -> None:
        if self._done:
            deliver(self._value)
        else:
            self._deliver = deliver


def run_job(fn: Callable[..., object], args: tuple[object, ...],
            deliver: Callable[[object], None]) -> None:
    """On the loop thread: run one job and hand its result (or MISSING) to deliver;
    a Later's result when the loop resolves it."""
    try:
        result = fn(*args)
    except Exception:
        log.exception("HTTP: a job on the event loop failed")
        result = MISSING
    if isinstance(result, Later):
        result.then(deliver)
    else:
        deliver(result)


Posted = tuple[Callable[..., object], tuple[object, ...], Callable[[object], None]]


def run_jobs(jobs: list[Posted]) -> None:
    """On the loop thread: the jobs one turn of the HTTP server posted to this loop."""
    for fn, args, deliver in jobs:
        run_job(fn, args, deliver)


def run_blocking(g: Gather[T], timeout_s: float | None = None) -> T:
    """Post g's jobs and wait (with a deadline) for them; for threads that may block."""
    n = len(g.jobs)
    results: list[object] = [MISSING] * n
    # between the loops delivering results and the thread waiting for them
    lock = threading.Lock()
    done = threading.Event()
    remaining = [n]
    if n == 0:
        done.set()

    def deliver(i: int, value: object) -> None:
        with lock:
            results[i] = value
            remaining[0] -= 1
            if remaining[0] == 0:
                done.set()

    for i, (loop, fn, args) in enumerate(g.jobs):
        posted: list[Posted] = [(fn, args, functools.partial(deliver, i))]
        loop.call_soon_threadsafe(run_jobs, posted)
    done.wait(g.timeout_s if timeout_s is None else timeout_s)
    with lock:
        snapshot = list(results)
    return g.finish(snapshot)
