"""Collecting nsqd's stats across the event loops.

``plan_stats`` runs on the asking thread: it picks the topics and channels (sorted by
name, filtered as nsqd's GetStats does) and returns a Gather with one job per loop that
owns some of those channels (or every loop, when clients and producers are wanted).
Each job (``loop_snapshot``) runs on its loop, where channel counts, clients and
producers form a consistent view. ``Collected`` holds the assembled answer.

``SharedAnswers``: /stats and /metrics are planned, gathered and encoded on the log
reader's thread, one answer at a time (``HttpServer`` never runs them on its own
thread: with 2,000 topics, planning alone took it 7 ms a request, and /ping waited
behind every /stats in its turn). An answer begun after a request of the same form
came serves that request too: 8 clients asking for /stats of 2,000 topics without pause
were 8 documents made one after another, each as fresh as the one before.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from operator import attrgetter
from typing import TYPE_CHECKING

from pybroker.core.snapshot import ChannelSnapshot, channel_snapshot, topic_stats
from pybroker.core.stats import LatencyPart, client_stats, e2e_result, producer_stats
from pybroker.core.statsdoc import ChannelStats, ClientStats, TopicStats
from pybroker.evloop import TurnTimes
from pybroker.http.gather import MISSING, Gather, Job, Later

if TYPE_CHECKING:
    from collections.abc import Callable, Generator, Hashable

    from pybroker.http.response import Response

    from pybroker.core.channel import Channel
    from pybroker.core.flight import Consumer
    from pybroker.core.seams import Owner
    from pybroker.core.topic import Topic
    from pybroker.server.loop import EventLoop
    from pybroker.server.services import HttpHost


_NAME = attrgetter("name")
YIELD_TOPICS = 64    # topics a plan or a finish takes per hold of the GIL (about 1 ms)
log = logging.getLogger("pybroker")
STATS_STEP = 256     # channels a loop reads a turn for one /stats (about 3 ms)
CLIENTS_STEP = 1_024  # and clients listed in a turn, past its first channel (about 3 ms)


class LoopSnapshot:
    """What one loop reported: its channels' stats, its producers, its connections."""

    __slots__ = ("channels", "connections", "name", "owned", "producers", "sender",
                 "sender_rounds", "turns")

    def __init__(self, name: str, channels: dict[int, ChannelSnapshot],
                 producers: list[ClientStats], connections: int, sender: bool,
                 sender_rounds: int, turns: TurnTimes) -> None:
        self.name = name
        self.channels = channels
        self.producers = producers
        self.connections = connections
        self.owned = 0
        # who writes its passes to consumers at RDY 1-2 now (server/sendchoice.py)
        self.sender = sender
        self.sender_rounds = sender_rounds
        self.turns = turns          # a copy of the loop's TurnTimes


def loop_snapshot(loop: EventLoop, chans: list[Channel], include_clients: bool, topic_filter: str,
                  want_producers: bool) -> LoopSnapshot | Later:
    """On ``loop``'s thread: stats of the channels it owns, and of its producers; a step
    a turn (``_stats_step``: 10,000 channels in one turn held the loop 62 ms at each
    /stats, and a channel's 10,000 clients 33-49 ms), the answer given with the last (a
    Later) when it takes more than one."""
    out: dict[int, ChannelSnapshot] = {}
    steps = _stats_steps(loop, chans, out, include_clients, topic_filter)
    try:
        next(steps)
    except StopIteration:
        return _loop_done(loop, out, topic_filter, want_producers)
    later = Later()

    def failed(e: BaseException) -> None:    # a bug: the request is answered all the same
        log.error("HTTP: a /stats step on %s failed", loop.name, exc_info=e)
        later.resolve(MISSING)
    loop.run_steps(_next_turn(steps),
                   lambda _: later.resolve(_loop_done(loop, out, topic_filter, want_producers)),
                   failed)
    return later


def _next_turn(steps: Generator[None, None, None]) -> Generator[None, None, None]:
    """steps, from its next step on, in the next turn (its first ran in this one)."""
    yield
    yield from steps


# a channel with more clients than CLIENTS_STEP: the list its clients' stats go into (in
# its snapshot), and its consumers when its counts were read
BigChannel = tuple[list[ClientStats], "list[Consumer]"]


def _stats_step(loop: EventLoop, chans: list[Channel], at: int,
                out: dict[int, ChannelSnapshot], include_clients: bool,
                topic_filter: str, big: list[BigChannel]) -> int:
    """Channels from ``at`` on: at most STATS_STEP, and past the first, only while
    their clients come to at most CLIENTS_STEP; the index of the next. A channel with
    more clients than that is read without them, and goes into ``big`` with its
    consumers (listed a CLIENTS_STEP a step by ``_stats_steps``)."""
    now, wall = time.monotonic_ns(), time.time_ns()
    end = min(len(chans), at + STATS_STEP)
    clients = 0
    i = at
    while i < end:
        ch = chans[i]
        if not ch.deleted:
            n = len(ch.consumers) if include_clients else 0
            if i > at and clients + n > CLIENTS_STEP:
                break                   # the next step starts with it
            if n > CLIENTS_STEP:
                snap = out[id(ch)] = channel_snapshot(ch, False, topic_filter, now, wall)
                listed: list[ClientStats] = []
                snap[0]["clients"] = listed
                big.append((listed, list(ch.consumers)))
                return i + 1
            out[id(ch)] = channel_snapshot(ch, include_clients, topic_filter, now, wall)
            clients += n
        i += 1
    return i


def _stats_steps(loop: EventLoop, chans: list[Channel], out: dict[int, ChannelSnapshot],
                 include_clients: bool, topic_filter: str) -> Generator[None, None, None]:
    at = 0
    big: list[BigChannel] = []
    while True:
        at = _stats_step(loop, chans, at, out, include_clients, topic_filter, big)
        while big:
            listed, consumers = big.pop()
            for k in range(0, len(consumers), CLIENTS_STEP):
                if k:
                    yield
                listed.extend(client_stats(c, topic_filter)
                              for c in consumers[k:k + CLIENTS_STEP])
        if at >= len(chans):
            return
        yield


def _loop_done(loop: EventLoop, out: dict[int, ChannelSnapshot], topic_filter: str,
               want_producers: bool) -> LoopSnapshot:
    producers = producer_stats(loop.connections, topic_filter) if want_producers else []
    choice = loop.send_choice
    return LoopSnapshot(loop.name, out, producers, len(loop.connections),
                        choice.use_sender and loop.sender.possible(), choice.rounds,
                        loop.turn_times.copy())


class Collected:
    """The stats of one request: topics (None when the asked-for topic does not exist,
    which nsqd answers as ``"topics": null``), producers, and per-loop figures."""

    __slots__ = ("loops", "producers", "topics")

    def __init__(self, topics: list[TopicStats] | None,
                 producers: list[ClientStats] | None, loops: list[LoopSnapshot]) -> None:
        self.topics = topics
        self.producers = producers
        self.loops = loops


def plan_stats(runtime: HttpHost, topic_filter: str = "", channel_filter: str = "",
               include_clients: bool = True, every_loop: bool = False) -> Gather[Collected]:
    """A Gather whose answer is the Collected stats (see the module docstring)."""
    broker = runtime.broker
    percentiles = list(runtime.options.e2e_processing_latency_percentiles)
    with broker.lock:
        if topic_filter:
            t = broker.topics.get(topic_filter)
            topics = [t] if t is not None else None
        else:
            topics = sorted(broker.topics.values(), key=_NAME)
    if topics is None:
        # matches nsqd: an unknown topic gives empty stats (no topics, no producers)
        return Gather([], lambda _: Collected(None, None, []))
    plan: list[tuple[Topic, list[Channel]]] = []
    by_loop: dict[Owner[Channel], list[Channel]] = {}
    for i, t in enumerate(topics):
        if i % YIELD_TOPICS == YIELD_TOPICS - 1:
            time.sleep(0)       # the GIL offered (planned on the log reader's thread)
        with t.lock:
            chans = list(t.channels.values())
        if len(chans) > 1:
            chans.sort(key=_NAME)
        if channel_filter:
            chans = [c for c in chans if c.name == channel_filter]
            if not chans:
                continue  # matches nsqd: the topic is left out
        plan.append((t, chans))
        for ch in chans:
            by_loop.setdefault(ch.owner, []).append(ch)
    loops = list(runtime.loops)
    jobs: list[Job] = []
    for loop in loops:
        if loop in by_loop or include_clients or every_loop:
            jobs.append((loop, loop_snapshot,
                         (loop, by_loop.get(loop, []), include_clients, topic_filter,
                          include_clients)))

    def finish(results: list[object]) -> Collected:
        snaps = [r for r in results if isinstance(r, LoopSnapshot)]   # else MISSING
        answered = {id(job[0]) for job, r in zip(jobs, results) if r is not MISSING}
        found: dict[int, ChannelSnapshot] = {}
        for s in snaps:
            found.update(s.channels)
        now = time.monotonic_ns()
        out = []
        for i, (t, chans) in enumerate(plan):
            if i % YIELD_TOPICS == YIELD_TOPICS - 1:
                time.sleep(0)   # the GIL offered (a long finish runs off the HTTP thread)
            ch_dicts: list[ChannelStats] = []
            topic_parts: list[LatencyPart] = []
            for ch in chans:
                entry = found.get(id(ch))
                if entry is None:
                    if id(ch.owner) in answered:
                        continue  # deleted meanwhile
                    # the owner loop did not answer in time: counts read from here
                    entry = channel_snapshot(ch, False, topic_filter, now, time.time_ns())
                    if include_clients:
                        entry[0]["clients"] = []
                counts, extras, parts = entry
                # nsqd's keys, the latency result, then pybroker's keys
                ch_dicts.append({**counts, "e2e_processing_latency": e2e_result(percentiles, parts),
                                 **extras})
                topic_parts.extend(parts)
            # matches nsqd: a topic's latency merges its channels'; none without channels
            out.append(topic_stats(t, ch_dicts,
                                   e2e_result(percentiles, topic_parts if chans else None)))
        producers: list[ClientStats] = []
        for s in snaps:
            producers.extend(s.producers)
        for s in snaps:
            s.owned = len(s.channels)
        return Collected(out, producers if include_clients and producers else None, snaps)

    return Gather(jobs, finish)


class SharedAnswers:
    """Answers of one form (a /stats with its query) made once for every request of
    that form that came before the answer was begun.

    ``ticket()`` runs on the HTTP thread when a request comes; ``answer(form, ticket,
    make)`` on the log reader's thread, in the order the requests came: it gives the
    newest answer of that form when that was begun after the ticket was handed out,
    else calls ``make()`` (a document of the broker as it is now, so as fresh as any
    request waiting for it needs). No answer is served to a request that came after it
    was begun. At most ``FORMS`` forms are kept (the least recently made dropped), each
    one answer: a document of 10,000 topics is about 6 MB."""

    FORMS = 8

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._issued = 0
        self._made: OrderedDict[Hashable, tuple[int, Response]] = OrderedDict()

    def ticket(self) -> int:
        with self._lock:
            self._issued += 1
            return self._issued

    def answer(self, form: Hashable, ticket: int, make: Callable[[], Response]) -> Response:
        made = self._made.get(form)
        if made is not None and made[0] >= ticket:
            return made[1]
        with self._lock:
            covers = self._issued       # every ticket up to here came before make()
        resp = make()
        if resp.status == 200:
            self._made[form] = (covers, resp)
            self._made.move_to_end(form)
            while len(self._made) > self.FORMS:
                self._made.popitem(last=False)
        return resp
