"""Publisher: the one way messages enter a topic, one per event loop (docs/storage.md,
"Publishing" and "When a write fails"; docs/ownership.md).

Theory of operation
-------------------
Every topic has one owner loop (``Broker.topic_owner``: its name hashed over the
loops; with one loop, that loop). Only the owner's Publisher appends to the topic's log
and writes it. Every way in goes through it: TCP PUB, MPUB (a big one in slices) and
DPUB (``publish_conn``); HTTP /pub and /mpub, whose handler posts a job to the owner
loop (``submit``); dead letters, from the loop that owns the dead-lettering channel
(``submit``); and, before any loop runs, imported queues (``publish_now``).

Hand-offs: a publish for a topic another loop owns goes into this loop's outbox; at the
end of the turn one ``call_soon_threadsafe`` per target loop carries all of that turn's
publishes (bodies by reference, never copied) to the owner (``take``). Settlements go
back the same way: one call per origin loop per turn (``replied``), and the origin
answers. A TCP connection whose publish was handed over (or is appended in slices, or
waits for an fsync) reads no further command until it is answered, so the replies on a
connection stay in the order of its commands.

Write epochs: an append is stamped with the epoch of the write that will carry it
(``topic.log.epoch``); the publishes of one topic in one turn form a *batch* with that
epoch. At the end of the turn the topic is written once (group commit); the write
returns the epoch it carried, or fails naming it, and settles the batch whose epoch it
is. In memory mode a written batch is answered OK. In fsync mode it waits for the
storage thread, which fsyncs each topic once per pass and posts back; the log then says
of each waiting batch's epoch whether it is durable (``durable_epoch``) or was lost by a
failed fsync (``lost_by``: every epoch written and not yet durable when an fsync failed,
whoever asked for that fsync). So a failed write or fsync fails exactly the publishes
whose records it carried, whichever connection, HTTP request or channel they came from,
and nothing else; nothing decides an OK but comparing a batch's epoch with the epochs a
write or fsync covered.
"""
from __future__ import annotations

import functools
import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pybroker.errors import ClientError, Exiting, MpubFailed, PubFailed
from pybroker.protocol.encoder import encode_error, ok_frames
from pybroker.server.ports import Done, Parts, Payload, owner_loop
from pybroker.storage import StorageError, StorageIOError

if TYPE_CHECKING:
    from pybroker.core.topic import Topic
    from pybroker.server.ports import ClusterHooks, Conn, Loop

log = logging.getLogger("pybroker")
# messages of a big MPUB appended per loop turn (a few milliseconds of work)
SLICE = 20_000
LANE_MPUB = 1 << 31   # the lane's flag on a connection's message count: first verb MPUB
Request = tuple[str, Payload, int, Done]             # (topic, payload, defer_ns, done)
# (ts_ns, attempts, body, deliver_at_ns): a record that keeps its own fields (imports)
Record = tuple[int, int, bytes, int]


class _Batch:
    """The publishes of one topic in one turn: all carried by the write of ``epoch``."""

    __slots__ = ("epoch", "slots", "direct", "calls", "remote", "end")

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        self.end = 0          # once written: one past the last offset it carried
        # memory mode, connections of this loop: their OK already in conn.out at index i,
        # not flushed before the write (conn.unconfirmed); an error replaces it
        self.slots: list[tuple[Conn, int, type[ClientError], str]] = []
        # memory mode, the publish lane's connections with nothing else to send:
        # (connection, commands, messages | LANE_MPUB); once written their OKs go to
        # the loop's batched writes of this turn (Loop.answer_direct), no frame queued
        # before (a failed write queues their errors as the slots' are)
        self.direct: list[tuple[Conn, int, int]] = []
        self.calls: list[Done] = []                       # settled on this loop
        self.remote: list[tuple[Loop, Done]] = []    # settled on their origin loop


class _SliceJob:
    """A big MPUB appended SLICE messages per turn; settled when every slice is."""

    __slots__ = ("name", "parts", "done", "origin", "ts_ns", "next", "open", "error")

    def __init__(self, name: str, parts: Parts, done: Done,
                 origin: Loop | None) -> None:
        self.name = name
        self.parts = parts
        self.done = done
        self.origin = origin
        self.ts_ns = time.time_ns()
        self.next = 0          # the first part not yet appended
        self.open = 0          # slices appended, not yet settled
        self.error: Exception | None = None

    @property
    def appended(self) -> bool:
        return self.next >= len(self.parts[2])


def answer(conn: Conn, failed: type[ClientError], verb: str,
           err: Exception | None) -> None:
    """Answer a TCP publish that made its connection wait (on the connection's loop)."""
    answer_many(conn, failed, verb, 1, err)


def answer_many(conn: Conn, failed: type[ClientError], verb: str, count: int,
                err: Exception | None) -> None:
    """Answer ``count`` publishes of one connection that waited on one write (the lane
    reads several in a turn: server/lane.py): an OK each, or the error (which closes
    the connection)."""
    conn.awaiting_commit -= 1
    if conn.closed:
        return
    if err is None:
        conn.send_frame(ok_frames(count))
    else:
        conn.fail(failed(f"{verb} failed {err}"))
    if not conn.awaiting_commit:
        conn.process()


def _failure_of(msgs: int) -> tuple[type[ClientError], str]:
    """The error and verb of a failed lane publish (``msgs`` as the lane counts them)."""
    return (MpubFailed, "MPUB") if msgs & LANE_MPUB else (PubFailed, "PUB")


def _unwaited(topics: list[Topic]) -> None:
    """The end of a sync_every fsync (on the storage thread): no publish waits for it."""


class Publisher:
    """The publish policy of one event loop (its thread only; see the module)."""

    def __init__(self, loop: Loop) -> None:
        self.loop = loop
        self.durable = loop.options.durability == "fsync"
        # memory durability: an fsync (not waited for) every sync_every records per topic,
        # besides the storage thread's every sync_timeout (nsqd's --sync-every)
        self.sync_every = loop.options.sync_every
        self._unsynced: dict[Topic, int] = {}
        self._turn: dict[Topic, _Batch] = {}            # appended this turn
        self._syncing: dict[Topic, deque[_Batch]] = {}  # fsync mode: written, not synced
        self._outbox: dict[Loop, list[Request]] = {}
        self._replies: dict[Loop, list[tuple[Done, Exception | None]]] = {}
        self._slices: deque[_SliceJob] = deque()
        # clustering (pybroker.cluster; None on a single node): publishes to a topic
        # another node leads are forwarded there, and a write's batch is answered once
        # the in-sync replicas hold it
        self.cluster: ClusterHooks | None = None

    def busy(self) -> bool:
        return bool(self._turn or self._slices or self._outbox or self._replies)

    # -- the ways in ----------------------------------------------------------------------
    def publish_conn(self, conn: Conn, name: str, payload: Payload, defer_ns: int,
                     failed: type[ClientError], verb: str) -> None:
        """A TCP PUB, DPUB or MPUB of conn (a connection of this loop). Raises ``failed``
        when the topic cannot take it now (the broker is exiting)."""
        loop = self.loop
        try:
            topic = loop.runtime.broker.get_topic(name)
        except Exiting as e:
            raise failed(f"{verb} failed {e}") from None
        cl = self.cluster
        if cl is not None:
            if cl.diverts(name):
                conn.awaiting_commit += 1
                cl.divert(loop, name, payload, defer_ns,
                          functools.partial(answer, conn, failed, verb))
                return
            why = cl.refusal(name)
            if why is not None:
                raise failed(f"{verb} failed {why}")
        owner = topic.owner
        whole = isinstance(payload, list)
        if owner is loop and (whole or len(payload[2]) <= SLICE):
            # the common case, inline (it runs per message in the PUB flows)
            try:
                if isinstance(payload, list):
                    topic.publish(payload, time.time_ns(), defer_ns)
                else:
                    topic.publish_parts(payload[0], payload[1], payload[2], time.time_ns())
                batch = self._batch_of(topic)
            except Exiting:
                try:      # deleted meanwhile: the next topic of that name takes it
                    batch = self._append(name, payload, defer_ns)
                except Exiting as e:
                    raise failed(f"{verb} failed {e}") from None
            if self.durable:
                conn.awaiting_commit += 1
                batch.calls.append(functools.partial(answer, conn, failed, verb))
            else:
                conn.send_ok()
                batch.slots.append((conn, len(conn.out) - 1, failed, verb))
                conn.unconfirmed += 1
            return
        conn.awaiting_commit += 1
        done = functools.partial(answer, conn, failed, verb)
        if owner is loop:
            assert isinstance(payload, tuple)
            self._slices.append(_SliceJob(name, payload, done, None))
        else:
            self._outbox.setdefault(owner_loop(owner), []).append((name, payload, defer_ns, done))

    def lane_publish(self, topic: Topic, src: bytearray, offs: Sequence[int],
                     lens: Sequence[int], ts_ns: int,
                     conns: list[tuple[Conn, int, int]]) -> bool:
        """The lane's messages for one topic this loop owns (server/lane.py): appended
        with one record build, and each connection's commands answered with this turn's
        batch. conns: (connection, commands, messages | LANE_MPUB when its first
        command is an MPUB). False: the topic is being deleted (nothing appended)."""
        try:
            topic.publish_parts(src, offs, lens, ts_ns)
        except Exiting:
            return False
        batch = self._batch_of(topic)
        name = topic.name
        durable = self.durable
        to_flush = self.loop.to_flush
        # answered at this turn's write, with nothing queued before or after it: the
        # OKs go straight to the turn's batched writes (not for a replicated topic,
        # answered once its replicas hold it, maybe turns later)
        direct = None if durable or self.cluster is not None else batch.direct
        for conn, cmds, msgs in conns:
            counts = conn.pub_counts
            counts[name] = counts.get(name, 0) + (msgs & ~LANE_MPUB)
            if direct is not None and not (conn.out or conn.pending or conn.unconfirmed):
                direct.append((conn, cmds, msgs))
                continue
            failed, verb = _failure_of(msgs)
            if durable:
                conn.awaiting_commit += 1
                batch.calls.append(functools.partial(answer_many, conn, failed, verb, cmds))
            else:
                frame = ok_frames(cmds)
                conn.out.append(frame)
                conn.out_bytes += len(frame)
                to_flush[conn] = None
                batch.slots.append((conn, len(conn.out) - 1, failed, verb))
                conn.unconfirmed += 1
        return True

    def submit(self, name: str, payload: Payload, defer_ns: int, done: Done) -> None:
        """Publish to topic ``name`` from this loop's thread; ``done(None or error)``
        runs on this loop once the publish is settled (Exiting: the broker is exiting)."""
        cl = self.cluster
        if cl is not None:
            if cl.diverts(name):
                cl.divert(self.loop, name, payload, defer_ns, done)
                return
            why = cl.refusal(name)
            if why is not None:
                done(RuntimeError(why))
                return
        owner = self.loop.runtime.broker.topic_owner(name)
        if owner is not self.loop:
            self._outbox.setdefault(owner_loop(owner), []).append((name, payload, defer_ns, done))
        else:
            self._take_one(name, payload, defer_ns, done, None)

    def take(self, origin: Loop, requests: list[Request]) -> None:
        """Publishes handed over by loop ``origin`` (posted there at the end of a turn)."""
        for name, payload, defer_ns, done in requests:
            self._take_one(name, payload, defer_ns, done, origin)

    def replied(self, items: list[tuple[Done, Exception | None]]) -> None:
        """Settlements of publishes this loop handed over (posted by their owner)."""
        for done, err in items:
            try:
                done(err)
            except Exception:
                log.exception("%s: answering a publish failed", self.loop.name)

    def _take_one(self, name: str, payload: Payload, defer_ns: int, done: Done,
                  origin: Loop | None) -> None:
        cl = self.cluster
        if cl is not None:     # the topic's role may have changed since the publish came
            why = f"not the leader of {name}" if cl.diverts(name) else cl.refusal(name)
            if why is not None:
                self._settle_one(done, origin, RuntimeError(why))
                return
        if isinstance(payload, tuple) and len(payload[2]) > SLICE:
            self._slices.append(_SliceJob(name, payload, done, origin))
            return
        try:
            batch = self._append(name, payload, defer_ns)
        except Exiting as e:
            self._settle_one(done, origin, e)
            return
        except Exception as e:     # a bug: this publish fails, the others go on
            log.exception("%s: publishing to %s failed", self.loop.name, name)
            self._settle_one(done, origin, e)
            return
        if origin is None:
            batch.calls.append(done)
        else:
            batch.remote.append((origin, done))

    def _append(self, name: str, payload: Payload, defer_ns: int,
                topic: Topic | None = None, ts_ns: int = 0) -> _Batch:
        """Append to the topic (this loop owns it) and return the batch of this turn,
        stamped with the epoch of the write that will carry the records. A topic
        deleted meanwhile is looked up again (nsqd's next GetTopic); raises Exiting
        when the broker exits."""
        broker = self.loop.runtime.broker
        for _ in range(3):
            try:
                if topic is None:
                    topic = broker.get_topic(name)
                ts = ts_ns or time.time_ns()
                if isinstance(payload, tuple):
                    topic.publish_parts(payload[0], payload[1], payload[2], ts)
                else:
                    topic.publish(payload, ts, defer_ns)
                break
            except Exiting:
                if broker.exiting:
                    raise
                topic = None
        else:
            raise Exiting()
        assert topic.owner is self.loop, f"{topic} appended to by {self.loop.name}"
        return self._batch_of(topic)

    def _batch_of(self, topic: Topic) -> _Batch:
        """This turn's batch of a topic just appended to: the records carried by the
        write of the log's current epoch."""
        epoch = topic.log.epoch
        batch = self._turn.get(topic)
        if batch is None:
            batch = self._turn[topic] = _Batch(epoch)
        assert batch.epoch == epoch, f"{topic} was written outside its Publisher"
        return batch

    # -- the end of the turn: slices, writes, hand-offs ------------------------------------
    def end_of_turn(self) -> None:
        if self._slices:
            self._run_slice()
        if self._turn:
            self._write_all()
        if self._outbox:
            outbox, self._outbox = self._outbox, {}
            for owner, requests in outbox.items():
                owner.call_soon_threadsafe(owner.publisher.take, self.loop, requests)
        if self._replies:
            replies, self._replies = self._replies, {}
            for origin, items in replies.items():
                origin.call_soon_threadsafe(origin.publisher.replied, items)

    def _run_slice(self) -> None:
        job = self._slices[0]
        cl = self.cluster
        if cl is not None and job.error is None:      # the role may have changed
            why = f"not the leader of {job.name}" if cl.diverts(job.name) \
                else cl.refusal(job.name)
            if why is not None:
                job.error = RuntimeError(why)
        if job.error is None:
            body, offs, lens = job.parts
            i, j = job.next, min(job.next + SLICE, len(job.parts[2]))
            try:
                batch = self._append(job.name, (body, offs[i:j], lens[i:j]), 0,
                                     ts_ns=job.ts_ns)
            except Exception as e:     # Exiting, or a bug: the MPUB fails
                if not isinstance(e, Exiting):
                    log.exception("%s: publishing to %s failed", self.loop.name, job.name)
                job.error = e
            else:
                job.next = j
                job.open += 1
                batch.calls.append(functools.partial(self._slice_settled, job))
        if job.appended or job.error is not None:
            self._slices.popleft()
            if not job.open:
                self._settle_one(job.done, job.origin, job.error)

    def _slice_settled(self, job: _SliceJob, err: Exception | None) -> None:
        job.open -= 1
        if err is not None and job.error is None:
            job.error = err       # no further slice is appended
        if not job.open and (job.appended or job.error is not None):
            if job in self._slices:
                self._slices.remove(job)
            self._settle_one(job.done, job.origin, job.error)

    def _write_all(self) -> None:
        """One write per topic appended to this turn; settle (memory) or wait for the
        storage thread's fsync (fsync mode)."""
        turn, self._turn = self._turn, {}
        rt = self.loop.runtime
        to_sync: list[Topic] = []
        sync_every: list[Topic] = []
        for topic, batch in turn.items():
            try:
                epoch, n, chans = topic.write()
            except StorageError as e:
                rt.storage_failed(e, topic)
                if e.epoch != batch.epoch:
                    log.error("%s: write %d failed, %d was expected", topic, e.epoch,
                              batch.epoch)
                self._settle(batch, e)
                continue
            except Exception as e:   # a bug: fail these publishes, keep the loop alive
                log.exception("%s: writing %r failed", self.loop.name, topic)
                self._settle(batch, e)
                continue
            if epoch != batch.epoch:
                # the records of this batch were not the ones this write carried
                err = StorageIOError(f"{topic}: write {batch.epoch} was not carried "
                                     f"(the write carried {epoch})")
                log.error("NSQ: storage: %s", err)
                self._settle(batch, err)
                continue
            batch.end = topic.log.written
            if chans:
                self.loop.wake(chans)
            if n and rt.health is not None:
                rt.storage.write_ok(topic)      # a write of real records worked
            if not n:
                self._settle(batch, None)
            elif not self.durable or topic.log.durable_epoch >= epoch:
                self._written(topic, batch)
                if not self.durable:
                    count = self._unsynced.get(topic, 0) + n
                    if count >= self.sync_every:
                        count = 0
                        sync_every.append(topic)
                    self._unsynced[topic] = count
            else:
                self._syncing.setdefault(topic, deque()).append(batch)
                to_sync.append(topic)
        if to_sync:
            rt.storage.sync_topics(to_sync, self._post_synced)
        if sync_every:
            for topic in [t for t in self._unsynced if t.deleted]:
                del self._unsynced[topic]
            rt.storage.sync_topics(sync_every, _unwaited)

    def _post_synced(self, topics: list[Topic]) -> None:
        # on the storage thread
        self.loop.call_soon_threadsafe(self.synced, topics)

    def synced(self, topics: list[Topic]) -> None:
        """The storage thread fsynced these topics (or tried): settle every waiting
        batch whose epoch the log now says is durable, or lost by a failed fsync."""
        for topic in topics:
            waiting = self._syncing.get(topic)
            if not waiting:
                continue
            log = topic.log
            while waiting:
                epoch = waiting[0].epoch
                if topic.deleted:
                    # published before the delete: answered, then gone with the topic
                    # (nsqd); its files were moved aside, so their fsync may have failed
                    self._settle(waiting.popleft(), None)
                    continue
                err = log.lost_by(epoch)
                if err is None and epoch > log.durable_epoch:
                    break                       # a later fsync will cover it
                if err is None:
                    self._written(topic, waiting.popleft())
                else:
                    self._settle(waiting.popleft(), err)
            if not waiting:
                del self._syncing[topic]

    # -- settling -----------------------------------------------------------------------
    def _written(self, topic: Topic, batch: _Batch) -> None:
        """The batch is written (synced, in fsync mode) here: answer it, or, for a
        replicated topic, once the in-sync replicas hold it too."""
        cl = self.cluster
        if cl is None or not cl.await_replicas(topic, batch.end,
                                               functools.partial(self._settle, batch)):
            self._settle(batch, None)

    def _settle(self, batch: _Batch, err: Exception | None) -> None:
        to_flush = self.loop.to_flush
        if batch.direct:
            if err is None:
                self.loop.answer_direct(batch.direct)
            else:
                for conn, _, msgs in batch.direct:
                    if not conn.closed:
                        failed, verb = _failure_of(msgs)
                        conn.fail(failed(f"{verb} failed {err}"))
        for conn, idx, failed, verb in batch.slots:
            conn.unconfirmed -= 1
            # its OK was queued in an earlier turn than this write when the command ran
            # after the end-of-turn writes (a connection resumed by an answer)
            to_flush[conn] = None
            if err is not None and not conn.closed:
                e = failed(f"{verb} failed {err}")
                conn.out[idx] = encode_error(e.payload())
                log.error("[%s] - %s", conn, e.payload().decode("utf-8", "replace"))
                conn.close_after_flush()
        for done in batch.calls:
            try:
                done(err)
            except Exception:
                log.exception("%s: settling a publish failed", self.loop.name)
        for origin, done in batch.remote:
            self._settle_one(done, origin, err)

    def _settle_one(self, done: Done, origin: Loop | None,
                    err: Exception | None) -> None:
        if origin is None:
            try:
                done(err)
            except Exception:
                log.exception("%s: settling a publish failed", self.loop.name)
        else:
            self._replies.setdefault(origin, []).append((done, err))


def publish_now(topic: Topic, records: list[Record]) -> int:
    """Start-up, before any loop runs (this thread owns every topic then): append
    records that keep their own fields and write them at once; returns the first
    offset. Raises StorageError when the write fails (its records are discarded)."""
    first = topic.publish_records(records)
    topic.write()
    return first


__all__ = ["LANE_MPUB", "SLICE", "Publisher", "answer", "answer_many", "publish_now"]
