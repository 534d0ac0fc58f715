"""Publishing a channel's dead letters, from the channel's owner loop.

The envelopes a dispatch produced are published like any publish: through the
Publisher (server/publish.py) to the dead-letter topic's owner loop, which appends them
with that turn's other publishes and writes them once at the end of the turn; in fsync
mode the storage thread then syncs the topic. The settlement comes back to the channel's
owner loop: only when the write (and the fsync) that carried the envelopes worked are
they finished on their channel (``Channel.dead_lettered``); in fsync mode it then asks
for a checkpoint of the channel states, so that a restart does not deliver them again.
A failed publish puts them back in the channel's queue after ``RETRY_NS`` (they stay
pending meanwhile), so a failing disk is not retried in a tight loop. See
docs/dead-letters.md.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pybroker.errors import Exiting

if TYPE_CHECKING:
    from pybroker.core.channel import Channel
    from pybroker.server.ports import Loop

log = logging.getLogger("pybroker")
# the channel kept on every dead-letter topic, so dead letters wait for a human
KEEP_CHANNEL = "dead-letters"
# a failed dead-letter publish is tried again after this (the messages wait in ``dying``)
RETRY_NS = 1_000_000_000


def publish_dead_letters(loop: Loop, ch: "Channel", target: str,
                         offsets: list[int], bodies: list[bytes]) -> None:
    """On ch's owner loop: publish these envelopes to ``target``, then confirm."""
    broker = loop.runtime.broker
    try:
        topic = broker.get_topic(target)
        if KEEP_CHANNEL not in topic.channels:
            broker.get_channel(topic, KEEP_CHANNEL)
    except Exiting as e:
        _confirmed(loop, ch, target, offsets, e)
        return
    loop.publisher.submit(target, bodies, 0,
                          lambda err: _confirmed(loop, ch, target, offsets, err))


def _confirmed(loop: Loop, ch: "Channel", target: str, offsets: list[int],
               err: Exception | None) -> None:
    """On the owner loop: the dead letters are written (and synced in fsync mode), or
    their publish failed."""
    if err is not None:
        log.error("CHANNEL(%s): dead-lettering %d messages to %s failed: %s (requeued "
                  "in %.0fs)", ch.name, len(offsets), target, err, RETRY_NS / 1e9)
        loop.call_later(RETRY_NS, _requeue, loop, ch, offsets)
        return
    log.info("CHANNEL(%s): %d messages out of attempts, published to %s",
             ch.name, len(offsets), target)
    ch.dead_lettered(offsets, True)
    if loop.durable:
        loop.runtime.storage.request_checkpoint()   # they are finished: saved soon
    if not ch.deleted:
        loop.mark_dirty(ch)


def _requeue(loop: Loop, ch: "Channel", offsets: list[int]) -> None:
    """On the owner loop, a while after a failed dead-letter publish: back in the
    channel's queue (the next dispatch dead-letters them again)."""
    ch.dead_lettered(offsets, False)
    if not ch.deleted:
        loop.mark_dirty(ch)
