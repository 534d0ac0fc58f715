"""QueueScanner: the pool that finds timed-out in-flight and due deferred messages.

Matches nsqd's queueScanLoop: every ``queue_scan_interval`` it samples
``queue_scan_selection_count`` channels at random and has its workers check them; while
more than ``queue_scan_dirty_percent`` of a sample had work, it samples again at once.
The channel list is refreshed, and the pool resized to clamp(0.25 x channels, 1,
``queue_scan_worker_pool_max``), every ``queue_scan_refresh_interval`` and also as soon as
a topic or channel is created or deleted (nsqd waits for the interval). A worker calls
``channel.expire(now)`` (which takes the channel's lock) and posts what it found to the
channel's owner loop; it never touches a channel's queue or consumers itself.
"""
from __future__ import annotations

import logging
import queue
import random
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pybroker.config import Options
    from pybroker.core.broker import Broker
    from pybroker.core.channel import Channel

log = logging.getLogger("pybroker")
_STOP = None   # a job that tells a worker to stop


class QueueScanner:
    def __init__(self, broker: Broker, options: Options) -> None:
        self.broker = broker
        self.opts = options
        self._jobs: queue.Queue[Channel | None] = queue.Queue()
        self._results: queue.Queue[bool] = queue.Queue()
        self._workers: list[threading.Thread] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scanner", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
        for _ in self._workers:
            self._jobs.put(_STOP)
        for w in self._workers:
            w.join(timeout_s)

    def _resize(self, n_channels: int) -> None:
        want = max(1, min(int(n_channels * 0.25), self.opts.queue_scan_worker_pool_max))
        while len(self._workers) < want:
            w = threading.Thread(target=self._work, name=f"scanner-{len(self._workers)}",
                                 daemon=True)
            w.start()
            self._workers.append(w)
        while len(self._workers) > want:
            self._jobs.put(_STOP)
            self._workers.pop()

    def _run(self) -> None:
        o = self.opts
        interval_s = o.queue_scan_interval / 1e9
        refresh_ns = o.queue_scan_refresh_interval
        channels: list[Channel] = []
        refreshed = 0
        generation = -1
        while not self._stop.is_set():
            now = time.monotonic_ns()
            if now - refreshed >= refresh_ns or generation != self.broker.generation:
                generation = self.broker.generation
                channels = self.broker.all_channels()
                self._resize(len(channels))
                refreshed = now
            if not channels:
                self._stop.wait(interval_s)
                continue
            # keep sampling while enough of the sample was dirty (nsqd's "loop" label)
            while not self._stop.is_set():
                sample = random.sample(channels, min(o.queue_scan_selection_count, len(channels)))
                for ch in sample:
                    self._jobs.put(ch)
                dirty = sum(1 for _ in sample if self._results.get())
                if dirty <= o.queue_scan_dirty_percent * len(sample):
                    break
            self._stop.wait(interval_s)

    def _work(self) -> None:
        while True:
            ch = self._jobs.get()
            if ch is _STOP:
                return
            dirty = False
            try:
                if not ch.deleted:
                    timed_out, due = ch.expire(time.monotonic_ns())
                    if timed_out or due:
                        dirty = True
                        ch.owner.call_soon_threadsafe(ch.owner.on_expired, ch, timed_out, due)
            except Exception:
                log.exception("scanner: error while scanning %r", ch)
            finally:
                self._results.put(dirty)
