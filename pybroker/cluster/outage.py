"""Outage: the log of an outside service that keeps failing (etcd, for the
coordinator), without a flood.

The coordinator retries etcd on timers (the lease every ttl/6, the poll every 200 ms,
a topic's delete every 500 ms), and a line per failed call came to about seven lines a
second per node for as long as etcd was away. Here:

- the first failure after a success is logged whole, at ERROR;
- the failures after it are counted, and summarised at most once per ``every_ns``
  (default 30 s): how many, for how long, and the last one;
- the first success after failures is logged at WARNING: how long the outage lasted
  and how many calls failed in it.

So an outage of any length costs one line, one per 30 s while it lasts, and one at its
end. Used on the coordinator's thread only; the clock is an argument (tests drive it).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

SUMMARY_NS = 30_000_000_000


class Outage:
    __slots__ = ("what", "log", "clock", "every_ns", "since_ns", "failures",
                 "reported_ns", "last", "total")

    def __init__(self, what: str, log: logging.Logger,
                 clock: Callable[[], int] = time.monotonic_ns,
                 every_ns: int = SUMMARY_NS) -> None:
        self.what = what
        self.log = log
        self.clock = clock
        self.every_ns = every_ns
        self.since_ns = 0          # when the outage began (0: none now)
        self.failures = 0          # failed calls in this outage
        self.reported_ns = 0       # the last line about it
        self.last = ""
        self.total = 0             # failed calls since start-up (/stats)

    @property
    def failing(self) -> bool:
        return self.failures > 0

    def failed(self, why: object) -> None:
        """A call failed: ``why`` says what was tried and what happened."""
        now = self.clock()
        self.total += 1
        self.last = str(why)
        if not self.failures:
            self.since_ns = self.reported_ns = now
            self.failures = 1
            self.log.error("CLUSTER: %s: %s (retrying; further failures are summarised "
                           "every %d s)", self.what, why, self.every_ns // 1_000_000_000)
            return
        self.failures += 1
        if now - self.reported_ns >= self.every_ns:
            self.reported_ns = now
            self.log.error("CLUSTER: %s: still failing: %d failed calls in %.0f s; the "
                           "last: %s", self.what, self.failures,
                           (now - self.since_ns) / 1e9, why)

    def ok(self) -> None:
        """A call worked: the outage, if any, is over."""
        if not self.failures:
            return
        self.log.warning("CLUSTER: %s: working again after %.1f s (%d failed calls)",
                         self.what, (self.clock() - self.since_ns) / 1e9, self.failures)
        self.failures = 0
        self.since_ns = 0


__all__ = ["Outage", "SUMMARY_NS"]
