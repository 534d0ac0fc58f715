"""Topic: ids, fan-out of every message to every channel, and the buffer used while a
topic has no channel or is paused.

Thread-safety: any thread may publish; ``lock`` guards the channel map, the buffer and
the counters. ``publish`` returns deliveries ``[(channel, messages)]`` that the caller
routes to each channel's owner loop; the topic never touches a channel's queue itself.
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Any, Callable

from pybroker.core.channel import Channel
from pybroker.core.ids import IdGenerator
from pybroker.core.message import Message
from pybroker.protocol.names import is_ephemeral

Deliveries = list[tuple[Channel, list[Message]]]


class Topic:
    def __init__(self, name: str, node_id: int, now_ts_ns: int, mem_queue_size: int,
                 pick_owner: Callable[[str, str], Any]) -> None:
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

    def __repr__(self) -> str:
        return f"Topic({self.name})"

    # -- publishing (any thread) ----------------------------------------------------
    def publish(self, bodies: list[bytes], ts_ns: int, defer_ns: int = 0) -> Deliveries:
        """Make messages for bodies and return where they must go."""
        with self.lock:
            ids = self._ids.next_ids(len(bodies))
            msgs = [Message(i, b, ts_ns, 0, defer_ns) for i, b in zip(ids, bodies)]
            self.message_count += len(msgs)
            self.message_bytes += sum(map(len, bodies))
            if self.paused or not self.channels:
                self._buffer(msgs)
                return []
            return self._fan_out(msgs)

    def _buffer(self, msgs: list[Message]) -> None:
        self.buffer.extend(msgs)
        if self.ephemeral and len(self.buffer) > self.mem_queue_size:
            # matches nsqd: ephemeral overflow is discarded
            for _ in range(len(self.buffer) - self.mem_queue_size):
                self.buffer.pop()

    def _fan_out(self, msgs: list[Message]) -> Deliveries:
        # caller holds self.lock. The first channel takes the originals, the others copies.
        chans = list(self.channels.values())
        out: Deliveries = [(chans[0], msgs)]
        for ch in chans[1:]:
            out.append((ch, [m.copy() for m in msgs]))
        return out

    def _release_buffer(self) -> Deliveries:
        # caller holds self.lock
        if self.paused or not self.channels or not self.buffer:
            return []
        msgs = list(self.buffer)
        self.buffer.clear()
        return self._fan_out(msgs)

    # -- channels (any thread) ------------------------------------------------------
    def get_channel(self, name: str) -> tuple[Channel, bool, Deliveries]:
        """Find or create a channel -> (channel, created, deliveries); a topic's first
        channel receives its buffer."""
        with self.lock:
            ch = self.channels.get(name)
            if ch is not None:
                return ch, False, []
            ch = Channel(self.name, name, self._pick_owner(self.name, name),
                         self.mem_queue_size, is_ephemeral(name))
            self.channels[name] = ch
            return ch, True, self._release_buffer()

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
            return self._release_buffer()

    def empty(self) -> None:
        with self.lock:
            self.buffer.clear()

    def depth(self) -> int:
        return len(self.buffer)
