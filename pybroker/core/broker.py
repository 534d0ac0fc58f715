"""Broker: the registry of topics, and the thread-safe entry points other layers use.

Any thread may call these methods. Work on a channel's state is forwarded to the
channel's owner loop through ``owner.call_soon_threadsafe``; the router injected by the
server carries published messages to those owners.
"""
from __future__ import annotations

import threading
import time
import zlib
from typing import Any, Callable, Protocol

from pybroker.core.channel import Channel
from pybroker.core.topic import BackendFactory, Deliveries, Topic
from pybroker.errors import ChannelNotFound, Exiting, TopicNotFound


class Owner(Protocol):
    """An event loop that owns channels (implemented by server.loop.EventLoop)."""

    def call_soon_threadsafe(self, fn: Callable[..., Any], *args: Any) -> None: ...


class Broker:
    def __init__(self, options: Any, owners: list[Any],
                 route: Callable[[Deliveries], None],
                 open_backend: BackendFactory | None = None, durable: bool = False) -> None:
        self.options = options
        self.owners = owners
        self.route = route
        self.open_backend = open_backend
        self.durable = durable
        self.lock = threading.RLock()
        self.topics: dict[str, Topic] = {}
        self.start_time = int(time.time())
        self.exiting = False
        # bumped whenever topics or channels change, so the scanner refreshes its list
        # at once rather than waiting for queue_scan_refresh_interval (nsqd waits)
        self.generation = 0
        # observers called (from any thread) after topics/channels change: metadata, lookupd
        self.on_change: list[Callable[[], None]] = []
        self.on_delete_queue: list[Callable[[str], None]] = []
        # called with a storage error that core handled (e.g. a buffer kept in the topic)
        self.on_storage_error: list[Callable[[Exception], None]] = []

    # -- ownership ------------------------------------------------------------------
    def pick_owner(self, topic: str, channel: str) -> Any:
        """The loop that owns a channel: a stable hash of its full name."""
        return self.owners[zlib.crc32(f"{topic}:{channel}".encode()) % len(self.owners)]

    # -- topics ---------------------------------------------------------------------
    def get_topic(self, name: str) -> Topic:
        """Find or create a topic (names are validated by the caller)."""
        t = self.topics.get(name)
        if t is not None:
            return t
        with self.lock:
            if self.exiting:
                raise Exiting()
            t = self.topics.get(name)
            if t is None:
                o = self.options
                t = Topic(name, o.id, time.time_ns(), o.mem_queue_size, self.pick_owner,
                          self.open_backend, self.durable)
                self.topics[name] = t
                created = True
            else:
                created = False
        if created:
            self._changed()
        return t

    def find_topic(self, name: str) -> Topic:
        t = self.topics.get(name)
        if t is None:
            raise TopicNotFound(name)
        return t

    def delete_topic(self, name: str) -> None:
        with self.lock:
            t = self.topics.pop(name, None)
        if t is None:
            raise TopicNotFound(name)
        t.deleted = True
        for ch_name in list(t.channels):
            ch = t.remove_channel(ch_name)
            if ch is not None:
                ch.owner.call_soon_threadsafe(ch.owner.close_channel, ch)
        if t.backend is not None:
            t.backend.delete()
        for fn in self.on_delete_queue:
            fn(name)
        self._changed()

    def get_channel(self, topic: Topic, name: str) -> Channel:
        """Find or create a channel, routing the topic's buffer to it if it is the first."""
        ch, created, deliveries = topic.get_channel(name)
        if deliveries:
            self.route(deliveries)
        err, topic.release_error = topic.release_error, None
        if err is not None:
            for fn in self.on_storage_error:
                fn(err)
        if created:
            self._changed()
        return ch

    def find_channel(self, topic_name: str, channel_name: str) -> Channel:
        ch = self.find_topic(topic_name).find_channel(channel_name)
        if ch is None:
            raise ChannelNotFound(channel_name)
        return ch

    def delete_channel(self, topic_name: str, channel_name: str) -> None:
        t = self.find_topic(topic_name)
        ch = t.remove_channel(channel_name)
        if ch is None:
            raise ChannelNotFound(channel_name)
        ch.owner.call_soon_threadsafe(ch.owner.close_channel, ch)
        if t.ephemeral and not t.channels:
            try:
                self.delete_topic(t.name)
            except TopicNotFound:
                pass
        self._changed()

    # -- publishing (any thread) ----------------------------------------------------
    def publish(self, topic_name: str, bodies: list[bytes], defer_ns: int = 0) -> None:
        """Publish from any thread; returns once durable (in durable mode).

        Raises Exiting, or a storage error when the messages could not be written.
        """
        t = self.get_topic(topic_name)
        deliveries, to_sync = t.publish(bodies, time.time_ns(), defer_ns)
        if deliveries:
            self.route(deliveries)
        for b in to_sync:
            b.sync()

    def notify_changed(self) -> None:
        """Tell observers that persistent state changed (e.g. a topic or channel was
        paused over HTTP), so metadata is saved at once as nsqd does."""
        self._changed()

    def _changed(self) -> None:
        self.generation += 1
        for fn in self.on_change:
            fn()

    def restore(self, topics: list[tuple[str, bool, list[tuple[str, bool]]]]) -> None:
        """Start-up, before clients: recreate topics and channels with their paused
        flags, then hand each topic's backlog to its channels."""
        for name, paused, channels in topics:
            t = self.get_topic(name)
            with t.lock:
                t.paused = paused
                for ch_name, ch_paused in channels:
                    if ch_name not in t.channels:
                        t.new_channel(ch_name).paused = ch_paused
            deliveries = t.release()
            if deliveries:
                self.route(deliveries)

    def all_topics(self) -> list[Topic]:
        with self.lock:
            return list(self.topics.values())

    def all_channels(self) -> list[Channel]:
        """A snapshot of every channel (for the queue scanner)."""
        with self.lock:
            topics = list(self.topics.values())
        return [ch for t in topics for ch in list(t.channels.values())]
