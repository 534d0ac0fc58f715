"""Channel: a topic's queue for one group of consumers, with in-flight and deferred state.

Ownership: a channel is owned by one event loop (``owner``, chosen by hashing its name);
only that loop's thread calls put/dispatch/finish/requeue/touch and changes consumers.
The queue-scanner threads call ``expire`` only. ``lock`` guards the in-flight and deferred
maps and wheels, which both sides touch; it is taken inside these methods only and never
held while calling out to another object.
"""
from __future__ import annotations

import logging
import random
import threading
from collections import deque
from typing import TYPE_CHECKING, Any, Iterable, Protocol

from pybroker.core.message import Message, from_record, to_record
from pybroker.core.timeouts import TimeoutWheel
from pybroker.errors import BrokerError, NotInFlight, NotOwner, TooManyConsumers

if TYPE_CHECKING:
    from pybroker.core.stats import LatencyWindow


log = logging.getLogger("pybroker")


class Backend(Protocol):
    """The queue store seam (pybroker.storage.DiskQueue implements it)."""

    def put(self, record: bytes, *, claim: bool = False) -> int: ...
    def put_many(self, records: Iterable[bytes], *, claim: bool = False) -> int: ...
    def read_many(self, max_n: int, *, auto_ack: bool = False) -> list[tuple[int, bytes]]: ...
    def ack(self, seq: int) -> bool: ...
    def ack_many(self, seqs: Iterable[int]) -> int: ...
    def sync(self, seq: int | None = None) -> int: ...
    def checkpoint(self, now_ns: int | None = None) -> None: ...
    def depth(self) -> int: ...
    def empty(self) -> None: ...
    def delete(self) -> None: ...


class Consumer(Protocol):
    """What a channel needs from a subscribed client (implemented by the server)."""

    msg_timeout_ns: int
    sample_rate: int
    in_flight_count: int

    def ready_room(self) -> int:
        """How many more messages the client may take now (RDY minus in flight)."""

    def send_messages(self, msgs: list[Message]) -> None:
        """Queue message frames for this client (they are already in flight)."""


class Channel:
    """One channel of a topic. See the module docstring for who may call what."""

    def __init__(self, topic_name: str, name: str, owner: Any, mem_queue_size: int,
                 ephemeral: bool, backend: Backend | None = None, durable: bool = False) -> None:
        self.topic_name = topic_name
        self.name = name
        self.owner = owner
        self.ephemeral = ephemeral
        self.mem_queue_size = mem_queue_size
        # where messages beyond mem_queue_size go (None: ephemeral, memory only); in
        # durable mode every message also has a record there until it is FIN'd
        self.backend = backend
        self.durable = durable
        self.lock = threading.Lock()
        self.queue: deque[Message] = deque()
        self.in_flight: dict[bytes, Message] = {}
        self.in_flight_wheel: TimeoutWheel[Message] = TimeoutWheel()
        self.deferred: dict[bytes, Message] = {}
        self.deferred_wheel: TimeoutWheel[Message] = TimeoutWheel()
        self.consumers: list[Consumer] = []
        self._rr = 0
        self.paused = False
        self.deleted = False
        self.message_count = 0
        self.requeue_count = 0
        self.timeout_count = 0
        # end-to-end latency window, created on the first FIN when e2e percentiles are set
        self.e2e: LatencyWindow | None = None

    def __repr__(self) -> str:
        return f"Channel({self.topic_name}/{self.name})"

    # -- consumers (owner thread) ---------------------------------------------------
    def add_consumer(self, c: Consumer, max_consumers: int) -> None:
        if max_consumers and len(self.consumers) >= max_consumers:
            raise TooManyConsumers(f"consumers for {self.topic_name}:{self.name} "
                                   f"exceeds limit of {max_consumers}")
        self.consumers.append(c)

    def remove_consumer(self, c: Consumer) -> int:
        """Detach c and requeue its in-flight messages at once; returns how many.

        Goes beyond nsqd, which leaves them until their timeout (nsq #137).
        """
        try:
            self.consumers.remove(c)
        except ValueError:
            return 0
        with self.lock:
            mine = [m for m in self.in_flight.values() if m.client is c]
            for m in mine:
                del self.in_flight[m.id]
                if m.entry is not None:
                    self.in_flight_wheel.remove(m.entry)
                m.entry = None
                m.client = None
        if mine:
            mine.sort(key=lambda m: m.delivery_ns)
            self.queue.extendleft(reversed(mine))
            self.requeue_count += len(mine)
        return len(mine)

    # -- messages in (owner thread) -------------------------------------------------
    def put(self, msgs: Iterable[Message], now_ns: int, count: bool = True) -> None:
        """Accept messages (owner thread): deferred ones go to the deferred wheel, the
        rest to memory while it has room and nothing older waits on disk, else to disk."""
        q = self.queue
        backend = self.backend
        room = self.mem_queue_size - len(q)
        if backend is not None and room > 0 and backend.depth():
            room = 0  # keep order: older messages wait on disk
        spill: list[Message] = []
        n = 0
        for m in msgs:
            n += 1
            if m.defer_ns:
                self._defer(m, now_ns + m.defer_ns)
                m.defer_ns = 0
            elif room > 0 or backend is None or m.seq is not None:
                # (a message with a seq already has its claimed record: durable mode)
                q.append(m)
                room -= 1
            else:
                spill.append(m)
        if count:
            self.message_count += n
        if spill:
            # matches nsqd: memory first, the overflow to the disk queue
            try:
                backend.put_many([to_record(m) for m in spill])  # type: ignore[union-attr]
            except Exception:
                # the publisher already has its OK: never drop them; hold them in
                # memory and let the caller report the storage failure
                q.extend(spill)
                raise
        if self.ephemeral and len(q) > self.mem_queue_size:
            # matches nsqd: an ephemeral channel discards what overflows its memory queue
            for _ in range(len(q) - self.mem_queue_size):
                q.pop()

    def write_durable(self, msgs: list[Message]) -> list[Message]:
        """Durable mode, any thread: give every message a record in this channel's
        backend; return those that should also be held in memory (their records are
        claimed); the others wait on disk until the owner reads them."""
        backend = self.backend
        if backend is None:
            return msgs
        room = self.mem_queue_size - len(self.queue)
        if room > 0 and backend.depth():
            room = 0
        keep, rest = msgs[:max(room, 0)], msgs[max(room, 0):]
        if keep:
            first = backend.put_many([to_record(m) for m in keep], claim=True)
            for i, m in enumerate(keep):
                m.seq = first + i
        if rest:
            backend.put_many([to_record(m) for m in rest])
            self.message_count += len(rest)
        return keep

    def refill(self, now_ns: int, wall_ns: int) -> int:
        """Owner thread: read messages back from disk while memory has room."""
        backend = self.backend
        if backend is None:
            return 0
        # with mem_queue_size 0 (every message on disk, as nsqd allows) still read one
        room = max(self.mem_queue_size, 1) - len(self.queue)
        if room <= 0 or not backend.depth():
            return 0
        got = 0
        for seq, rec in backend.read_many(min(room, 10_000)):
            try:
                m, deliver_at = from_record(rec)
            except ValueError:
                log.error("%r: dropping a malformed record %d", self, seq)
                backend.ack(seq)
                continue
            m.seq = seq
            if deliver_at > wall_ns:
                self._defer(m, now_ns + (deliver_at - wall_ns))
            else:
                self.queue.append(m)
            got += 1
        return got

    def depth(self) -> int:
        """Queued messages, in memory and on disk (not in flight or deferred)."""
        b = self.backend
        return len(self.queue) + (b.depth() if b is not None else 0)

    def backend_depth(self) -> int:
        b = self.backend
        return b.depth() if b is not None else 0

    def _defer(self, m: Message, deadline_ns: int) -> None:
        with self.lock:
            m.entry = self.deferred_wheel.add(deadline_ns, m)
            self.deferred[m.id] = m

    # -- delivery (owner thread) ----------------------------------------------------
    def dispatch(self, now_ns: int, wall_ns: int = 0) -> bool:
        """Hand queued messages to ready consumers, round-robin; True if any were sent."""
        q = self.queue
        consumers = self.consumers
        if self.paused or not consumers:
            return False
        n = len(consumers)
        idle = 0
        i = self._rr
        sent = False
        while idle < n:
            if not q and (self.backend is None or not self.refill(now_ns, wall_ns)):
                break  # memory and disk are both empty
            c = consumers[i % n]
            i += 1
            room = c.ready_room()
            if room <= 0:
                idle += 1
                continue
            idle = 0
            take = min(room, len(q))
            msgs = [q.popleft() for _ in range(take)]
            if c.sample_rate:
                # matches nsqd: a message sampled out for this client is dropped
                rate = c.sample_rate
                msgs = [m for m in msgs if random.randrange(100) <= rate]
                if not msgs:
                    continue
            deadline = now_ns + c.msg_timeout_ns
            with self.lock:
                add = self.in_flight_wheel.add
                in_flight = self.in_flight
                for m in msgs:
                    m.attempts += 1
                    m.client = c
                    m.delivery_ns = now_ns
                    m.entry = add(deadline, m)
                    in_flight[m.id] = m
            c.in_flight_count += len(msgs)
            c.send_messages(msgs)
            sent = True
        self._rr = i % n if n else 0
        return sent

    # -- acknowledgements (owner thread) --------------------------------------------
    def _pop_in_flight(self, client: Consumer, msg_id: bytes) -> Message:
        # caller holds self.lock
        m = self.in_flight.get(msg_id)
        if m is None:
            raise NotInFlight()
        if m.client is not client:
            raise NotOwner()
        del self.in_flight[msg_id]
        if m.entry is not None:
            self.in_flight_wheel.remove(m.entry)
            m.entry = None
        m.client = None
        return m

    def finish(self, client: Consumer, msg_id: bytes) -> Message:
        """FIN: the message is done. Raises NotInFlight / NotOwner."""
        with self.lock:
            m = self._pop_in_flight(client, msg_id)
        client.in_flight_count -= 1
        if m.seq is not None and self.backend is not None:
            self.backend.ack(m.seq)
        return m

    def finish_many(self, client: Consumer, msg_ids: list[bytes]) -> list[tuple[bytes, BrokerError]]:
        """FIN a batch in order under one lock; returns the failures, in order."""
        failed: list[tuple[bytes, BrokerError]] = []
        in_flight = self.in_flight
        remove = self.in_flight_wheel.remove
        done = 0
        acks: list[int] = []
        with self.lock:
            for mid in msg_ids:
                m = in_flight.get(mid)
                if m is None:
                    failed.append((mid, NotInFlight()))
                    continue
                if m.client is not client:
                    failed.append((mid, NotOwner()))
                    continue
                del in_flight[mid]
                if m.entry is not None:
                    remove(m.entry)
                    m.entry = None
                m.client = None
                if m.seq is not None:
                    acks.append(m.seq)
                done += 1
        client.in_flight_count -= done
        if acks and self.backend is not None:
            self.backend.ack_many(acks)
        return failed

    def requeue(self, client: Consumer, msg_id: bytes, delay_ns: int, now_ns: int,
                wall_ns: int = 0) -> None:
        """REQ: back to the queue now (delay 0) or after delay_ns."""
        with self.lock:
            m = self._pop_in_flight(client, msg_id)
            if delay_ns > 0:
                m.entry = self.deferred_wheel.add(now_ns + delay_ns, m)
                self.deferred[m.id] = m
        client.in_flight_count -= 1
        self.requeue_count += 1
        if delay_ns <= 0:
            self.queue.append(m)
        elif self.durable and self.backend is not None:
            # the new due time must survive a crash: write it, then drop the old record
            old = m.seq
            m.seq = self.backend.put(to_record(m, wall_ns + delay_ns), claim=True)
            if old is not None:
                self.backend.ack(old)

    def touch(self, client: Consumer, msg_id: bytes, now_ns: int, max_msg_timeout_ns: int) -> None:
        """TOUCH: push the deadline to now + the client's msg_timeout, capped at
        delivery + max_msg_timeout (matches nsqd)."""
        with self.lock:
            m = self.in_flight.get(msg_id)
            if m is None:
                raise NotInFlight()
            if m.client is not client:
                raise NotOwner()
            deadline = min(now_ns + client.msg_timeout_ns, m.delivery_ns + max_msg_timeout_ns)
            if m.entry is not None:
                self.in_flight_wheel.remove(m.entry)
            m.entry = self.in_flight_wheel.add(deadline, m)

    # -- timeouts (scanner threads, then the owner) ---------------------------------
    def expire(self, now_ns: int) -> tuple[list[Message], list[Message]]:
        """Pop timed-out in-flight and due deferred messages (called by a scanner).

        The caller hands both lists to the owner loop's ``requeue_expired``.
        """
        with self.lock:
            timed_out = self.in_flight_wheel.pop_expired(now_ns)
            for m in timed_out:
                del self.in_flight[m.id]
                m.entry = None
            due = self.deferred_wheel.pop_expired(now_ns)
            for m in due:
                del self.deferred[m.id]
                m.entry = None
        return timed_out, due

    def requeue_expired(self, timed_out: list[Message], due: list[Message]) -> None:
        """Owner side of expiry: release the clients' in-flight slots and requeue."""
        for m in timed_out:
            c = m.client
            m.client = None
            if c is not None:
                c.in_flight_count -= 1
        self.timeout_count += len(timed_out)
        self.queue.extend(timed_out)
        self.queue.extend(due)

    # -- admin (owner thread) -------------------------------------------------------
    def empty(self) -> None:
        """Drop every queued, in-flight and deferred message (HTTP /channel/empty)."""
        self.queue.clear()
        with self.lock:
            for m in self.in_flight.values():
                c = m.client
                if c is not None:
                    c.in_flight_count -= 1
                m.client = None
            self.in_flight.clear()
            self.in_flight_wheel.clear()
            self.deferred.clear()
            self.deferred_wheel.clear()
        if self.backend is not None:
            self.backend.empty()

    def persist_all(self, now_ns: int, wall_ns: int) -> int:
        """Shutdown (owner thread, or after the loops stopped): write every message held
        in memory — queued, in flight, deferred with its due time — to the backend,
        drop their older records, and checkpoint. Returns how many were written."""
        backend = self.backend
        if backend is None:
            return 0
        with self.lock:
            in_flight = sorted(self.in_flight.values(), key=lambda m: m.delivery_ns)
            deferred = [(e, m) for e, m in self._deferred_entries()]
        records = [to_record(m) for m in in_flight]
        records += [to_record(m, wall_ns + max(0, d - now_ns)) for d, m in deferred]
        records += [to_record(m) for m in self.queue]
        olds = [m.seq for m in in_flight if m.seq is not None]
        olds += [m.seq for _, m in deferred if m.seq is not None]
        olds += [m.seq for m in self.queue if m.seq is not None]
        if records:
            backend.put_many(records)
            backend.sync()
        if olds:
            backend.ack_many(olds)
        backend.checkpoint()
        return len(records)

    def _deferred_entries(self) -> list[tuple[int, Message]]:
        # caller holds self.lock: (deadline_ns, message) for every deferred message
        wheel = self.deferred_wheel
        return [(wheel.deadline_of(m.entry) if m.entry else 0, m) for m in self.deferred.values()]

    def drain_all(self) -> list[Message]:
        """Every message this channel holds (shutdown): in flight, deferred, queued."""
        with self.lock:
            msgs = sorted(self.in_flight.values(), key=lambda m: m.delivery_ns)
            msgs += self.deferred_wheel.items()
        return msgs + list(self.queue)
