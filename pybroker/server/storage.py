"""StorageManager: the broker's disk state under ``data_path`` — queues, metadata, the
periodic sync, restore at start-up, persist at shutdown, and import from nsqd.

Layout: ``<data_path>/nsqd.dat`` (nsqd's metadata schema, written atomically on every
topic/channel change), ``<data_path>/queues/<name>/`` (one pybroker.storage.DiskQueue per
topic and per ``topic:channel``). The ``storage-sync`` thread calls ``maybe_sync`` on every
queue each 100 ms (nsqd's sync_every / sync_timeout policy, plus read checkpoints).
A storage error never kills a thread: it is logged, reported by /ping, and cleared by the
next write that works.
"""
from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from typing import Any

from pybroker.storage import DiskQueue, MetadataError, StorageError
from pybroker.storage.metadata import (BrokerMetadata, ChannelMeta, TopicMeta, load_metadata,
                                       save_metadata)
from pybroker.storage.nsqd_import import NsqdDataDir

log = logging.getLogger("pybroker")
SYNC_PERIOD_S = 0.1


class StorageManager:
    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        o = runtime.options
        self.data_path = os.path.abspath(o.data_path or ".")
        self.queue_root = os.path.join(self.data_path, "queues")
        self.meta_path = os.path.join(self.data_path, "nsqd.dat")
        self.durable = o.durability == "fsync"
        self._queues: dict[str, DiskQueue] = {}
        self._lock = threading.Lock()
        # after a failed write: the queues it concerned and their write counts then
        self._watch: dict[int, tuple[DiskQueue, int]] = {}
        self._failures = 0
        self._meta_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="storage-sync", daemon=True)

    # -- start-up -------------------------------------------------------------------------
    def prepare(self) -> None:
        """Create the data directory; raise StorageError/OSError if it cannot be used."""
        os.makedirs(self.queue_root, exist_ok=True)
        probe = os.path.join(self.data_path, ".pybroker-write-test")
        with open(probe, "wb") as f:
            f.write(b"ok")
        os.unlink(probe)

    def open_backend(self, name: str, ephemeral: bool) -> DiskQueue | None:
        """The Broker's backend factory: a DiskQueue, or None for #ephemeral."""
        if ephemeral:
            return None
        o = self.runtime.options
        q = DiskQueue(self.queue_root, name, max_bytes_per_file=o.max_bytes_per_file,
                      max_record_bytes=o.max_msg_size + 64, sync_every=o.sync_every,
                      sync_timeout_s=o.sync_timeout / 1e9)
        with self._lock:
            old = self._queues.get(name)
            self._queues[name] = q
        if old is not None:
            old.close()
        return q

    def restore(self) -> None:
        """Recreate topics and channels from nsqd.dat (importing an nsqd data dir first
        if there is one) and hand their backlogs to the channels."""
        self._import_nsqd()
        loaded = load_metadata(self.meta_path)
        for problem in loaded.problems:
            log.error("NSQ: metadata: %s", problem)
        if loaded.source == "backup":
            log.warning("NSQ: metadata restored from %s.bak", self.meta_path)
        topics = [(t.name, t.paused, [(c.name, c.paused) for c in t.channels])
                  for t in loaded.metadata.topics]
        log.info("NSQ: loading %d topics from %s", len(topics), self.meta_path)
        self.runtime.broker.restore(topics)
        self.save_metadata()
        self._thread.start()

    def _import_nsqd(self) -> None:
        """An nsqd 1.x data_path: import its topics, channels and queued messages once,
        then move its files aside into nsqd-imported/."""
        try:
            names = os.listdir(self.data_path)
        except OSError:
            return
        if not any(n.endswith(".diskqueue.meta.dat") for n in names):
            return
        src = NsqdDataDir(self.data_path, max_msg_size=self.runtime.options.max_msg_size)
        for problem in src.problems:
            log.error("NSQ: import: %s", problem)
        broker = self.runtime.broker
        count = 0
        for it in src.topics():
            topic = broker.get_topic(it.name)
            with topic.lock:
                topic.paused = it.paused
                chans = [topic.channels.get(c.name) or topic.new_channel(c.name)
                         for c in it.channels]
            for ch, ic in zip(chans, it.channels):
                ch.paused = ic.paused
                count += self._import_queue(ch.backend, ic.queue)
            if topic.backend is not None:
                count += self._import_queue(topic.backend, it.queue)
        for name in src.orphan_queues():
            # matches nsqd: a queue whose topic/channel is not in nsqd.dat stays dormant
            # until a topic/channel of that name is created again, then delivers
            q = self.open_backend(name, False)
            n = self._import_queue(q, src.queue(name))
            self.forget(name)
            if q is not None:
                q.close()
            log.info("NSQ: import: kept %d messages of dormant queue %r", n, name)
            count += n
        moved = os.path.join(self.data_path, "nsqd-imported")
        os.makedirs(moved, exist_ok=True)
        for fname in names:
            if ".diskqueue." in fname or fname.startswith("nsqd") and fname.endswith(".dat"):
                shutil.move(os.path.join(self.data_path, fname), os.path.join(moved, fname))
        log.info("NSQ: imported %d messages from an nsqd data directory (its files are "
                 "now in %s)", count, moved)
        self.save_metadata()

    @staticmethod
    def _import_queue(backend: Any, queue: Any) -> int:
        if backend is None or queue is None:
            return 0
        from pybroker.core.message import Message, to_record

        records = [to_record(Message(m.id, m.body, m.ts_ns, m.attempts))
                   for m in queue.messages()]
        if records:
            backend.put_many(records)
            backend.checkpoint()
        return len(records)

    # -- metadata -------------------------------------------------------------------------
    def save_metadata(self) -> None:
        """Write nsqd.dat (topics, channels, paused flags); ephemeral ones are left out."""
        broker = self.runtime.broker
        topics = []
        for t in broker.all_topics():
            if t.ephemeral or t.deleted:
                continue
            chans = [ChannelMeta(c.name, c.paused) for c in list(t.channels.values())
                     if not c.ephemeral and not c.deleted]
            topics.append(TopicMeta(t.name, t.paused, chans))
        with self._meta_lock:
            try:
                save_metadata(self.meta_path, BrokerMetadata(topics))
            except (MetadataError, OSError) as e:
                self.failed(e)

    # -- health ---------------------------------------------------------------------------
    def failed(self, err: BaseException) -> None:
        """A write failed (any thread): log it, report it through /ping until the
        queue it failed on (or, if unknown, any queue) writes successfully again."""
        log.error("NSQ: storage: %s", err)
        path = getattr(err, "path", None)
        with self._lock:
            queues = [q for q in self._queues.values()
                      if path is None or path == q.path or path.startswith(q.path + os.sep)]
            self._watch = {id(q): (q, q.stats()["writes"]) for q in queues}
            self._failures += 1
        self.runtime.health = f"failed to write to disk - {err}"

    def _recovered(self) -> bool:
        # caller holds self._lock
        try:
            return any(q.stats()["writes"] > n for q, n in self._watch.values())
        except Exception:
            return False

    def _run(self) -> None:
        while not self._stop.wait(SYNC_PERIOD_S):
            now = time.monotonic_ns()
            with self._lock:
                queues = list(self._queues.items())
                failures = self._failures
            for name, q in queues:
                try:
                    q.maybe_sync(now)
                except StorageError as e:
                    self.failed(e)
                except Exception:  # closed meanwhile (deleted topic/channel)
                    continue
            with self._lock:
                healed = (self._watch and failures == self._failures and self._recovered())
                if healed:
                    self._watch = {}
            if healed and self.runtime.health and self.runtime.health.startswith("failed to write"):
                log.info("NSQ: storage: writes work again")
                self.runtime.health = None

    def forget(self, name: str) -> None:
        with self._lock:
            self._queues.pop(name, None)

    # -- shutdown -------------------------------------------------------------------------
    def persist(self) -> None:
        """After the loops stopped: write every in-memory, in-flight and deferred message,
        checkpoint every queue, save metadata, close the files."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        now, wall = time.monotonic_ns(), time.time_ns()
        written = 0
        for t in self.runtime.broker.all_topics():
            for ch in list(t.channels.values()):
                try:
                    written += ch.persist_all(now, wall)
                except StorageError as e:
                    self.failed(e)
            try:
                written += t.persist_buffer()
            except StorageError as e:
                self.failed(e)
        log.info("NSQ: persisted %d in-memory messages to %s", written, self.queue_root)
        self.save_metadata()
        with self._lock:
            queues = list(self._queues.values())
            self._queues.clear()
        for q in queues:
            try:
                q.close()
            except StorageError as e:
                self.failed(e)
