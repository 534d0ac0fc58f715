"""The log reader thread (http/reader.py): jobs run off the caller's thread, a two-step
job hands its first result to a second loop, a failing step answers MISSING, the queue
is bounded, and a stopped reader runs nothing more."""
from __future__ import annotations

import threading
from typing import Any, Callable

from pybroker.http import reader as reader_mod
from pybroker.http.gather import MISSING, Gather, run_blocking
from pybroker.http.reader import LogReader, then


class ThreadLoop:
    """An event loop stand-in: runs each posted call on its own thread."""

    def __init__(self) -> None:
        self.threads: list[str] = []

    def call_soon_threadsafe(self, fn: Callable[..., Any], *args: Any) -> None:
        def run() -> None:
            self.threads.append(threading.current_thread().name)
            fn(*args)

        threading.Thread(target=run, name="owner").start()


def test_jobs_run_on_the_reader_thread() -> None:
    r = LogReader()
    try:
        got = run_blocking(Gather([(r, lambda: threading.current_thread().name, ())],
                                  lambda res: res[0]), 5)
        assert got == "logread"
    finally:
        r.stop()


def test_then_runs_the_second_step_on_the_other_loop() -> None:
    r = LogReader()
    loop = ThreadLoop()
    seen: list[str] = []

    def first(x: int) -> int:
        seen.append(threading.current_thread().name)
        return x * 2

    try:
        got = run_blocking(Gather([then(r, first, (21,), loop, lambda v: v + 0)],
                                  lambda res: res[0]), 5)
        assert got == 42 and seen == ["logread"] and loop.threads == ["owner"]

        def broken() -> int:
            raise OSError("disk gone")

        got = run_blocking(Gather([then(r, broken, (), loop, lambda v: v)],
                                  lambda res: res[0]), 5)
        assert got is MISSING
    finally:
        r.stop()


def test_the_queue_is_bounded_and_a_stopped_reader_runs_nothing() -> None:
    r = LogReader()
    gate, started = threading.Event(), threading.Event()
    ran: list[int] = []

    def hold() -> None:
        started.set()
        gate.wait(5)

    r.call_soon_threadsafe(hold)
    assert started.wait(5)          # the reader is busy with it: the queue is empty
    for i in range(reader_mod.MAX_QUEUED):
        assert not r.busy()
        r.call_soon_threadsafe(ran.append, i)
    assert r.busy()
    r._stopped = True          # as stop() does first: what is queued is dropped
    gate.set()
    r.stop()
    assert ran == []
