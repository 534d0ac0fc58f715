"""Import of an nsqd 1.x data directory on first start (docs/storage.md, "Importing").

Each topic's buffered messages are appended to its log, then each channel's queued
messages as a block of their own. A channel's cursor ends past every block, with its own
block and the topic's buffer as requeued offsets: the other channels' blocks count as
finished for it. A topic with no channel leaves everything for its first channel.
Queues that nsqd.dat does not list (nsqd keeps them dormant until a topic or channel of
that name comes back) are imported too: their topic, and channel, are created. Then
nsqd's files move into ``nsqd-imported/``. Runs before the loops start.
"""
from __future__ import annotations

import logging
import os
import shutil
from typing import Any, Iterable

from pybroker.storage.nsqd_import import NsqdDataDir, NsqdMessage

log = logging.getLogger("pybroker")


def _append(t: Any, msgs: Iterable[NsqdMessage]) -> range:
    """Append nsqd messages (their publish times and attempts kept) to t's log."""
    with t.lock:
        start = t.log.head
        batch: list[tuple[int, int, bytes]] = []
        for m in msgs:
            batch.append((m.ts_ns, m.attempts, m.body))
            if len(batch) >= 10_000:
                t.log.append_records(batch)
                t.log.write_pending()
                batch = []
        if batch:
            t.log.append_records(batch)
        t.log.write_pending()
        t.released = t.log.written
        t.message_count += t.log.head - start
        return range(start, t.log.head)


def import_nsqd_dir(storage: Any) -> bool:
    """Import storage.data_path if it holds nsqd's files (once: they are moved away);
    returns whether it did."""
    data_path = storage.data_path
    try:
        names = os.listdir(data_path)
    except OSError:
        return False
    if not any(n.endswith(".diskqueue.meta.dat") for n in names):
        return False
    src = NsqdDataDir(data_path, max_msg_size=storage.options.max_msg_size)
    for problem in src.problems:
        log.error("NSQ: import: %s", problem)
    broker = storage.runtime.broker
    # topic -> (paused, topic queue, [(channel, paused, queue)])
    plan: dict[str, tuple[bool, Any, list[tuple[str, bool, Any]]]] = {}
    for it in src.topics():
        plan[it.name] = (it.paused, it.queue, [(c.name, c.paused, c.queue) for c in it.channels])
    for qname in src.orphan_queues():
        topic, _, channel = qname.partition(":")
        paused, tq, chans = plan.setdefault(topic, (False, None, []))
        if channel:
            chans.append((channel, False, src.queue(qname)))
        else:
            plan[topic] = (paused, src.queue(qname), chans)
        log.info("NSQ: import: queue %r is not in nsqd's metadata: imported all the same",
                 qname)
    count = 0
    for name, (paused, tq, chans) in plan.items():
        t = broker.get_topic(name)
        t.paused = paused
        buffered = _append(t, tq.messages() if tq is not None else [])
        blocks = [_append(t, q.messages() if q is not None else []) for _, _, q in chans]
        count += len(buffered) + sum(len(b) for b in blocks)
        if not chans:
            t.orphan_start = buffered.start
            continue
        for (ch_name, ch_paused, _), block in zip(chans, blocks):
            with t.lock:
                ch = t.channels.get(ch_name) or t.new_channel(ch_name, cursor=t.log.head)
            ch.paused = ch_paused
            ch.cursor = ch.start_offset = t.log.head
            ch.requeued.extend((off, 0) for off in buffered)
            ch.requeued.extend((off, 0) for off in block)
    moved = os.path.join(data_path, "nsqd-imported")
    os.makedirs(moved, exist_ok=True)
    for fname in names:
        if ".diskqueue." in fname or fname.startswith("nsqd") and fname.endswith(".dat"):
            shutil.move(os.path.join(data_path, fname), os.path.join(moved, fname))
    log.info("NSQ: imported %d messages from an nsqd data directory (its files are now in "
             "%s)", count, moved)
    storage.save_now()
    return True
