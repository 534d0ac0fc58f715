"""FollowerSyncs: where a follower's fsync runs, in fsync mode (docs/replication.md,
"A follower's fsync on its loop").

A follower acknowledges records once they are synced: it appends a leader's answer,
fsyncs it, and only then sends its next fetch (which is the acknowledgement). Handed to
the storage thread, that fsync costs two thread hand-offs a round (loop to storage
thread, storage thread back to the loop: on this 2-core machine about a third of a
follower's CPU a message in the PUB 4 x 1 flow, 118 against 75 us). Run on the loop,
it costs neither; but a loop that syncs waits for the disk.

So a follower's loop syncs itself only while that wait harms nobody and stays short:

- the loop serves no client connection and no follower of this node (its topics'
  fetches): only replication waits there, and replication waits for the sync anyway
  (``ClusterNode.sync_follower`` checks);
- and the node's fsyncs have been fast: an inline fsync that takes over SLOW_NS turns
  inline syncing off, and the storage thread syncs until RESUME_AFTER of its fsyncs in
  a row took SLOW_NS or less (measured from the hand-over to the completion).

Budget: each loop is held by one slow fsync at most (a disk that turns slow without
warning: loops syncing at that moment each meet one), then not again until the disk
has been fast for RESUME_AFTER syncs; a disk that stays slow never holds a loop again. Thread-safe (the loops record inline syncs,
the storage thread handed ones): one lock, held for a few comparisons.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypedDict

SLOW_NS = 20_000_000     # an inline fsync slower than this turns it off (the loop budget)
RESUME_AFTER = 64        # this many fast handed fsyncs in a row turn it on again


class SyncCounts(TypedDict):
    """/stats ``cluster.follower_syncs``."""

    inline: int        # fsyncs a follower's loop ran itself
    handed: int        # fsyncs handed to the storage thread
    slow: int          # inline fsyncs over SLOW_NS (each turned inline syncing off)
    inline_on: bool    # whether the next one may run inline


class FollowerSyncs:
    """The policy of the module docstring, for one node (one disk)."""

    def __init__(self, clock: Callable[[], int] = time.monotonic_ns,
                 slow_ns: int = SLOW_NS, resume_after: int = RESUME_AFTER) -> None:
        self.clock = clock
        self.slow_ns = slow_ns
        self.resume_after = resume_after
        self._lock = threading.Lock()
        self._on = True
        self._fast = 0          # fast handed fsyncs in a row, while off
        self._inline = 0
        self._handed = 0
        self._slow = 0

    def inline_on(self) -> bool:
        """May the next fsync run on the asking loop (any thread; a racy read)?"""
        return self._on

    def took_inline(self, ns: int) -> None:
        """An inline fsync took ns."""
        with self._lock:
            self._inline += 1
            if ns > self.slow_ns:
                self._slow += 1
                self._on = False
                self._fast = 0

    def took_handed(self, ns: int) -> None:
        """A handed fsync took ns (from the hand-over to its completion)."""
        with self._lock:
            self._handed += 1
            if self._on:
                return
            if ns > self.slow_ns:
                self._fast = 0
                return
            self._fast += 1
            if self._fast >= self.resume_after:
                self._on = True
                self._fast = 0

    def counts(self) -> SyncCounts:
        with self._lock:
            return {"inline": self._inline, "handed": self._handed, "slow": self._slow,
                    "inline_on": self._on}


__all__ = ["RESUME_AFTER", "SLOW_NS", "FollowerSyncs", "SyncCounts"]
