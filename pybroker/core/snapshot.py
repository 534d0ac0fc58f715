"""Snapshots of a channel and a topic for /stats, and the FIN-latency record: the
functions that read a Channel or a Topic whole, apart from core.stats (whose windows
and client figures the channel itself holds), so that no core module below the
channel and the topic needs to name them.

Each runs on the owner loop of what it reads (the HTTP thread posts it there).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from pybroker.core.stats import LatencyPart, LatencyWindow, client_stats
from pybroker.core.statsdoc import (ChannelCounts, ChannelExtras, ChannelStats, E2eResult,
                                    TopicStats)

if TYPE_CHECKING:
    from pybroker.core.channel import Channel
    from pybroker.core.topic import Topic

# what channel_snapshot reads on the owner loop: nsqd's counts, pybroker's keys, and the
# latency window's halves
ChannelSnapshot = tuple[ChannelCounts, ChannelExtras, list[LatencyPart]]


def record_latency(ch: Channel, latency_ns: int, now_ns: int, window_ns: int) -> None:
    """Record one FIN's publish-to-finish latency on ch (its owner loop), creating the
    channel's window on first use."""
    window = ch.e2e
    if window is None:
        window = ch.e2e = LatencyWindow(window_ns, now_ns)
    window.insert(max(0, latency_ns), now_ns)


def channel_snapshot(ch: Channel, include_clients: bool, topic_filter: str,
                     now_ns: int, wall_ns: int) -> ChannelSnapshot:
    """nsqd's ChannelStats without the latency result, pybroker's keys, and the latency
    samples.

    Runs on the channel's owner loop, so counts and clients are one consistent view.
    ``clients`` is null when clients are not requested (nsqd leaves the slice nil).
    """
    window = ch.e2e
    parts = window.snapshot(now_ns) if window is not None else []
    consumers = list(ch.consumers)
    d: ChannelCounts = {
        "channel_name": ch.name,
        "depth": ch.depth(wall_ns),
        "backend_depth": ch.backend_depth(),
        "in_flight_count": len(ch.in_flight),
        "deferred_count": ch.deferred_count(wall_ns),
        "message_count": ch.message_count,
        "requeue_count": ch.requeue_count,
        "timeout_count": ch.timeout_count,
        "client_count": len(consumers),
        "clients": [client_stats(c, topic_filter) for c in consumers] if include_clients else None,
        "paused": ch.paused,
    }
    extras: ChannelExtras = {
        "cursor": ch.cursor,
        "max_attempts": ch.max_attempts,
        "dead_letter_topic": ch.dead_letter_topic or "",
        "dead_letter_count": ch.dead_letter_count,
        "dead_letter_pending": len(ch.dying),
        "dead_letter_cycles": ch.dead_letter_cycles,
    }
    return d, extras, parts


def topic_stats(t: Topic, channels: list[ChannelStats], e2e: E2eResult) -> TopicStats:
    """nsqd's TopicStats around already-built channel dicts."""
    return {
        "topic_name": t.name,
        "channels": channels,
        "depth": t.depth(),
        "backend_depth": t.backend_depth(),
        "message_count": t.message_count,
        "message_bytes": t.message_bytes,
        "paused": t.paused,
        "e2e_processing_latency": e2e,
        "oldest_offset": t.log.oldest,
        "newest_offset": t.log.written - 1,
        # bytes read back from the segment files (read amplification: against the
        # bytes delivered); 0 for a log kept in memory
        "log_bytes_read": getattr(t.log, "bytes_read", 0),
    }
