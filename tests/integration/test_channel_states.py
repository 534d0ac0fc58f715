"""The channel's state machine on a real broker over raw sockets (docs/storage.md, "A
message's life on a channel"): rewinds while messages are in flight (FIN works, counters
stay exact, an RDY 1 consumer keeps getting messages), 200 rewinds during consumption
(nothing lost, no E_FIN_FAILED, every counter exact), and nsqd's requeue order (a
timed-out or REQ'd message comes back after the messages queued ahead of it), compared
with a real nsqd 1.3.0 when one is on PATH.
"""
from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

from tests.support.http import broker_json as http
from tests.support.http import the_channel as channel_stats
from tests.support import wire
from tests.support.broker import BrokerProcess, unique_name, wait_until
from tests.support.wire import FRAME_ERROR, FRAME_MESSAGE, WireClient, subscribe

Connect = Callable[..., WireClient]
SLACK_S = {"pybroker": 1.5, "nsqd": 5.5}   # nsqd scans a new channel within 5 s


def counts(st: dict[str, Any]) -> tuple[int, ...]:
    return (st["depth"], st["in_flight_count"], st["deferred_count"], st["requeue_count"],
            st["timeout_count"])


def rewind(b: BrokerProcess, topic: str, offset: int, channel: str = "ch") -> None:
    status, body = http(b, "POST", "/channel/rewind", topic=topic, channel=channel,
                        offset=offset)
    assert status == 200, body


# -- rewinds with messages in flight ------------------------------------------------------
def test_rewind_with_a_message_in_flight(broker: BrokerProcess, connect: Connect) -> None:
    """Issue 22's wedge: the FIN after the rewind works, in_flight_count goes back to 0,
    the RDY 1 consumer gets the message again (the rewind's replay), then the rest."""
    topic = unique_name()
    connect(broker).mpub(topic, [b"m0", b"m1", b"m2"])
    c = subscribe(connect(broker), topic, rdy=1)
    m0 = c.read_message()
    assert m0.body == b"m0"
    rewind(broker, topic, 0)
    st = channel_stats(broker, topic, "ch")
    assert (st["in_flight_count"], st["depth"], st["message_count"]) == (1, 2, 3)
    c.expect_nothing(0.2)                    # not delivered again while in flight
    c.fin(m0.id)
    again = c.read_message()                 # not an E_FIN_FAILED: the FIN worked
    assert (again.id, again.body, again.attempts) == (m0.id, b"m0", 1)
    seen = [again.body]
    c.fin(again.id)
    for _ in range(2):
        m = c.read_message()
        seen.append(m.body)
        c.fin(m.id)
    assert seen == [b"m0", b"m1", b"m2"]
    c.expect_nothing(0.2)
    wait_until(lambda: channel_stats(broker, topic, "ch")["in_flight_count"] == 0, 5)
    st = channel_stats(broker, topic, "ch")
    assert counts(st) == (0, 0, 0, 0, 0) and st["message_count"] == 4
    assert st["clients"][0]["finish_count"] == 4 and st["clients"][0]["in_flight_count"] == 0


def test_req_and_touch_work_after_a_rewind(broker: BrokerProcess, connect: Connect) -> None:
    topic = unique_name()
    connect(broker).mpub(topic, [b"a", b"b"])
    c = subscribe(connect(broker), topic, rdy=2)
    a, b = c.read_messages(2)
    rewind(broker, topic, 0)
    c.touch(a.id)
    c.req(a.id, 0)              # REQ'd: delivered once more (no extra replay)
    c.fin(b.id)                 # FIN'd: replayed once, anew
    got = sorted((m.body, m.attempts) for m in c.read_messages(2))
    assert got == [(b"a", 2), (b"b", 1)]
    c.expect_nothing(0.3)
    st = channel_stats(broker, topic, "ch")
    assert (st["in_flight_count"], st["depth"], st["requeue_count"]) == (2, 0, 1)


class Consumer(threading.Thread):
    """FINs every message at once; records bodies and every error frame."""

    def __init__(self, client: WireClient) -> None:
        super().__init__(daemon=True)
        self.c = client
        self.bodies: list[bytes] = []
        self.errors: list[bytes] = []
        self.last = time.monotonic()
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                ftype, data = self.c.read_frame(0.2)
            except TimeoutError:
                continue
            if ftype == FRAME_MESSAGE:
                m = wire.parse_message(data)
                self.bodies.append(m.body)
                self.last = time.monotonic()
                self.c.fin(m.id)
            elif ftype == FRAME_ERROR:
                self.errors.append(data)


def test_200_rewinds_during_consumption_lose_nothing_and_keep_counters_exact(
        broker: BrokerProcess, connect: Connect) -> None:
    topic = unique_name()
    n = 1000
    producer = connect(broker)
    producer.mpub(topic, [b"%d" % i for i in range(n)])
    client = subscribe(connect(broker), topic, rdy=50)
    con = Consumer(client)
    con.start()
    rng = random.Random(22)
    try:
        wait_until(lambda: len(con.bodies) >= 50, 10)
        for _ in range(200):
            # back to any offset the cursor passed (the cursor only moves on meanwhile):
            # a replay; a forward move would drop messages, as /channel/commit does
            cursor = channel_stats(broker, topic, "ch")["cursor"]
            rewind(broker, topic, rng.randrange(0, cursor + 1))
        wait_until(lambda: time.monotonic() - con.last > 1.0
                   and counts(channel_stats(broker, topic, "ch")) == (0, 0, 0, 0, 0), 60)
    finally:
        con.stop.set()
        con.join(5)
    assert con.errors == []                                    # no E_FIN_FAILED
    assert {int(b) for b in con.bodies} == set(range(n))       # nothing lost
    st = channel_stats(broker, topic, "ch")
    assert counts(st) == (0, 0, 0, 0, 0)
    # no REQ and no timeout: each delivery was one put to the channel, and was FIN'd
    assert st["message_count"] == len(con.bodies)
    assert st["clients"][0]["finish_count"] == len(con.bodies)
    assert st["clients"][0]["in_flight_count"] == 0
    assert st["cursor"] == n


# -- nsqd's requeue order -------------------------------------------------------------------
def test_timed_out_message_comes_back_after_the_queued_one(any_broker: BrokerProcess,
                                                           connect: Connect) -> None:
    """msg_timeout 1 s; PUB A, PUB B; a RDY 1 consumer lets A time out -> B next
    (attempts 1), then A (attempts 2): nsqd puts a timed-out message at the tail."""
    topic = unique_name()
    connect(any_broker).mpub(topic, [b"A", b"B"])
    c = subscribe(connect(any_broker), topic, rdy=1, msg_timeout=1000)
    first = c.read_message()
    assert (first.body, first.attempts) == (b"A", 1)
    second = c.read_message(timeout=1.0 + SLACK_S[any_broker.kind] + 1)
    assert (second.body, second.attempts) == (b"B", 1)
    c.fin(second.id)
    third = c.read_message()
    assert (third.body, third.attempts, third.id) == (b"A", 2, first.id)
    c.fin(third.id)
    c.expect_nothing(0.3)


def test_reqd_message_comes_back_after_the_queued_ones(any_broker: BrokerProcess,
                                                       connect: Connect) -> None:
    """REQ with no delay: to the tail too (nsqd's doRequeue -> put)."""
    topic = unique_name()
    connect(any_broker).mpub(topic, [b"A", b"B", b"C"])
    c = subscribe(connect(any_broker), topic, rdy=1)
    first = c.read_message()
    c.req(first.id, 0)
    order = []
    for _ in range(3):
        m = c.read_message()
        order.append((m.body, m.attempts))
        c.fin(m.id)
    assert order == [(b"B", 1), (b"C", 1), (b"A", 2)]
    c.expect_nothing(0.3)
