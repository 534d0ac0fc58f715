"""Dead letters at scale and in cycles, on a real broker (docs/dead-letters.md): a burst
of 4,000 messages running out of attempts at once, read back from the segment files
(``--mem-queue-size 100``), moved in bounded memory; a dead-letter cycle ``a`` ->
``a.dead`` -> ``a`` that ends with the message kept once, its envelope not nested; and
the cycle refused when ``POST /channel/config`` can see it.
"""
from __future__ import annotations

import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest

from pybroker.protocol.deadletter import parse_envelope
from tests.support.http import broker_json as http
from tests.support.http import the_channel as channel_stats
from tests.support import wire
from tests.support.broker import BrokerProcess, rss_kb, unique_name, wait_until
from tests.support.wire import WireClient, subscribe

Connect = Callable[..., WireClient]
pytestmark = pytest.mark.timeout(240)


def topic_stats(b: BrokerProcess, topic: str) -> dict[str, Any]:
    _, d = http(b, "GET", "/stats", format="json", topic=topic)
    for t in d["topics"]:
        if t["topic_name"] == topic:
            return dict(t)
    raise AssertionError(f"no topic {topic} in /stats")


def test_a_burst_of_4000_dead_letters_from_disk_in_bounded_memory(
        make_broker: Callable[..., BrokerProcess], connect: Connect) -> None:
    """4,000 requeued messages that all run out of attempts in one dispatch, read back
    from the segment files: RSS grows by at most 50 MB (each used to keep a 256 KiB
    segment read alive: 753 MB), and every one reaches the dead-letter topic."""
    n = 4000
    b = make_broker("--mem-queue-size=100", "--max-attempts=1", "--max-rdy-count=5000")
    topic = unique_name()
    producer = connect(b)
    for k in range(0, n, 500):
        producer.mpub(topic, [b"%06d" % i + b"x" * 1000 for i in range(k, k + 500)])
    c = subscribe(connect(b), topic, rdy=n)
    got = c.read_messages(n, timeout=60)
    c.rdy(0)
    c.send(b"".join(wire.req(m.id, 0) for m in got))        # all requeued, none sent
    wait_until(lambda: channel_stats(b, topic, "ch")["depth"] == n, 30)
    time.sleep(0.5)                          # let the allocator settle
    before = rss_kb(b.pid)
    c.rdy(n)                                 # one dispatch: every one is out of attempts
    wait_until(lambda: channel_stats(b, topic, "ch")["dead_letter_count"] == n, 60)
    grown_mb = (rss_kb(b.pid) - before) / 1024
    assert grown_mb <= 50, f"RSS grew {grown_mb:.0f} MB"
    st = channel_stats(b, topic, "ch")
    assert (st["depth"], st["in_flight_count"], st["dead_letter_pending"]) == (0, 0, 0)
    c.expect_nothing(0.3)                    # none delivered a second time
    dead = channel_stats(b, topic + ".dead", "dead-letters")
    assert dead["depth"] == n and dead["message_count"] == n


def test_a_dead_letter_cycle_ends(make_broker: Callable[..., BrokerProcess],
                                  connect: Connect) -> None:
    """a -> a.dead (the default, max_attempts 2) and a.dead/c -> a (set before a had a
    channel, so nothing saw the cycle): the message goes to a.dead once, and there runs
    out of attempts again without going back to a. Its envelope is not nested."""
    b = make_broker("--max-attempts=2")
    a = unique_name("a")
    dead = a + ".dead"
    assert http(b, "POST", "/topic/create", topic=dead)[0] == 200
    assert http(b, "POST", "/channel/create", topic=dead, channel="c")[0] == 200
    status, body = http(b, "POST", "/channel/config", topic=dead, channel="c",
                        dead_letter_topic=a, max_attempts=2)
    assert status == 200, body
    ca = subscribe(connect(b), a, "c", rdy=1)      # a/c: the defaults, to a.dead
    # now the cycle is visible: configuring it directly is refused
    assert http(b, "POST", "/channel/config", topic=a, channel="c",
                dead_letter_topic=dead, max_attempts=3) == (400, {"message": "DEAD_LETTER_CYCLE"})
    connect(b).pub(a, b"poison")
    for attempt in (1, 2):
        m = ca.read_message()
        assert (m.body, m.attempts) == (b"poison", attempt)
        ca.req(m.id, 0)
    cd = subscribe(connect(b), dead, "c", rdy=1)
    for attempt in (1, 2):
        m = cd.read_message()
        assert m.attempts == attempt and parse_envelope(m.body).from_topics == (a,)
        cd.req(m.id, 0)
    wait_until(lambda: channel_stats(b, dead, "c")["dead_letter_cycles"] == 1, 10)
    ca.expect_nothing(0.5)                   # never back to a
    cd.expect_nothing(0.1)
    st = channel_stats(b, dead, "c")
    assert (st["depth"], st["in_flight_count"], st["dead_letter_count"]) == (0, 0, 0)
    assert topic_stats(b, a)["message_count"] == 1
    assert topic_stats(b, dead)["message_count"] == 1
    with urllib.request.urlopen(f"http://{b.http_hostport}/metrics", timeout=10) as r:
        metrics = r.read().decode()
    assert f'pybroker_channel_dead_letter_cycles_total{{topic="{dead}",channel="c"}} 1' \
        in metrics
    # kept once, for a person, in a.dead's dead-letters channel: one envelope, one hop
    keep = subscribe(connect(b), dead, "dead-letters", rdy=5)
    m = keep.read_message()
    env = parse_envelope(m.body)
    assert (env.body, env.topic, env.channel, env.attempts, env.hops) == \
        (b"poison", a, "c", 2, ())
    assert m.body.count(b"\n") == 1
    keep.expect_nothing(0.2)
