"""Topic: ids, fan-out of every message to every channel, and the buffer used while a
topic has no channel or is paused.

Thread-safety: any thread may publish; ``lock`` guards the channel map, the buffer and
the counters. ``publish`` returns deliveries ``[(channel, messages)]`` that the caller
routes to each channel's owner loop; the topic never touches a channel's memory queue.

Storage: the buffer keeps up to mem_queue_size messages in memory and the rest in the
topic's backend (nsqd's topic disk queue). In durable mode every message gets a record
before the publish is answered: in each channel's backend when the topic has channels,
else in the topic's; ``publish`` then also returns the backends the caller must sync.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any, Callable

from pybroker.core.channel import Backend, Channel
from pybroker.core.ids import IdGenerator
from pybroker.core.message import Message, from_record, to_record
from pybroker.protocol.names import is_ephemeral

log = logging.getLogger("pybroker")
Deliveries = list[tuple[Channel, list[Message]]]
BackendFactory = Callable[[str, bool], "Backend | None"]  # (queue name, ephemeral)


class Topic:
    def __init__(self, name: str, node_id: int, now_ts_ns: int, mem_queue_size: int,
                 pick_owner: Callable[[str, str], Any],
                 open_backend: BackendFactory | None = None, durable: bool = False) -> None:
        self.name = name
        self.ephemeral = is_ephemeral(name)
        self.mem_queue_size = mem_queue_size
        self.lock = threading.Lock()
        self.channels: dict[str, Channel] = {}
        self.buffer: deque[Message] = deque()
        self.paused = False
        self.deleted = False
        self.message_count = 0
        self.message_bytes = 0
        self._ids = IdGenerator(node_id, now_ts_ns)
        self._pick_owner = pick_owner
        # a release of the buffer to the channels failed (disk): retried on next publish
        self.release_pending = False
        self.release_error: Exception | None = None
        self._open_backend = open_backend
        self.durable = durable and open_backend is not None
        self.backend: Backend | None = open_backend(name, self.ephemeral) if open_backend else None

    def __repr__(self) -> str:
        return f"Topic({self.name})"

    # -- publishing (any thread) ----------------------------------------------------
    def publish(self, bodies: list[bytes], ts_ns: int, defer_ns: int = 0
                ) -> tuple[Deliveries, list[Backend]]:
        """Make messages for bodies; return where they go and the backends to sync."""
        with self.lock:
            ids = self._ids.next_ids(len(bodies))
            msgs = [Message(i, b, ts_ns, 0, defer_ns) for i, b in zip(ids, bodies)]
            self.message_count += len(msgs)
            self.message_bytes += sum(map(len, bodies))
            if self.release_pending and not self.paused and self.channels:
                earlier, _ = self._release_buffer()
                if not self.release_pending:
                    out, synced = self._fan_out(msgs)
                    return earlier + out, synced
            if self.paused or not self.channels or self.release_pending:
                return [], self._buffer(msgs)
            return self._fan_out(msgs)

    def _buffer(self, msgs: list[Message]) -> list[Backend]:
        # caller holds self.lock
        backend = self.backend
        buf = self.buffer
        room = self.mem_queue_size - len(buf)
        if backend is None:
            buf.extend(msgs)
            if len(buf) > self.mem_queue_size:
                # matches nsqd: ephemeral overflow is discarded
                for _ in range(len(buf) - self.mem_queue_size):
                    buf.pop()
            return []
        if room > 0 and backend.depth():
            room = 0  # keep order: older messages wait on disk
        keep, rest = msgs[:max(room, 0)], msgs[max(room, 0):]
        if keep and self.durable:
            first = backend.put_many([to_record(m) for m in keep], claim=True)
            for i, m in enumerate(keep):
                m.seq = first + i
        buf.extend(keep)
        if rest:
            backend.put_many([to_record(m) for m in rest])
        return [backend] if self.durable else []

    def _fan_out(self, msgs: list[Message]) -> tuple[Deliveries, list[Backend]]:
        # caller holds self.lock. The first channel takes the originals, the others copies.
        chans = list(self.channels.values())
        out: Deliveries = []
        synced: list[Backend] = []
        for i, ch in enumerate(chans):
            copies = msgs if i == 0 else [m.copy() for m in msgs]
            if self.durable and ch.backend is not None:
                copies = ch.write_durable(copies)
                synced.append(ch.backend)
            if copies:
                out.append((ch, copies))
        return out, synced

    def _release_buffer(self) -> tuple[Deliveries, list[Backend]]:
        """Hand the buffer (memory, then disk) to the channels. Caller holds self.lock.

        If the channels' copies cannot be written (durable mode, failing disk), the
        buffer is left as it was, ``release_error`` says why, and the next publish or
        new channel tries again (the topic keeps buffering meanwhile, so order holds).
        """
        if self.paused or not self.channels:
            return [], []
        backend = self.backend
        msgs = list(self.buffer)
        self.buffer.clear()
        if backend is not None:
            while True:
                recs = backend.read_many(10_000)
                if not recs:
                    break
                for seq, rec in recs:
                    try:
                        m, deliver_at = from_record(rec)
                    except ValueError:
                        log.error("%r: dropping a malformed record %d", self, seq)
                        backend.ack(seq)
                        continue
                    if deliver_at:  # a DPUB waiting in the topic: its delay starts again
                        m.defer_ns = max(0, deliver_at - m.ts_ns)
                    m.seq = seq
                    msgs.append(m)
        if not msgs:
            self.release_pending = False
            return [], []
        topic_seqs = [m.seq for m in msgs]
        for m in msgs:
            m.seq = None  # the channels give them records of their own
        try:
            out, synced = self._fan_out(msgs)
            for b in synced:
                b.sync()  # the channels' copies are durable before the topic's go
        except Exception as e:
            for m, tseq in zip(msgs, topic_seqs):
                m.seq = tseq
            self.buffer.extendleft(reversed(msgs))
            self.release_pending = True
            self.release_error = e
            return [], []
        self.release_pending = False
        if backend is not None:
            backend.ack_many([q for q in topic_seqs if q is not None])
        return out, []

    # -- channels (any thread) ------------------------------------------------------
    def get_channel(self, name: str) -> tuple[Channel, bool, Deliveries]:
        """Find or create a channel -> (channel, created, deliveries); a topic's first
        channel receives its buffer."""
        with self.lock:
            ch = self.channels.get(name)
            if ch is not None:
                # a release that failed earlier is retried by the next subscriber
                return ch, False, self._release_buffer()[0] if self.release_pending else []
            ch = self.new_channel(name)
            return ch, True, self._release_buffer()[0]

    def new_channel(self, name: str) -> Channel:
        """Create and add a channel without releasing the buffer (caller holds lock)."""
        ephemeral = is_ephemeral(name)
        backend = None
        if self._open_backend is not None:
            backend = self._open_backend(f"{self.name}:{name}", ephemeral or self.ephemeral)
        ch = Channel(self.name, name, self._pick_owner(self.name, name), self.mem_queue_size,
                     ephemeral, backend, self.durable)
        self.channels[name] = ch
        return ch

    def find_channel(self, name: str) -> Channel | None:
        return self.channels.get(name)

    def remove_channel(self, name: str) -> Channel | None:
        with self.lock:
            ch = self.channels.pop(name, None)
        if ch is not None:
            ch.deleted = True
        return ch

    def set_paused(self, paused: bool) -> Deliveries:
        with self.lock:
            self.paused = paused
            return self._release_buffer()[0]

    def release(self) -> Deliveries:
        """Start-up: hand a restored backlog to the restored channels."""
        with self.lock:
            return self._release_buffer()[0]

    def empty(self) -> None:
        with self.lock:
            self.buffer.clear()
            if self.backend is not None:
                self.backend.empty()

    def depth(self) -> int:
        b = self.backend
        return len(self.buffer) + (b.depth() if b is not None else 0)

    def backend_depth(self) -> int:
        b = self.backend
        return b.depth() if b is not None else 0

    def persist_buffer(self) -> int:
        """Shutdown: write the memory buffer to the backend (nsqd flushes it too)."""
        backend = self.backend
        if backend is None:
            return 0
        with self.lock:
            msgs = list(self.buffer)
            self.buffer.clear()
        fresh = [m for m in msgs if m.seq is None]
        if fresh:
            backend.put_many([to_record(m) for m in fresh])
        backend.checkpoint()
        return len(fresh)
