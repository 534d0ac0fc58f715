"""Reconnection after a server restart, and discovery through nsqlookupd's /lookup.

Each test runs against pybroker and, when one is found, a real nsqd. Discovery uses the
fake lookupd of tests/support/lookupd.py, and a real nsqlookupd when one is on PATH.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Callable, Iterator

import pytest

from pybroker.client import Consumer, Message, Producer
from tests.support.broker import BrokerProcess, unique_name, wait_until
from tests.support.lookupd import FakeLookupd

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
                                        broker_kind: str) -> None:
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
        old = c.conns()[0]
        assert b.stop() == 0
        wait_until(lambda: old.is_closed and not p.is_connected, 5,
                   what="both clients to see the server go")
        time.sleep(0.5)                          # a few failed reconnect attempts
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


# -- a real nsqlookupd ---------------------------------------------------------------
@pytest.fixture
def nsqlookupd() -> Iterator[str]:
    """A real nsqlookupd on ephemeral ports; yields its HTTP address."""
    path = os.environ.get("NSQLOOKUPD") or shutil.which("nsqlookupd")
    if not path:
        pytest.skip("no nsqlookupd binary on PATH (or $NSQLOOKUPD)")
    proc = subprocess.Popen([path, "--tcp-address=127.0.0.1:0", "--http-address=127.0.0.1:0"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    addrs: dict[str, str] = {}

    def read() -> None:
        assert proc.stderr is not None
        for raw in proc.stderr:
            m = re.search(r"(TCP|HTTP): listening on (\S+)", raw.decode(errors="replace"))
            if m:
                addrs[m.group(1)] = m.group(2)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        wait_until(lambda: len(addrs) == 2, 10, what="nsqlookupd to listen")
        yield f"{addrs['HTTP']}|{addrs['TCP']}"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
        reader.join(5)
        assert proc.stderr is not None
        proc.stderr.close()


def _supports_lookupd_flag() -> bool:
    out = subprocess.run([sys.executable, "-m", "pybroker", "serve", "--help"],
                         capture_output=True, text=True, timeout=30,
                         env=dict(os.environ, COLUMNS="200"))
    return "--lookupd-tcp-address" in out.stdout


def test_discovery_through_real_nsqlookupd(make_broker: Callable[..., BrokerProcess],
                                           broker_kind: str, nsqlookupd: str) -> None:
    http_addr, tcp_addr = nsqlookupd.split("|")
    if broker_kind == "pybroker" and not _supports_lookupd_flag():
        pytest.skip("pybroker serve has no --lookupd-tcp-address yet")
    b = make_broker(f"--lookupd-tcp-address={tcp_addr}", "--broadcast-address=127.0.0.1",
                    kind=broker_kind)
    topic = unique_name("disc_real")
    with Producer(b.tcp_hostport) as p:
        p.publish(topic, b"registered")     # creating the topic registers it
    if broker_kind == "pybroker":
        def nodes() -> list[object]:
            with urllib.request.urlopen(f"http://{http_addr}/nodes", timeout=5) as r:
                return list(json.loads(r.read()).get("producers") or [])
        try:
            wait_until(nodes, 3, what="pybroker in nsqlookupd's /nodes")
        except AssertionError:
            pytest.skip("pybroker does not register with nsqlookupd yet (absent from /nodes)")
    got = Bodies()
    c = Consumer(topic, "ch", got, lookupd_poll_interval=0.2, lookupd_poll_jitter=0.0)
    try:
        c.connect_to_nsqlookupd(http_addr)
        wait_until(lambda: got.bodies() == [b"registered"], 10,
                   what="the message through a real nsqlookupd")
        assert b.tcp_address is not None
        assert [x.address.rsplit(":", 1)[1] for x in c.conns()] == [str(b.tcp_address[1])]
    finally:
        c.close()
