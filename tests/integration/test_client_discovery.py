"""Reconnection after a server restart, and discovery through nsqlookupd's /lookup.

Each test runs against pybroker and, when one is found, a real nsqd. Discovery uses the
fake lookupd of tests/support/lookupd.py, and a real nsqlookupd when one is on PATH.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable, Iterator

import pytest

from pybroker.client import Consumer, Message, Producer
from tests.support.broker import BrokerProcess, unique_name, wait_until
from tests.support.http import http_json, wait_all_finished
from tests.support.lookupd import FakeLookupd
from tests.support.nsqtools import NsqDaemon, start_nsqlookupd

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=["pybroker", "nsqd"])
def broker_kind(request: pytest.FixtureRequest) -> str:
    """Which server ``make_broker`` starts; nsqd tests skip when no binary is found."""
    return str(request.param)


class Bodies:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.items: list[tuple[str, bytes]] = []

    def __call__(self, msg: Message) -> None:
        with self.lock:
            self.items.append((msg.nsqd_address, msg.body))

    def bodies(self) -> list[bytes]:
        with self.lock:
            return [b for _, b in self.items]


def test_reconnect_after_server_restart(make_broker: Callable[..., BrokerProcess],
                                        broker_kind: str,
                                        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="pybroker.client")
    b = make_broker(kind=broker_kind)
    assert b.tcp_address is not None
    b.extra_args.append(f"--tcp-address=127.0.0.1:{b.tcp_address[1]}")   # same port again
    topic = unique_name("disc_restart")
    got = Bodies()
    c = Consumer(topic, "ch", got, max_in_flight=10, lookupd_poll_interval=0.2)
    p = Producer(b.tcp_hostport)
    try:
        c.connect_to_nsqd(b.tcp_hostport)
        p.publish(topic, b"before")
        wait_until(lambda: got.bodies() == [b"before"], 5, what="the first message")
        # its FIN at the server before it stops (else, at least once, it comes again)
        wait_all_finished(b, topic, "ch")
        old = c.conns()[0]
        assert b.stop() == 0
        wait_until(lambda: old.is_closed and not p.is_connected, 5,
                   what="both clients to see the server go")
        failed = f"({b.tcp_hostport}) error connecting to nsqd"
        wait_until(lambda: sum(failed in r.getMessage() for r in caplog.records) >= 2, 5,
                   what="two failed reconnect attempts")
        assert c.conns() == []
        b.start()
        wait_until(lambda: c.conns() and c.conns()[0] is not old, 10,
                   what="the consumer to reconnect")
        p.publish(topic, b"after")               # the producer reconnects on use
        wait_until(lambda: len(got.bodies()) >= 2, 10, what="the second message")
    finally:
        p.stop()
        c.close()
    assert got.bodies() == [b"before", b"after"]
    assert p.connects == 2
    assert c.conns() == []


def test_discovery_through_lookupd(make_broker: Callable[..., BrokerProcess],
                                   broker_kind: str) -> None:
    first, second = make_broker(kind=broker_kind), make_broker(kind=broker_kind)
    topic = unique_name("disc_lookup")
    got = Bodies()
    with FakeLookupd() as lookupd:
        lookupd.add_producer(topic, first)
        c = Consumer(topic, "ch", got, max_in_flight=10, lookupd_poll_interval=0.2,
                     lookupd_poll_jitter=0.0)
        try:
            c.connect_to_nsqlookupd(lookupd.http_hostport)
            # the first query runs inside connect_to_nsqlookupd
            assert [x.address for x in c.conns()] == [first.tcp_hostport]
            with Producer(first.tcp_hostport) as p:
                p.publish(topic, b"from-first")
            wait_until(lambda: len(got.bodies()) == 1, 5, what="a message via lookupd")

            lookupd.add_producer(topic, second)
            wait_until(lambda: len(c.conns()) == 2, 5, what="the second server to be found")
            with Producer(second.tcp_hostport) as p:
                p.publish(topic, b"from-second")
            wait_until(lambda: len(got.bodies()) == 2, 5, what="a message from the second")
            assert lookupd.lookup_count(topic) >= 2, "lookupd was not polled"
            assert all(x.rdy_count == 5 for x in c.conns()), "max_in_flight not re-spread"
        finally:
            c.close()
    assert got.items == [(first.tcp_hostport, b"from-first"),
                         (second.tcp_hostport, b"from-second")]


def test_lookupd_unknown_topic_then_registered(make_broker: Callable[..., BrokerProcess],
                                               broker_kind: str) -> None:
    b = make_broker(kind=broker_kind)
    topic = unique_name("disc_late")
    got = Bodies()
    with FakeLookupd() as lookupd:
        c = Consumer(topic, "ch", got, lookupd_poll_interval=0.2, lookupd_poll_jitter=0.0)
        try:
            c.connect_to_nsqlookupd(lookupd.http_hostport)     # 404 TOPIC_NOT_FOUND
            assert c.conns() == []
            lookupd.add_producer(topic, b)
            wait_until(lambda: c.conns(), 5, what="discovery after registration")
            with Producer(b.tcp_hostport) as p:
                p.publish(topic, b"late")
            wait_until(lambda: got.bodies() == [b"late"], 5, what="the message")
        finally:
            c.close()


def test_a_consumer_left_without_a_connection_asks_lookupd_again_soon(
        make_broker: Callable[..., BrokerProcess]) -> None:
    """The topic moves (its broker goes away; lookupd lists another a moment later, as
    after a failover): with the default poll interval (60 s) the consumer is back on
    the new broker within seconds, asking again while it has no connection."""
    a, b = make_broker(), make_broker()
    topic = unique_name("disc_moved")
    got = Bodies()
    with FakeLookupd() as lookupd:
        lookupd.add_producer(topic, a)
        c = Consumer(topic, "ch", got)
        assert c.config.lookupd_poll_interval >= 60
        try:
            c.connect_to_nsqlookupd(lookupd.http_hostport)
            wait_until(lambda: len(c.conns()) == 1, 5, what="the first broker")
            lookupd.remove_producers(topic)
            assert a.stop() == 0                 # gone; the new home is not listed yet
            wait_until(lambda: c.conns() == [], 5, what="the consumer to see it go")
            asked = lookupd.lookup_count(topic)
            wait_until(lambda: lookupd.lookup_count(topic) >= asked + 2, 5,
                       what="lookupd asked again while alone")
            lookupd.add_producer(topic, b)
            wait_until(lambda: len(c.conns()) == 1, 5, what="the new broker")
            with Producer(b.tcp_hostport) as p:
                p.publish(topic, b"moved")
            wait_until(lambda: got.bodies() == [b"moved"], 5, what="the message")
            settled = lookupd.lookup_count(topic)
        finally:
            c.close()
    assert lookupd.lookup_count(topic) <= settled + 1     # connected: back to the interval


# -- a real nsqlookupd ---------------------------------------------------------------
@pytest.fixture
def nsqlookupd() -> Iterator[NsqDaemon]:
    """A real nsqlookupd on ephemeral ports."""
    lookupd = start_nsqlookupd()
    yield lookupd
    assert lookupd.stop() == 0, lookupd.text()


def test_discovery_through_real_nsqlookupd(make_broker: Callable[..., BrokerProcess],
                                           broker_kind: str, nsqlookupd: NsqDaemon) -> None:
    http_addr, tcp_addr = nsqlookupd.hostport("HTTP"), nsqlookupd.hostport("TCP")
    b = make_broker(f"--lookupd-tcp-address={tcp_addr}", "--broadcast-address=127.0.0.1",
                    kind=broker_kind)
    topic = unique_name("disc_real")
    with Producer(b.tcp_hostport) as p:
        p.publish(topic, b"registered")     # creating the topic registers it

    assert b.tcp_address is not None
    port = b.tcp_address[1]

    def registered() -> bool:
        status, doc = http_json("GET", f"http://{http_addr}/lookup?topic={topic}")
        return status == 200 and [x["tcp_port"] for x in doc["producers"]] == [port]

    # a new topic is registered with every nsqlookupd at once (nsqd's lookupLoop)
    wait_until(registered, 10, what=f"{broker_kind}'s topic in nsqlookupd's /lookup")
    got = Bodies()
    c = Consumer(topic, "ch", got, lookupd_poll_interval=0.2, lookupd_poll_jitter=0.0)
    try:
        c.connect_to_nsqlookupd(http_addr)
        wait_until(lambda: got.bodies() == [b"registered"], 10,
                   what="the message through a real nsqlookupd")
        assert [x.address.rsplit(":", 1)[1] for x in c.conns()] == [str(port)]
    finally:
        c.close()
