"""Publishing a channel's dead letters, on the channel's owner loop.

The envelopes a dispatch produced are published like any publish: appended under the
dead-letter topic's lock and written at once (one write for all of them, as an HTTP
publish is: ``Broker.publish``), then, in fsync mode, synced by the storage thread.
Only when that is confirmed does the owner loop finish them on their channel
(``Channel.dead_lettered``); in fsync mode it then asks for a checkpoint of the channel
states, so that a restart does not deliver them again. A failed publish puts them back
in the channel's queue. See docs/dead-letters.md.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pybroker.errors import Exiting
from pybroker.storage import StorageError

if TYPE_CHECKING:
    from pybroker.core.channel import Channel
    from pybroker.server.loop import EventLoop

log = logging.getLogger("pybroker")
# the channel kept on every dead-letter topic, so dead letters wait for a human
KEEP_CHANNEL = "dead-letters"


def publish_dead_letters(loop: "EventLoop", ch: "Channel", target: str,
                         offsets: list[int], bodies: list[bytes]) -> None:
    """On ch's owner loop: publish these envelopes to ``target``, then confirm."""
    rt = loop.runtime
    broker = rt.broker
    try:
        topic = broker.get_topic(target)
        if KEEP_CHANNEL not in topic.channels:
            broker.get_channel(topic, KEEP_CHANNEL)
        topic = broker.publish(target, bodies)
    except (StorageError, Exiting, OSError) as e:
        log.error("CHANNEL(%s): dead-lettering %d messages to %s failed: %s (requeued)",
                  ch.name, len(offsets), target, e)
        if isinstance(e, StorageError):
            rt.storage_failed(e, broker.topics.get(target))
        ch.dead_lettered(offsets, False)
        return
    log.info("CHANNEL(%s): %d messages out of attempts, published to %s",
             ch.name, len(offsets), target)
    if loop.durable:
        rt.storage.sync_topics(
            [topic], lambda err: loop.call_soon_threadsafe(_confirmed, loop, ch, offsets, err))
    else:
        _confirmed(loop, ch, offsets, None)


def _confirmed(loop: "EventLoop", ch: "Channel", offsets: list[int],
               err: Exception | None) -> None:
    """On the owner loop: the dead letters are on disk (or their publish failed)."""
    if err is not None:
        log.error("CHANNEL(%s): syncing %d dead letters failed: %s (requeued)",
                  ch.name, len(offsets), err)
    ch.dead_lettered(offsets, err is None)
    if err is None and loop.durable:
        loop.runtime.storage.request_checkpoint()   # they are finished: saved soon
    if not ch.deleted:
        loop.mark_dirty(ch)
