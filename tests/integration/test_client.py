"""pybroker.client against a real server: PUB/MPUB/DPUB, futures, FIN/REQ/TOUCH, CLS, heartbeats.

Every test runs against pybroker and, when one is found, a real nsqd (``any_broker``).
"""
from __future__ import annotations

import json
import threading
import time
import urllib.request
from typing import Any

import pytest

from pybroker.client import Consumer, Message, NotConnectedError, Producer, ProtocolError
from tests.support.broker import BrokerProcess, unique_name, wait_until
from tests.support.http import wait_all_finished

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=["pybroker", "nsqd"])
def broker_kind(request: pytest.FixtureRequest) -> str:
    """Which server ``make_broker`` starts; nsqd tests skip when no binary is found."""
    return str(request.param)


class Collector:
    """A handler that records the messages it was given."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.messages: list[Message] = []
        self.arrivals: list[float] = []

    def __call__(self, msg: Message) -> None:
        with self.lock:
            self.messages.append(msg)
            self.arrivals.append(time.monotonic())

    def bodies(self) -> list[bytes]:
        with self.lock:
            return [m.body for m in self.messages]

    def count(self) -> int:
        with self.lock:
            return len(self.messages)


def test_publish_forms_and_consume(any_broker: BrokerProcess) -> None:
    topic = unique_name("cli_pub")
    got = Collector()
    with Producer(any_broker.tcp_hostport) as p:
        p.publish(topic, b"one")
        p.multi_publish(topic, [b"two", b"three", b"four"])
        t_dpub = time.monotonic()
        p.deferred_publish(topic, 1.0, b"later")
        c = Consumer(topic, "ch", got, max_in_flight=10)
        c.connect_to_nsqd(any_broker.tcp_hostport)
        try:
            wait_until(lambda: got.count() >= 5, 10, what="5 messages")
        finally:
            c.close()
    bodies = got.bodies()
    assert sorted(bodies) == sorted([b"one", b"two", b"three", b"four", b"later"])
    assert bodies[:4] == [b"one", b"two", b"three", b"four"]
    later = next(i for i, m in enumerate(got.messages) if m.body == b"later")
    assert got.arrivals[later] - t_dpub >= 0.9, "DPUB delivered before its delay"
    assert all(m.attempts == 1 and len(m.id) == 16 for m in got.messages)
    assert c.stats().messages_finished == 5


def test_pipelined_futures_errors_and_reconnect(any_broker: BrokerProcess) -> None:
    topic = unique_name("cli_fut")
    p = Producer(any_broker.tcp_hostport)
    try:
        futs = [p.publish_async(topic, b"m%d" % i) for i in range(2000)]
        assert [f.result(10) for f in futs] == [b"OK"] * 2000
        assert p.connects == 1
        bad = p.publish_async("bad$topic", b"x")
        with pytest.raises(ProtocolError) as ei:
            bad.result(5)
        assert ei.value.code == "E_BAD_TOPIC"
        # E_BAD_TOPIC is fatal: the server closes, and the next publish reconnects
        wait_until(lambda: not p.is_connected, 5, what="the server to close")
        p.publish(topic, b"after")
        assert p.connects == 2
        with pytest.raises(ValueError):
            p.publish_async("two words", b"x")
        with pytest.raises(ProtocolError) as ei2:
            p.multi_publish(topic, [b"ok", b""])
        assert ei2.value.code == "E_BAD_MESSAGE"
    finally:
        p.stop()
    got = Collector()
    c = Consumer(topic, "ch", got, max_in_flight=500)
    c.connect_to_nsqd(any_broker.tcp_hostport)
    try:
        wait_until(lambda: got.count() >= 2001, 15, what="2001 messages")
    finally:
        c.close()
    assert got.bodies() == [b"m%d" % i for i in range(2000)] + [b"after"]


def test_unreachable_server_raises() -> None:
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    p = Producer(f"127.0.0.1:{port}")
    try:
        with pytest.raises(NotConnectedError):
            p.publish("t", b"x")
    finally:
        p.stop()


def test_requeue_with_delay_and_attempts(any_broker: BrokerProcess) -> None:
    topic = unique_name("cli_req")
    seen: list[tuple[int, float]] = []

    def handler(msg: Message) -> None:
        seen.append((msg.attempts, time.monotonic()))
        if msg.attempts == 1:
            raise RuntimeError("first try fails")

    with Producer(any_broker.tcp_hostport) as p:
        p.publish(topic, b"x")
    c = Consumer(topic, "ch", handler, default_requeue_delay=0.5, backoff_multiplier=0.01)
    c.connect_to_nsqd(any_broker.tcp_hostport)
    try:
        wait_until(lambda: len(seen) >= 2, 10, what="the redelivery")
    finally:
        c.close()
    assert [a for a, _ in seen] == [1, 2]
    assert seen[1][1] - seen[0][1] >= 0.4, "REQ delay not honoured"
    assert c.stats().messages_requeued == 1


def test_touch_keeps_message_and_late_finish(any_broker: BrokerProcess) -> None:
    topic = unique_name("cli_touch")
    attempts: list[int] = []
    held: list[Message] = []

    def handler(msg: Message) -> None:
        attempts.append(msg.attempts)
        msg.disable_auto_response()
        held.append(msg)

    with Producer(any_broker.tcp_hostport) as p:
        p.publish(topic, b"slow")
    c = Consumer(topic, "ch", handler, msg_timeout=1.0)
    c.connect_to_nsqd(any_broker.tcp_hostport)
    try:
        wait_until(lambda: held, 5, what="the message")
        deadline = time.monotonic() + 2.5        # 2.5 x the 1 s msg_timeout
        while time.monotonic() < deadline:
            held[0].touch()
            time.sleep(0.3)
        held[0].finish()
        held[0].finish()                         # a second response is ignored
        wait_all_finished(any_broker, topic, "ch")   # the FIN reached the server
    finally:
        c.close()
    assert attempts == [1], "TOUCH did not keep the message in flight"
    assert c.stats().messages_finished == 1


def test_close_drains_in_flight(any_broker: BrokerProcess) -> None:
    topic = unique_name("cli_cls")
    held: list[Message] = []

    def handler(msg: Message) -> None:
        msg.disable_auto_response()
        held.append(msg)

    with Producer(any_broker.tcp_hostport) as p:
        p.publish(topic, b"pending")
    c = Consumer(topic, "ch", handler, max_in_flight=5)
    c.connect_to_nsqd(any_broker.tcp_hostport)
    wait_until(lambda: held, 5, what="the message")
    conn = c.conns()[0]
    c.stop()
    wait_until(lambda: conn.close_wait, 5, what="CLOSE_WAIT")
    assert not c.wait(0.3), "stopped while a message was in flight"
    assert not conn.is_closed
    held[0].finish()
    assert c.wait(5), "did not stop after the last message was finished"
    assert conn.is_closed
    # the FIN reached the server: nothing is left to redeliver to a next consumer
    wait_all_finished(any_broker, topic, "ch")


def test_heartbeats_answered(make_broker: Any, broker_kind: str) -> None:
    b = make_broker(kind=broker_kind)
    topic = unique_name("cli_hb")
    c = Consumer(topic, "ch", lambda m: None, heartbeat_interval=1.0)
    c.connect_to_nsqd(b.tcp_hostport)
    p = Producer(b.tcp_hostport, heartbeat_interval=1.0)
    try:
        p.connect()
        conn = c.conns()[0]
        wait_until(lambda: conn.heartbeats >= 3, 6, what="three heartbeats")
        assert not conn.is_closed and c.conns() == [conn]
        assert p.is_connected and p.connects == 1
        p.publish(topic, b"still here")
        wait_until(lambda: c.stats().messages_finished == 1, 5, what="delivery")
    finally:
        p.stop()
        c.close()


def test_identify_fields_visible_in_stats(any_broker: BrokerProcess) -> None:
    assert any_broker.http_address is not None, "both brokers serve HTTP (client stats)"
    topic = unique_name("cli_ident")
    c = Consumer(topic, "ch", lambda m: None, client_id="cid-42", user_agent="ua-test/1.0",
                 max_in_flight=7)
    c.connect_to_nsqd(any_broker.tcp_hostport)
    try:
        url = (f"http://{any_broker.http_hostport}/stats?format=json&topic={topic}"
               f"&channel=ch")

        def client() -> dict[str, Any] | None:
            with urllib.request.urlopen(url, timeout=5) as r:
                data = json.loads(r.read())
            for t in data["topics"]:
                for ch in t["channels"]:
                    for cl in ch["clients"]:
                        if cl["client_id"] == "cid-42" and cl["ready_count"] == 7:
                            return dict(cl)
            return None

        cl = wait_until(client, 5, what="the client in /stats")
        assert isinstance(cl, dict)
        assert cl["user_agent"] == "ua-test/1.0"
    finally:
        c.close()


def test_large_bodies_round_trip(any_broker: BrokerProcess) -> None:
    topic = unique_name("cli_large")
    big = bytes(range(256)) * 3600                      # 900 KiB, under max-msg-size
    batch = [bytes([i]) * 400_000 for i in range(10)]   # a 4 MB MPUB, under max-body-size
    got = Collector()
    with Producer(any_broker.tcp_hostport) as p:
        futs = [p.publish_async(topic, big), p.multi_publish_async(topic, batch),
                p.publish_async(topic, b"small")]
        assert [f.result(20) for f in futs] == [b"OK"] * 3
        with pytest.raises(ProtocolError) as ei:
            p.publish(topic, b"x" * (1024 * 1024 + 1))       # over nsqd's 1 MiB default
        assert ei.value.code == "E_BAD_MESSAGE"
    c = Consumer(topic, "ch", got, max_in_flight=20)
    c.connect_to_nsqd(any_broker.tcp_hostport)
    try:
        wait_until(lambda: got.count() >= 12, 15, what="12 messages")
    finally:
        c.close()
    assert got.bodies() == [big, *batch, b"small"]


def test_rdy_clamped_to_server_max_rdy_count(make_broker: Any, broker_kind: str) -> None:
    b = make_broker("--max-rdy-count=50", kind=broker_kind)
    topic = unique_name("cli_maxrdy")
    got = Collector()
    c = Consumer(topic, "ch", got, max_in_flight=200)
    c.connect_to_nsqd(b.tcp_hostport)
    try:
        conn = c.conns()[0]
        assert conn.max_rdy_count == 50
        assert conn.rdy_count == 50, "RDY above the server's max-rdy-count is fatal"
        with Producer(b.tcp_hostport) as p:
            p.multi_publish(topic, [b"%d" % i for i in range(300)])
        wait_until(lambda: got.count() >= 300, 10, what="300 messages")
        assert not conn.is_closed
    finally:
        c.close()


def test_concurrent_handlers(any_broker: BrokerProcess) -> None:
    topic = unique_name("cli_conc")
    lock = threading.Lock()
    active, peak, done = [0], [0], [0]

    def handler(msg: Message) -> None:
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.05)
        with lock:
            active[0] -= 1
            done[0] += 1

    with Producer(any_broker.tcp_hostport) as p:
        p.multi_publish(topic, [b"%d" % i for i in range(40)])
    c = Consumer(topic, "ch", handler, max_in_flight=8, concurrency=4)
    c.connect_to_nsqd(any_broker.tcp_hostport)
    try:
        wait_until(lambda: done[0] == 40, 10, what="40 messages")
    finally:
        c.close()
    assert peak[0] == 4
    assert c.stats().messages_finished == 40


def test_inline_handler_runs_on_the_loop_thread(any_broker: BrokerProcess) -> None:
    """inline=True: no handler threads; the loop's own thread runs the handler, FINs on
    return, REQs on an exception (attempts counted as with threads), and a clean stop
    drains it as with threads."""
    topic = unique_name("cli_inline")
    threads: set[str] = set()
    seen: list[tuple[bytes, int]] = []

    def handler(msg: Message) -> None:
        threads.add(threading.current_thread().name)
        seen.append((msg.body, msg.attempts))
        if msg.body == b"fail-once" and msg.attempts == 1:
            raise RuntimeError("first try fails")

    before = {t.name for t in threading.enumerate()}
    with Producer(any_broker.tcp_hostport) as p:
        p.multi_publish(topic, [b"m%d" % i for i in range(200)] + [b"fail-once"])
    c = Consumer(topic, "ch", handler, inline=True, max_in_flight=1,
                 default_requeue_delay=0.1, backoff_multiplier=0.01)
    assert not any(t.name.startswith("nsq-handler") for t in threading.enumerate()
                   if t.name not in before), "inline consumer started handler threads"
    c.connect_to_nsqd(any_broker.tcp_hostport)
    try:
        wait_until(lambda: len(seen) >= 202, 20, what="202 deliveries")
        wait_all_finished(any_broker, topic, "ch")
    finally:
        c.close()
    assert c.stopped.is_set()
    assert threads == {f"nsq-consumer-{topic}"}, threads
    bodies = [b for b, _ in seen]
    assert sorted(set(bodies)) == sorted([b"m%d" % i for i in range(200)] + [b"fail-once"])
    assert [a for b, a in seen if b == b"fail-once"] == [1, 2]
    assert len(bodies) == 202, "a finished message was delivered again"
    st = c.stats()
    assert (st.messages_finished, st.messages_requeued) == (201, 1)


def test_inline_handler_not_beside_threads() -> None:
    c = Consumer("t_inline_mix", "ch", lambda m: None)
    try:
        with pytest.raises(RuntimeError, match="handlers already added"):
            c.add_inline_handler(lambda m: None)
    finally:
        c.close()
