"""A stop event that a signal handler may set.

``threading.Event.set()`` takes the event's lock. A signal handler runs in the main
thread between two bytecodes, so if the main thread was inside ``Event.wait()`` holding
that same lock when the signal came, the handler's ``set()`` waits for a lock its own
thread holds: the process never stops. ``StopFlag.set()`` takes no lock: it sets a flag
and writes a byte to a pipe that waiters ``select`` on. A signal interrupts that
``select``; Python runs the handler and resumes it, and the byte wakes it.
"""
from __future__ import annotations

import math
import os
import select
import threading
import time

LOOK_S = 0.05   # how often a waiter without a pipe looks at the flag
SLICE_S = 1.0   # the longest sleep on the pipe before a waiter looks at the flag again


class StopFlag:
    """``set`` / ``is_set`` / ``wait`` like ``threading.Event``, safe from signal handlers.

    The pipe is made by ``prepare`` or the first ``wait`` (an object nobody waits on
    holds no file descriptor) and kept; a ``wait`` that finds no descriptor left for it
    looks at the flag every LOOK_S instead. The pipe is kept: a late ``set`` from
    another thread must never write to a descriptor number since given to another file.
    """

    def __init__(self) -> None:
        self._set = False
        self._fds: tuple[int, int] | None = None
        self._make_lock = threading.Lock()     # never taken by set()

    def set(self) -> None:
        self._set = True
        fds = self._fds
        if fds is not None:
            try:
                os.write(fds[1], b"x")
            except BlockingIOError:     # the pipe is full: waiters are woken already
                pass

    def is_set(self) -> bool:
        return self._set

    def prepare(self) -> None:
        """Make the pipe now, while descriptors are plenty: a process whose descriptors
        run out later (a connection flood) can still wait on it."""
        self._read_fd()

    def wake_fd(self) -> int:
        """The pipe's write end (made now if need be), for ``signal.set_wakeup_fd``: a
        signal that the kernel hands to another thread than the one waiting still
        wakes it, and the wait returns once the main thread has run the handler. Only
        for a process whose every Python signal handler sets this flag (each byte then
        means stop; none is ever read back)."""
        self._read_fd()
        assert self._fds is not None
        return self._fds[1]

    def _read_fd(self) -> int:
        with self._make_lock:
            if self._fds is None:
                r, w = os.pipe()
                os.set_blocking(w, False)
                self._fds = (r, w)
            return self._fds[0]

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until set or ``timeout_s`` passes; True if set."""
        if self._set:
            return True
        if timeout_s is not None and timeout_s < 0.001:
            # poll counts whole milliseconds: a shorter wait (a throttle's) sleeps; a
            # signal still runs its handler, and a set() meanwhile is seen on return
            if timeout_s > 0:
                time.sleep(timeout_s)
            return self._set
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            fd = self._read_fd()
        except OSError:     # no descriptor left for the pipe: look at the flag instead
            return self._wait_by_looking(deadline)
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        # a set() before the pipe existed wrote nothing: it is seen here. Each sleep
        # is at most SLICE_S: a signal the kernel hands to another thread does not wake
        # this one, and Python runs its handler only when this thread runs Python again
        while not self._set:
            left = SLICE_S if deadline is None else min(SLICE_S, deadline - time.monotonic())
            if left <= 0:
                break
            poller.poll(max(1, math.ceil(left * 1000)))
        return self._set

    def _wait_by_looking(self, deadline: float | None) -> bool:
        while not self._set:
            left = LOOK_S if deadline is None else deadline - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(LOOK_S, left))
        return self._set
