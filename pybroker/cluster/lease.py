"""LeaseKeeper: this node's etcd lease renewed on a thread of its own
(``cluster-lease``), every ttl/3 (ttl/6 after a failure).

Why its own thread: the coordinator's thread also reads etcd every 200 ms and acts on
what it reads, one etcd call at a time (a topic's registration, a campaign, a copy's
files). With 300 topics made at once that took longer than the lease: the renewal,
queued behind it on the same thread, came too late, the lease expired, and every
leadership of the node was lost at once (then the others' in-sync changes for those
topics failed until they had read etcd again: thousands of log lines). Here nothing
the coordinator does can delay a renewal.

What it owns: only the renewal. A renewal that works moves the node's LeaseClock
(counted from when it was *sent*: rules.LeaseClock) if the lease renewed is still the
session's (``begin`` and a renewal hold one lock, so a late answer for a lease that was
replaced never extends the new one). What it learns goes to the coordinator's thread
(``post``): a failure and a success (its Outage log), and an expired lease (the
coordinator then begins a new session, and tells this thread its lease with
``begin``). Budget: one etcd call at a time, each with the client's deadline.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

from pybroker.cluster.etcd import Etcd, EtcdError
from pybroker.cluster.rules import LeaseClock

Post = Callable[..., None]


class LeaseKeeper:
    def __init__(self, etcd: Etcd, every_ns: int, clock: LeaseClock, post: Post,
                 failed: Callable[[str], None], ok: Callable[[], None],
                 expired: Callable[[int], None]) -> None:
        self.etcd = etcd
        self.every_ns = every_ns
        self.clock = clock
        self.post = post
        self.failed = failed
        self.ok = ok
        self.expired = expired
        self.lock = threading.Lock()
        self.lease_id = 0            # the session's lease (0: none yet)
        self.renewals = 0
        self._stop = threading.Event()
        self.thread: threading.Thread | None = None

    def begin(self, lease_id: int, sent_ns: int) -> None:
        """A session began on ``lease_id``, granted by a request sent at ``sent_ns``
        (any thread)."""
        with self.lock:
            self.lease_id = lease_id
            self.clock.renewed(sent_ns)

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="cluster-lease", daemon=True)
        self.thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self.thread is not None:
            self.thread.join(timeout_s)

    def _run(self) -> None:
        wait_ns = self.every_ns
        while not self._stop.wait(wait_ns / 1e9):
            wait_ns = self.renew_once()

    def renew_once(self) -> int:
        """One renewal; returns how long to wait before the next (ns)."""
        with self.lock:
            lease = self.lease_id
        if not lease:
            return self.every_ns // 2
        sent = time.monotonic_ns()
        try:
            ttl = self.etcd.keepalive(lease)
        except EtcdError as e:
            self.post(self.failed, f"lease renewal failed: {e}")
            return self.every_ns // 2
        self.post(self.ok)
        if ttl <= 0:
            self.post(self.expired, lease)
            return self.every_ns // 2
        with self.lock:
            if self.lease_id == lease:
                self.clock.renewed(sent)
                self.renewals += 1
        return self.every_ns


__all__ = ["LeaseKeeper"]
