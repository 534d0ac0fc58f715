"""Channel: a topic's queue for one group of consumers, with in-flight and deferred state.

Ownership: a channel is owned by one event loop (``owner``, chosen by hashing its name);
only that loop's thread calls put/dispatch/finish/requeue/touch and changes consumers.
The queue-scanner threads call ``expire`` only. ``lock`` guards the in-flight and deferred
maps and wheels, which both sides touch; it is taken inside these methods only and never
held while calling out to another object.
"""
from __future__ import annotations

import random
import threading
from collections import deque
from typing import TYPE_CHECKING, Any, Iterable, Protocol

from pybroker.core.message import Message
from pybroker.core.timeouts import TimeoutWheel
from pybroker.errors import BrokerError, NotInFlight, NotOwner, TooManyConsumers

if TYPE_CHECKING:
    from pybroker.core.stats import LatencyWindow


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
                 ephemeral: bool) -> None:
        self.topic_name = topic_name
        self.name = name
        self.owner = owner
        self.ephemeral = ephemeral
        self.mem_queue_size = mem_queue_size
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
    def put(self, msgs: Iterable[Message], now_ns: int) -> None:
        """Accept messages from the topic: deferred ones go to the deferred wheel."""
        q = self.queue
        n = 0
        for m in msgs:
            n += 1
            if m.defer_ns:
                self._defer(m, now_ns + m.defer_ns)
                m.defer_ns = 0
            else:
                q.append(m)
        self.message_count += n
        if self.ephemeral and len(q) > self.mem_queue_size:
            # matches nsqd: an ephemeral channel discards what overflows its memory queue
            for _ in range(len(q) - self.mem_queue_size):
                q.pop()

    def _defer(self, m: Message, deadline_ns: int) -> None:
        with self.lock:
            m.entry = self.deferred_wheel.add(deadline_ns, m)
            self.deferred[m.id] = m

    def depth(self) -> int:
        return len(self.queue)

    # -- delivery (owner thread) ----------------------------------------------------
    def dispatch(self, now_ns: int) -> bool:
        """Hand queued messages to ready consumers, round-robin; True if any were sent."""
        q = self.queue
        consumers = self.consumers
        if self.paused or not q or not consumers:
            return False
        n = len(consumers)
        idle = 0
        i = self._rr
        sent = False
        while q and idle < n:
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
        return m

    def finish_many(self, client: Consumer, msg_ids: list[bytes]) -> list[tuple[bytes, BrokerError]]:
        """FIN a batch in order under one lock; returns the failures, in order."""
        failed: list[tuple[bytes, BrokerError]] = []
        in_flight = self.in_flight
        remove = self.in_flight_wheel.remove
        done = 0
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
                done += 1
        client.in_flight_count -= done
        return failed

    def requeue(self, client: Consumer, msg_id: bytes, delay_ns: int, now_ns: int) -> None:
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

    def drain_all(self) -> list[Message]:
        """Every message this channel holds (shutdown): in flight, deferred, queued."""
        with self.lock:
            msgs = sorted(self.in_flight.values(), key=lambda m: m.delivery_ns)
            msgs += self.deferred_wheel.items()
        return msgs + list(self.queue)
