"""Queues written elsewhere, imported into topic logs once (docs/storage.md, "Importing").

Two sources: an nsqd 1.x data directory (``nsqd.dat``, ``*.diskqueue.*.dat``), and the
per-topic and per-channel disk queues of pybroker's earlier storage format
(``<data_path>/queues/``). Both end as a *plan*: per topic, its buffered messages and
each channel's queued messages. Each topic's buffered messages are appended to its log,
then each channel's as a block of their own; a channel's cursor ends past every block,
with its own block and the topic's buffer as requeued offsets, so the other channels'
blocks count as finished for it. A topic with no channel leaves everything to its first
channel. Publish times, attempts and DPUB due times are kept; message ids become log
offsets. The source files then move aside (``nsqd-imported/``, ``queues-migrated/``).
Runs at start-up, before the loops: the records go in through the synchronous
Publisher (``publish_now``), written in batches; a failed write stops the start-up
before the source files are moved.
"""
from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Iterator

from pybroker.server.publish import publish_now
from pybroker.storage.oldqueues import list_queues, pending_records
from pybroker.storage.nsqd_import import GoDiskQueue, NsqdDataDir

if TYPE_CHECKING:
    from pybroker.core.broker import Broker
    from pybroker.core.topic import Topic

log = logging.getLogger("pybroker")
# (ts_ns, attempts, body, deliver_at_ns)
Item = tuple[int, int, bytes, int]
_RECORD_HEADER = 8 + 8 + 2 + 16   # pybroker's earlier record: deliver_at, ts, attempts, id


@dataclass
class TopicPlan:
    paused: bool = False
    buffered: Iterable[Item] = ()
    channels: list[tuple[str, bool, Iterable[Item]]] = field(default_factory=list)


def _append(t: Topic, items: Iterable[Item]) -> range:
    """Append items to t's log, written in batches of 10,000; returns their offsets."""
    start = t.log.written
    batch: list[Item] = []
    for item in items:
        batch.append(item)
        if len(batch) >= 10_000:
            publish_now(t, batch)
            batch = []
    if batch:
        publish_now(t, batch)
    return range(start, t.log.written)


def import_plan(broker: Broker, plan: dict[str, TopicPlan]) -> int:
    """Append every planned queue to its topic's log; returns how many messages."""
    count = 0
    for name, tp in plan.items():
        t = broker.get_topic(name)
        t.paused = t.paused or tp.paused
        buffered = _append(t, tp.buffered)
        blocks = [_append(t, items) for _, _, items in tp.channels]
        count += len(buffered) + sum(len(b) for b in blocks)
        if not tp.channels:
            if not t.channels:
                t.orphan_start = min(t.orphan_start, buffered.start)
            continue
        for (ch_name, ch_paused, _), block in zip(tp.channels, blocks):
            with t.lock:
                ch = t.channels.get(ch_name) or t.new_channel(ch_name, cursor=t.log.head)
            ch.paused = ch.paused or ch_paused
            ch.cursor = ch.start_offset = t.log.head
            ch.requeue_imported(buffered)
            ch.requeue_imported(block)
    return count


# -- nsqd 1.x ----------------------------------------------------------------------------------


def _nsqd_items(queue: GoDiskQueue | None) -> Iterator[Item]:
    if queue is None:
        return
    for m in queue.messages():
        yield (m.ts_ns, m.attempts, m.body, 0)


def import_nsqd_dir(data_path: str, max_msg_size: int, broker: Broker) -> bool:
    """Import data_path if it holds nsqd's files (once: they are moved away);
    returns whether it did. Queues that nsqd.dat does not list (nsqd keeps them dormant
    until a topic or channel of that name comes back) are imported too, with their
    topic and channel."""
    try:
        names = os.listdir(data_path)
    except OSError:
        return False
    if not any(n.endswith(".diskqueue.meta.dat") for n in names):
        return False
    src = NsqdDataDir(data_path, max_msg_size=max_msg_size)
    for problem in src.problems:
        log.error("NSQ: import: %s", problem)
    plan: dict[str, TopicPlan] = {}
    for it in src.topics():
        plan[it.name] = TopicPlan(it.paused, _nsqd_items(it.queue),
                                  [(c.name, c.paused, _nsqd_items(c.queue)) for c in it.channels])
    for qname in src.orphan_queues():
        topic, _, channel = qname.partition(":")
        tp = plan.setdefault(topic, TopicPlan())
        if channel:
            tp.channels.append((channel, False, _nsqd_items(src.queue(qname))))
        else:
            tp.buffered = _nsqd_items(src.queue(qname))
        log.info("NSQ: import: queue %r is not in nsqd's metadata: imported all the same",
                 qname)
    count = import_plan(broker, plan)
    moved = os.path.join(data_path, "nsqd-imported")
    os.makedirs(moved, exist_ok=True)
    for fname in names:
        if ".diskqueue." in fname or fname.startswith("nsqd") and fname.endswith(".dat"):
            shutil.move(os.path.join(data_path, fname), os.path.join(moved, fname))
    log.info("NSQ: imported %d messages from an nsqd data directory (its files are now in "
             "%s)", count, moved)
    return True


# -- pybroker's earlier disk queues -------------------------------------------------------------


def _queue_items(qdir: str) -> Iterator[Item]:
    for rec in pending_records(qdir):
        if len(rec) < _RECORD_HEADER:
            continue
        deliver_at = int.from_bytes(rec[0:8], "big", signed=True)
        ts = int.from_bytes(rec[8:16], "big", signed=True)
        attempts = int.from_bytes(rec[16:18], "big")
        yield (ts, attempts, rec[_RECORD_HEADER:], deliver_at)


def migrate_queues_dir(data_path: str, broker: Broker) -> bool:
    """Move the queues of pybroker's earlier format (``queues/``) into topic logs, once;
    returns whether there were any. Topics and channels come from nsqd.dat as usual
    (already loaded); a queue nsqd.dat does not list is kept with its topic/channel."""
    root = os.path.join(data_path, "queues")
    queues = list_queues(root)
    if not queues:
        return False
    plan: dict[str, TopicPlan] = {}
    for qname, qdir in queues.items():
        topic, _, channel = qname.partition(":")
        tp = plan.setdefault(topic, TopicPlan())
        items = _queue_items(qdir)
        if channel:
            tp.channels.append((channel, False, items))
        else:
            tp.buffered = items
    for name, tp in plan.items():
        existing = broker.topics.get(name)
        if existing is not None and not tp.channels:
            # the topic's own queue: for every channel it has (the earlier format kept
            # a topic's buffer only while it had none)
            tp.channels = [(c, False, ()) for c in existing.channels]
    count = import_plan(broker, plan)
    moved = os.path.join(data_path, "queues-migrated")
    shutil.move(root, moved)
    log.info("NSQ: moved %d messages from the earlier queue format into topic logs (the "
             "old files are in %s)", count, moved)
    return True
