"""StorageManager: the broker's disk state under ``data_path`` and THE storage thread.

Layout (docs/storage.md): ``nsqd.dat`` (nsqd's metadata schema: topics, channels, paused
flags), ``topics/<topic>/`` (one TopicLog per topic), ``state/<topic>.json`` (the saved
cursors and pending offsets of the topic's channels) and ``state/<topic>.json.journal``
(the changes since it: pybroker.storage.statejournal).

Ownership: the ``storage`` thread owns every fsync (but a replicated topic's follower
may sync on its loop: ``sync_now``, pybroker.cluster.syncs), metadata save, channel-state save and
segment deletion. The topics' owner loops append and write (their Publishers: ``write()``
hands records to the kernel) and post the rest here: ``sync_topics`` (group commit for
fsync durability: one fsync per topic per pass, the completion posted back to the
asking loop, whose Publisher asks each log which epochs are durable or were lost by a
failed fsync, whichever fsync that was), ``save_metadata``, ``delete_topic``. Channel
states are snapshotted on their owner loops
(``Channel.snapshot``) at the storage thread's request and written here. A storage
error never kills a thread: it is logged and reported by /ping until the same kind of
operation works again for the same topic (a write of real records, an fsync, a state
or metadata save).

The topic logs' file operations go through ``fileops`` (pybroker.storage.fileops): the
real ones, or the fault plan of ``PYBROKER_FAULTS`` (a test facility, logged at start).
"""
from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Callable, NamedTuple, TypedDict, Union, Unpack

from pybroker.protocol.deadletter import dead_letter_settings
from pybroker.core.deferred import Chunks
from pybroker.core.lifecycle import ChannelState, deferred_states, state_floor
from pybroker.core.topic import Topic
from pybroker.storage import MetadataError, StorageError
from pybroker.storage._fsutil import safe_name
from pybroker.storage.fileops import REAL, FileOps, FaultyFileOps, from_environment
from pybroker.storage.lock import DataPathLock
from pybroker.storage.statejournal import SUFFIX as JOURNAL, StateWriter, load as load_state_text
from pybroker.storage.metadata import (BrokerMetadata, ChannelMeta, TopicMeta, load_metadata,
                                       save_metadata)
from pybroker.storage.topiclog import TopicLog
from pybroker.evloop import Ts
from pybroker.jsonvalue import PartTexts, dumps_keyed

if TYPE_CHECKING:
    from collections.abc import Generator

    from pybroker.core.broker import Broker
    from pybroker.server.ports import Loop, StorageHost



class TopicState(TypedDict, total=False):
    """A topic's saved state (state/<topic>.json, and the changes since in its journal:
    pybroker.storage.statejournal): its channels' states and where a
    first channel starts; ``floor`` and ``min_cursor`` are worked out for a checkpoint
    and not read back."""

    topic: str
    orphan_start: int
    released: int
    channels: dict[str, ChannelState]
    floor: int
    min_cursor: int


log = logging.getLogger("pybroker")
TICK_S = 0.05
META_RETRY_S = 1.0    # a failed nsqd.dat save is tried again after this
SNAPSHOT_WAIT_S = 2.0
SNAPSHOT_STEP = 1_024  # channels a loop snapshots a turn for a checkpoint (about 5 ms)


class _Sync(NamedTuple):
    """fsync these topics, then call done(topics) (group commit)."""
    topics: list[Topic]
    done: Callable[[list[Topic]], None]


class _Delete(NamedTuple):
    """Remove a deleted topic's files (its directory, renamed aside to ``gone``)."""
    topic: Topic
    gone: str | None


class _Call(NamedTuple):
    """Run fn(*args) on the storage thread."""
    fn: Callable[..., object]
    args: tuple[object, ...]


class _Stop:
    """The storage thread's last request."""


_STOP = _Stop()
# None: only wake the thread (a metadata save or a checkpoint is wanted)
_Request = Union[_Sync, _Delete, _Call, _Stop, None]


class StorageManager:
    def __init__(self, runtime: StorageHost) -> None:
        self.runtime = runtime
        o = runtime.options
        self.options = o
        self.data_path = os.path.abspath(o.data_path or ".")
        self.log_root = os.path.join(self.data_path, "topics")
        self.state_root = os.path.join(self.data_path, "state")
        # each topic's channel states as this thread last wrote them (storage thread)
        self._saved_states: dict[Topic, SavedState] = {}
        # each channel's chunks of deferred messages as last encoded here (their JSON:
        # a changed state encodes only the chunks that changed; jsonvalue.PartTexts)
        self._texts: dict[Topic, dict[str, PartTexts]] = {}
        # each topic's state file and its journal of changes (pybroker.storage.
        # statejournal), and the memory of its last encoding in pieces (dumps_keyed)
        self._writers: dict[Topic, tuple[StateWriter, PartTexts]] = {}
        self.meta_path = os.path.join(self.data_path, "nsqd.dat")
        self.durable = o.durability == "fsync"
        self._requests: queue.Queue[_Request] = queue.Queue()
        self._meta_wanted = threading.Event()
        self._meta_retry_at = 0.0   # a failed metadata save is tried again from then on
        self._save_soon = threading.Event()
        # (topic name or "", kind) of what failed and has not worked since
        self._failed_topics: set[tuple[str, str]] = set()
        # shared by the loops (and HTTP) that report writes: the set of failing topics and
        # runtime.health change together under it (write_ok, failed)
        self._lock = threading.Lock()
        # told (on the failing thread) when a topic's write or fsync failed: a cluster
        # node hands over the leadership of a topic it cannot store (docs/replication.md)
        self.on_topic_failure: list[Callable[[Topic, str], None]] = []
        self.fileops: FileOps = REAL
        self._thread = threading.Thread(target=self._run, name="storage", daemon=True)
        self.lock = DataPathLock(self.data_path)

    # -- start-up -------------------------------------------------------------------------
    def prepare(self) -> None:
        """Create the data directories and lock the data_path (one broker per data_path,
        as nsqd); raise StorageError/OSError (DataPathLocked) if they cannot be used."""
        self.fileops = from_environment()
        if isinstance(self.fileops, FaultyFileOps):
            log.warning("NSQ: storage: TEST FAULT PLAN ARMED (PYBROKER_FAULTS): %s",
                        self.fileops.describe())
        os.makedirs(self.data_path, exist_ok=True)
        self.lock.acquire()
        os.makedirs(self.log_root, exist_ok=True)
        os.makedirs(self.state_root, exist_ok=True)
        for name in os.listdir(self.log_root):
            if name.startswith(".deleted-"):   # a delete that a crash interrupted
                import shutil  # not at start-up (it loads bz2 and lzma)

                shutil.rmtree(os.path.join(self.log_root, name), ignore_errors=True)
        probe = os.path.join(self.data_path, ".pybroker-write-test")
        with open(probe, "wb") as f:
            f.write(b"ok")
        os.unlink(probe)

    def open_log(self, name: str, ephemeral: bool) -> TopicLog:
        """The Broker's log factory: a TopicLog on disk, or in memory for #ephemeral."""
        o = self.options
        directory = None if ephemeral else os.path.join(self.log_root, safe_name(name))
        return TopicLog(directory, max_bytes_per_file=o.max_bytes_per_file,
                        mem_records=o.mem_queue_size,
                        max_record_bytes=o.max_msg_size + 64, fileops=self.fileops)

    def restore(self) -> None:
        """Recreate topics and channels from nsqd.dat (importing an nsqd data dir first
        if there is one), with their saved channel states."""
        try:
            names = os.listdir(self.data_path)
        except OSError:
            names = []
        if "queues" not in names and not any(n.endswith(".diskqueue.meta.dat") for n in names):
            self._load()  # nothing to import or migrate: the importer is not even loaded
            self._thread.start()
            self.save_metadata()
            return
        from pybroker.server.importer import import_nsqd_dir, migrate_queues_dir

        broker = self.runtime.broker
        if import_nsqd_dir(self.data_path, self.options.max_msg_size, broker):
            self.save_now()
        else:
            self._load()
            if migrate_queues_dir(self.data_path, broker):
                self.save_now()
        self._thread.start()
        self.save_metadata()

    def _load(self) -> None:
        loaded = load_metadata(self.meta_path)
        for problem in loaded.problems:
            log.error("NSQ: metadata: %s", problem)
        if loaded.source == "backup":
            log.warning("NSQ: metadata restored from %s.bak", self.meta_path)
        broker = self.runtime.broker
        log.info("NSQ: loading %d topics from %s", len(loaded.metadata.topics), self.meta_path)
        now, wall = time.monotonic_ns(), time.time_ns()
        for tm in loaded.metadata.topics:
            t = broker.get_topic(tm.name)
            state = self._load_state(tm.name)
            chans = state.get("channels", {})
            with t.lock:
                t.paused = tm.paused
                if "orphan_start" in state:
                    t.orphan_start = max(int(state["orphan_start"]), t.log.oldest)
                if tm.paused and "released" in state:
                    t.released = max(min(int(state["released"]), t.log.written), t.log.oldest)
                for cm in tm.channels:
                    saved = chans.get(cm.name)
                    ch = t.new_channel(cm.name, cursor=max(t.orphan_start, t.log.oldest))
                    ch.paused = cm.paused
                    settings = dead_letter_settings(cm.extra)
                    if settings:
                        ch.configure_dead_letters(settings)
                    if saved is not None:
                        ch.restore(saved, now, wall)

    def _state_path(self, topic: str) -> str:
        return os.path.join(self.state_root, safe_name(topic) + ".json")

    def _load_state(self, topic: str) -> TopicState:
        path = self._state_path(topic)
        try:
            text = load_state_text(path)       # the file, and its journal's changes
            if text is None:
                return {}
            state = json.loads(text)
            return state if isinstance(state, dict) else {}  # type: ignore[return-value]
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            # a lost state only repeats deliveries: every channel restarts at the oldest
            log.error("NSQ: channel state %s unreadable (%s): delivering from the oldest "
                      "retained message", path, e)
            return {}

    # -- requests from other threads --------------------------------------------------------
    def sync_topics(self, topics: list[Topic], done: Callable[[list[Topic]], None]
                    ) -> None:
        """fsync these topics' logs on the storage thread, then call done(topics) there
        (the caller's done posts back to its loop; each log then says which epochs are
        durable, ``durable_epoch``, and which a failed fsync lost, ``lost_by``). Requests
        that queue up meanwhile share the next round of fsyncs (group commit)."""
        self._requests.put(_Sync(topics, done))

    def sync_now(self, t: Topic) -> bool:
        """fsync t's log on the calling thread, as the storage thread would (a
        follower's loop, when pybroker.cluster.syncs allows it); False if it failed."""
        return self._sync_log(t)

    def save_metadata(self) -> None:
        """Ask for nsqd.dat to be written (coalesced; any thread)."""
        self._meta_wanted.set()
        self._requests.put(None)

    def call_soon_threadsafe(self, fn: Callable[[Unpack[Ts]], object],
                             *args: Unpack[Ts]) -> None:
        """Run fn(*args) on the storage thread, in order with its other work (the HTTP
        server's Gathers use this to wait for an fsync without blocking)."""
        self._requests.put(_Call(fn, args))

    def request_checkpoint(self) -> None:
        """Save channel states soon (e.g. a REQ with a delay in fsync mode: its due time
        survives a crash once saved) rather than at the next sync_timeout."""
        self._save_soon.set()
        self._requests.put(None)

    def delete_topic(self, t: Topic) -> None:
        """A deleted topic (its exit flag is set): its directory is renamed aside and its
        state file removed at once, so a new topic of the same name starts clean while
        the storage thread removes the old files."""
        gone = None
        if t.log.directory is not None:
            gone = os.path.join(self.log_root, f".deleted-{os.urandom(8).hex()}")
            try:
                os.rename(t.log.directory, gone)
            except FileNotFoundError:
                gone = None
            except OSError as e:
                log.error("NSQ: storage: moving the log of deleted topic %s aside: %s",
                          t.name, e)
                gone = None
        self._remove_state(t.name)
        self._requests.put(_Delete(t, gone))

    def _remove_state(self, name: str) -> None:
        for path in (self._state_path(name) + JOURNAL, self._state_path(name)):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as e:
                log.error("NSQ: storage: removing state of %s: %s", name, e)

    def write_ok(self, t: Topic | None, kind: str = "write") -> None:
        """An operation of this kind worked for t (a write of real records, an fsync, a
        state save; None: the metadata): if storage was unhealthy because of it, it no
        longer is; once nothing failing is left, /ping says OK again."""
        key = (t.name if t is not None else "", kind)
        with self._lock:
            if key not in self._failed_topics:
                return
            self._failed_topics.discard(key)
            if self._failed_topics or not (self.runtime.health or "").startswith(
                    "failed to write"):
                return
            # under the lock: a failure on another loop now cannot be overwritten
            self.runtime.health = None
        log.info("NSQ: storage: writes work again")

    def failed(self, err: BaseException, topic: Topic | None = None,
               kind: str = "write") -> None:
        """An operation failed (any thread): log it; /ping says NOK until the same kind
        of operation works again for the same topic (``write_ok``)."""
        log.error("NSQ: storage: %s", err)
        with self._lock:
            self._failed_topics.add((topic.name if topic is not None else "", kind))
            self.runtime.health = f"failed to write to disk - {err}"
        if topic is not None and kind in ("write", "sync"):
            for tell in self.on_topic_failure:
                try:
                    tell(topic, kind)
                except Exception:    # a bug: never into the write or fsync that failed
                    log.exception("NSQ: storage: telling of %s's failure failed",
                                  topic.name)

    # -- the storage thread -----------------------------------------------------------------
    def _run(self) -> None:
        o = self.options
        next_save = time.monotonic() + o.sync_timeout / 1e9
        stop = False
        while not stop:
            try:
                first = self._requests.get(timeout=TICK_S)
            except queue.Empty:
                first = None
            stop = self._serve([first] if first is not None else [])
            if self._meta_retry_at and time.monotonic() >= self._meta_retry_at:
                self._meta_retry_at = 0.0
                self._meta_wanted.set()
            if self._meta_wanted.is_set():
                self._meta_wanted.clear()
                self._write_metadata()
            if (time.monotonic() >= next_save or self._save_soon.is_set()) and not stop:
                self._save_soon.clear()
                next_save = time.monotonic() + o.sync_timeout / 1e9
                self.checkpoint()

    def run_pending(self) -> None:
        """Serve every request queued now on the calling thread, as one pass of the
        storage thread would (for tests that drive the loops and storage by hand)."""
        self._serve([])

    def _serve(self, batch: list[_Request]) -> bool:
        """One pass: the requests in batch and every one queued behind them (all the
        fsyncs they ask for in one round); True when asked to stop."""
        while True:
            try:
                batch.append(self._requests.get_nowait())
            except queue.Empty:
                break
        stop = False
        syncs: list[_Sync] = []
        for req in batch:
            if isinstance(req, _Stop):
                stop = True
            elif isinstance(req, _Delete):
                self._remove_topic(req.topic, req.gone)
            elif isinstance(req, _Call):
                try:
                    req.fn(*req.args)
                except Exception:
                    log.exception("NSQ: storage: a posted call failed")
            elif isinstance(req, _Sync):
                syncs.append(req)
        if syncs:
            self._group_sync(syncs)
        return stop

    def _group_sync(self, syncs: list[_Sync]) -> None:
        """One fsync per topic for every publish that asked since the last round."""
        for t in {t: None for ts, _ in syncs for t in ts}:    # each topic once
            self._sync_log(t)
        for ts, done in syncs:
            try:
                done(ts)
            except Exception:
                log.exception("NSQ: storage: completion failed")

    def _sync_log(self, t: Topic) -> bool:
        """fsync t's log; False if it failed (the log then counts every epoch not yet
        durable as lost, so the publishes waiting for them fail)."""
        before = t.log.durable_epoch
        try:
            t.log.sync()
        except StorageError as e:
            if t.deleted:
                return False     # its files were moved aside: nothing is kept anyway
            self.failed(e, t, "sync")
            return False
        except Exception as e:     # a bug: nothing may count as durable meanwhile
            log.exception("NSQ: storage: syncing %s failed", t.name)
            failure = StorageError(f"sync {t.name}: {e}")
            t.log.lose_unsynced(failure)
            self.failed(failure, t, "sync")
            return False
        if self.runtime.health is not None and t.log.durable_epoch > before:
            self.write_ok(t, "sync")        # an fsync of real records worked
        return True

    def _remove_topic(self, t: Topic, gone: str | None) -> None:
        try:
            t.log.close()
        except Exception as e:
            log.error("NSQ: storage: closing the log of deleted topic %s: %s", t.name, e)
        if gone is not None:
            import shutil

            shutil.rmtree(gone, ignore_errors=True)

    def _write_metadata(self) -> None:
        broker = self.runtime.broker
        topics = []
        for t in broker.all_topics():
            if t.ephemeral or t.deleted:
                continue
            chans = [ChannelMeta(c.name, c.paused, dict(c.dl_settings))
                     for c in list(t.channels.values()) if not c.ephemeral and not c.deleted]
            topics.append(TopicMeta(t.name, t.paused, chans))
        try:
            save_metadata(self.meta_path, BrokerMetadata(topics))
        except (MetadataError, OSError) as e:
            self.failed(e, None, "metadata")
            self._meta_retry_at = time.monotonic() + META_RETRY_S
            return
        if self.runtime.health is not None:
            self.write_ok(None, "metadata")

    # -- checkpoints: fsync, channel states, segment deletion -------------------------------
    def checkpoint(self, snapshots: dict[Topic, TopicState] | None = None) -> None:
        """Sync every log, save every topic's channel states, then delete the segments
        no channel needs any more (and retention does not keep)."""
        if snapshots is None:
            snapshots = self._collect_snapshots()
            if snapshots is None:
                return
        o = self.options
        wall = time.time_ns()
        saved = self._saved_states
        for t in [t for t in saved if t.deleted]:
            del saved[t]
        for t in [t for t in self._writers if t.deleted]:
            del self._writers[t]
        for t, snap in snapshots.items():
            if t.deleted or t.ephemeral:
                continue
            if not self._sync_log(t):
                continue
            now = _saved_state(snap)
            if not _same_state(saved.get(t), now):
                # unchanged since this thread last wrote it: neither encoded nor written
                # again (an idle topic cost an fsynced write, a rename and a directory
                # fsync at every checkpoint, every sync_timeout; 1,000,000 deferred
                # messages 35 MB of JSON)
                writer, memo = self._writers.get(t) or self._writers.setdefault(
                    t, (StateWriter(self._state_path(t.name), self.fileops), PartTexts()))
                try:
                    # made and written in pieces: not one long hold of the GIL; what
                    # changed since the last write appended to the state's journal
                    writer.save(dumps_keyed(snap, memo))
                except OSError as e:
                    saved.pop(t, None)
                    if not t.deleted:     # (else its files went meanwhile: on purpose)
                        self.failed(e, t, "state")
                    continue
                if t.deleted:
                    # deleted while it was written: delete_topic removed its files
                    # before this write put them back (a whole write's rename). Left
                    # there, a topic created again under the name would, after a
                    # crash before its own first save, start from this one's cursors.
                    # Only this thread writes state files, so what is removed here is
                    # this write's.
                    self._remove_state(t.name)
                    continue
                saved[t] = now
                if self.runtime.health is not None:
                    self.write_ok(t, "state")
            floor = snap["floor"]
            t.prune_dpubs(snap["min_cursor"])
            t.prune_gaps(snap["min_cursor"])
            self._retain(t, floor, o.retention_time, o.retention_bytes, wall)

    @staticmethod
    def _retain(t: Topic, floor: int, keep_ns: int, keep_bytes: int, wall_ns: int) -> None:
        lg = t.log
        segs = lg.segments()
        total = lg.size_bytes()
        drop_to = lg.oldest
        for seg in segs[:-1]:    # never the segment being written
            if seg.end > floor:
                break
            if keep_ns or keep_bytes:
                old = bool(keep_ns) and seg.max_ts_ns < wall_ns - keep_ns
                big = bool(keep_bytes) and total > keep_bytes
                if not (old or big):
                    break
            drop_to = seg.end
            total -= seg.size_bytes
        if drop_to > lg.oldest:
            lg.drop_before(drop_to)

    def _collect_snapshots(self) -> dict[Topic, TopicState] | None:
        """Ask every loop for the states of the channels it owns; None if a loop did
        not answer in time (the next checkpoint tries again)."""
        loops = self.runtime.loops
        answers: queue.Queue[list[Snap]] = queue.Queue()
        for lp in loops:
            lp.call_soon_threadsafe(_snapshot_on_loop, lp, self.runtime.broker, answers)
        got: list[Snap] = []
        for _ in loops:
            try:
                got += answers.get(timeout=SNAPSHOT_WAIT_S)
            except queue.Empty:
                return None
        return self._topic_states(got)

    def _topic_states(self, got: list[Snap]) -> dict[Topic, TopicState]:
        """(this thread) The loops' snapshots, completed: their deferred messages
        added and their floors worked out here, not on the loops."""
        by_topic: dict[Topic, TopicState] = {}
        for t in self.runtime.broker.all_topics():
            by_topic[t] = {"topic": t.name, "orphan_start": t.orphan_start,
                           "released": t.released, "channels": {}}
        texts = self._texts
        for t in [t for t in texts if t not in by_topic]:
            del texts[t]
        for t, name, snap, deferred in got:
            st = by_topic.get(t)
            if st is not None and name in t.channels:
                memo = texts.setdefault(t, {}).setdefault(name, PartTexts())
                deferred_states(snap, deferred, memo)
                snap["floor"] = state_floor(snap)
                st["channels"][name] = snap
        for t, st in by_topic.items():
            floors = [s["floor"] for s in st["channels"].values()]
            cursors = [s["cursor"] for s in st["channels"].values()]
            if t.channels and len(st["channels"]) < len(t.channels):
                floors.append(t.log.oldest)   # a channel created meanwhile: keep all
            st["floor"] = min(floors) if floors else max(t.orphan_start, t.log.oldest)
            st["min_cursor"] = min(cursors) if cursors else st["floor"]
            for name in [n for n, ch in t.channels.items() if ch.ephemeral]:
                st["channels"].pop(name, None)
            kept = texts.get(t, {})
            for name in [n for n in kept if n not in st["channels"]]:
                del kept[name]       # (gone, or ephemeral: never written)
        return by_topic

    # -- shutdown -----------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop the storage thread (after the loops stopped)."""
        self._requests.put(_STOP)
        if self._thread.is_alive():
            self._thread.join(10)

    def persist(self) -> None:
        """After the loops stopped: write what is pending, save every channel's state,
        sync every log, save metadata, close the logs."""
        self.stop()
        n = self.save_now()
        for t in self.runtime.broker.all_topics():
            try:
                t.log.sync()        # as nsqd syncs its queues' files at exit
            except Exception as e:
                self.failed(e, t, "exit")
            try:
                t.log.close()
            except Exception as e:
                self.failed(e, t)
        log.info("NSQ: saved the state of %d channels to %s", n, self.state_root)

    def save_now(self) -> int:
        """While no loop runs (start-up, shutdown): write pending records, save every
        channel's state and the metadata, on this thread. Returns the channel count."""
        now, wall = time.monotonic_ns(), time.time_ns()
        got = []
        for t in self.runtime.broker.all_topics():
            try:
                t.write()
            except StorageError as e:
                self.failed(e, t)
            for name, ch in list(t.channels.items()):
                got.append((t, name, *ch.snapshot_parts(wall, now)))
        self.checkpoint(self._topic_states(got))
        self._write_metadata()
        return len(got)


# a topic's state as the storage thread last wrote it: the state, and the chunks of
# deferred messages its channels' ``pending`` go on in (compared by identity: a chunk
# is never changed once a snapshot returned it; core/deferred.py)
SavedState = tuple[TopicState, list[Sequence[Sequence[int]]]]


def _saved_state(snap: TopicState) -> SavedState:
    return snap, [part for ch in snap.get("channels", {}).values()
                  for part in getattr(ch.get("pending"), "parts", ())]


def _same_state(old: SavedState | None, new: SavedState) -> bool:
    """Is new the state old was? (A PartedList compares its own items: the chunks it
    goes on in are compared here, as objects.)"""
    return (old is not None and old[0] == new[0] and len(old[1]) == len(new[1])
            and all(a is b for a, b in zip(old[1], new[1])))


# a channel's snapshot as its loop took it: (topic, channel, state without its deferred
# messages, those; Lifecycle.snapshot_parts)
Snap = tuple[Topic, str, ChannelState, Chunks]


def _snapshot_on_loop(lp: Loop, broker: Broker, answers: "queue.Queue[list[Snap]]") -> None:
    """On loop lp: the states of the channels it owns (their deferred messages as
    chunks shared with the last snapshot while unchanged: the storage thread completes
    them, ``_topic_states``), about SNAPSHOT_STEP channels a turn (``run_steps``)."""
    out: list[Snap] = []
    lp.run_steps(_snapshot_steps(lp, broker.all_topics(), out), lambda _: answers.put(out))


def _snapshot_steps(lp: Loop, topics: list[Topic], out: list[Snap]
                    ) -> Generator[None, None, None]:
    """``_snapshot_on_loop``'s steps: 10,000 channels in one turn held the loop 48 ms at
    every checkpoint. Each channel's state is its own (a checkpoint's states need not
    be of one turn: a floor taken earlier is only lower), and one deleted meanwhile is
    dropped by ``_topic_states``."""
    at = 0
    while True:
        now, wall = time.monotonic_ns(), time.time_ns()
        done = 0
        while at < len(topics) and done < SNAPSHOT_STEP:
            t = topics[at]
            at += 1
            for name, ch in list(t.channels.items()):
                if ch.owner is lp:
                    out.append((t, name, *ch.snapshot_parts(wall, now)))
                    done += 1
        if at >= len(topics):
            return
        yield
