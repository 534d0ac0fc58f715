"""Broker: the registry of topics, and the thread-safe entry points other layers use.

Every thread may call these methods. Work on a channel's state is forwarded to the
channel's owner loop through ``owner.call_soon_threadsafe``; ``wake`` (injected by the
server) tells owner loops that their channels have new records to read. Publishing is
not here: a topic is appended to and written only by its owner loop's Publisher
(``topic_owner``; pybroker.server.publish).
"""
from __future__ import annotations

import logging
import threading
import time
import zlib
from collections.abc import Callable, Sequence

from pybroker.config import Options
from pybroker.core.channel import Channel
from pybroker.core.seams import Log, Owner
from pybroker.protocol.deadletter import is_dead_letter_topic
from pybroker.core.topic import Topic
from pybroker.errors import ChannelNotFound, Exiting, TopicNotFound
from pybroker.protocol.names import is_ephemeral

LogFactory = Callable[[str, bool], Log]   # (topic name, ephemeral) -> a TopicLog
logger = logging.getLogger("pybroker")   # lifecycle lines in nsqd's words (topic.go, channel.go)


def dead_letter_defaults(options: Options, topic: str) -> tuple[int, str]:
    """The config's (max_attempts, dead_letter_topic) for the channels of a topic; none
    for a dead-letter topic itself (docs/dead-letters.md)."""
    max_attempts = int(getattr(options, "max_attempts", 0) or 0)
    name = str(getattr(options, "dead_letter_topic", "") or "")
    if not max_attempts or is_dead_letter_topic(topic, name):
        return 0, ""
    return max_attempts, name


class Broker:
    def __init__(self, options: Options, owners: Sequence[Owner[Channel]], open_log: LogFactory,
                 wake: Callable[[list[Channel]], None]) -> None:
        self.options = options
        self.owners = owners
        self.open_log = open_log
        self.wake = wake
        # shared by every thread that creates, deletes or lists topics (the loops, http,
        # lookupd, storage): the registry and the exiting flag; re-entrant, since the
        # on_delete_topic callbacks run under it
        self.lock = threading.RLock()
        self.topics: dict[str, Topic] = {}
        self.start_time = int(time.time())
        self.exiting = False
        # bumped whenever topics or channels change, so the scanner refreshes its list
        # at once rather than waiting for queue_scan_refresh_interval (nsqd waits)
        self.generation = 0
        # observers called (from any thread) after topics/channels change: metadata, lookupd
        self.on_change: list[Callable[[], None]] = []
        # called with a topic whose log must go (after a delete), off the loops
        self.on_delete_topic: list[Callable[[Topic], None]] = []

    # -- ownership ------------------------------------------------------------------
    def pick_owner(self, topic: str, channel: str) -> Owner[Channel]:
        """The loop that owns a channel: a stable hash of its full name."""
        return self.owners[zlib.crc32(f"{topic}:{channel}".encode()) % len(self.owners)]

    def topic_owner(self, topic: str) -> Owner[Channel]:
        """The loop that owns a topic's publishing: a stable hash of its name."""
        owners = self.owners
        if len(owners) == 1:
            return owners[0]
        return owners[zlib.crc32(topic.encode()) % len(owners)]

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
                log = self.open_log(name, is_ephemeral(name))
                t = Topic(name, log, self.options.mem_queue_size, self.pick_owner)
                t.owner = self.topic_owner(name)
                t.dl_defaults = dead_letter_defaults(self.options, name)
                self.topics[name] = t
                created = True
                logger.info("TOPIC(%s): created", name)
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
        """Set the topic's exit flag under its lock (a racing publish gets Exiting and
        goes to the next topic of that name), close its channels on their owner loops and
        hand its log to the storage side for removal."""
        with self.lock:
            t = self.topics.pop(name, None)
            if t is None:
                raise TopicNotFound(name)
            logger.info("TOPIC(%s): deleting", name)
            with t.lock:
                t.deleted = True
                chans = list(t.channels.values())
                t.channels.clear()
            # still under the registry's lock: a topic of the same name created next
            # must not find the old one's files (the storage side moves them aside)
            for fn in self.on_delete_topic:
                fn(t)
        for ch in chans:
            logger.info("CHANNEL(%s): deleting", ch.name)
            ch.deleted = True
            ch.owner.call_soon_threadsafe(ch.owner.close_channel, ch)
        self._changed()

    def get_channel(self, topic: Topic, name: str) -> Channel:
        """Find or create a channel."""
        ch, created = topic.get_channel(name)
        if created:
            logger.info("TOPIC(%s): new channel(%s)", topic.name, name)
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
        logger.info("TOPIC(%s): deleting channel %s", topic_name, channel_name)
        logger.info("CHANNEL(%s): deleting", channel_name)
        ch.owner.call_soon_threadsafe(ch.owner.close_channel, ch)
        if t.ephemeral and not t.channels:
            try:
                self.delete_topic(t.name)
            except TopicNotFound:
                pass
        self._changed()

    def notify_changed(self) -> None:
        """Tell observers that persistent state changed (e.g. a topic or channel was
        paused over HTTP), so metadata is saved at once as nsqd does."""
        self._changed()

    def _changed(self) -> None:
        self.generation += 1
        for fn in self.on_change:
            fn()

    def all_topics(self) -> list[Topic]:
        with self.lock:
            return list(self.topics.values())

    def all_channels(self) -> list[Channel]:
        """A snapshot of every channel (for the queue scanner)."""
        with self.lock:
            topics = list(self.topics.values())
        return [ch for t in topics for ch in list(t.channels.values())]
