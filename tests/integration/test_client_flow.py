"""Consumer flow control against real servers: RDY spread, backoff, max_attempts, redistribution.

Each test runs against pybroker and, when one is found, a real nsqd.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

import pytest

from pybroker.client import Conn, Consumer, Message, Producer
from tests.support.broker import BrokerProcess, unique_name, wait_until
from tests.support.http import wait_all_finished

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=["pybroker", "nsqd"])
def broker_kind(request: pytest.FixtureRequest) -> str:
    """Which server ``make_broker`` starts; nsqd tests skip when no binary is found."""
    return str(request.param)


class BatchHolder:
    """Holds each connection's messages until it has RDY of them, then FINs them all.

    Holding makes the server fill every connection up to its RDY, so a server that
    sends more than RDY allows is caught: the client's in-flight count (received and
    not yet FIN'd) can never exceed RDY unless the server over-delivers.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.conns: dict[str, Conn] = {}
        self.held: dict[str, list[Message]] = {}
        self.last: dict[str, float] = {}
        self.bodies: list[bytes] = []
        self.per_conn: dict[str, int] = {}
        self.violations: list[str] = []
        self.max_seen: dict[str, int] = {}
        self._stop = threading.Event()
        self._flusher = threading.Thread(target=self._flush_idle, daemon=True)
        self._flusher.start()

    def __call__(self, msg: Message) -> None:
        msg.disable_auto_response()
        addr = msg.nsqd_address
        conn = self.conns[addr]
        batch: list[Message] = []
        with self.lock:
            self.bodies.append(msg.body)
            self.per_conn[addr] = self.per_conn.get(addr, 0) + 1
            in_flight, rdy = conn.in_flight, conn.rdy_count
            self.max_seen[addr] = max(self.max_seen.get(addr, 0), in_flight)
            if in_flight > rdy:
                self.violations.append(f"{addr}: {in_flight} in flight > RDY {rdy}")
            held = self.held.setdefault(addr, [])
            held.append(msg)
            self.last[addr] = time.monotonic()
            if len(held) >= rdy:
                batch, self.held[addr] = held, []
        for m in batch:
            m.finish()

    def _flush_idle(self) -> None:
        while not self._stop.wait(0.02):
            now = time.monotonic()
            batch: list[Message] = []
            with self.lock:
                for addr, held in self.held.items():
                    if held and now - self.last[addr] > 0.05:
                        batch += held
                        self.held[addr] = []
            for m in batch:
                m.finish()

    def stop(self) -> None:
        self._stop.set()
        self._flusher.join(2)


def test_10000_messages_spread_over_three_servers(make_broker: Callable[..., BrokerProcess],
                                                   broker_kind: str) -> None:
    brokers = [make_broker(kind=broker_kind) for _ in range(3)]
    topic = unique_name("flow_10k")
    holder = BatchHolder()
    rdy_log: list[tuple[str, int, int]] = []      # (address, count, total RDY after)

    def on_rdy(conn: Conn, count: int) -> None:
        rdy_log.append((conn.address, count, consumer.flow.total_rdy_count))

    consumer = Consumer(topic, "ch", holder, max_in_flight=30, on_rdy=on_rdy)
    try:
        for b in brokers:
            consumer.connect_to_nsqd(b.tcp_hostport)
            holder.conns[b.tcp_hostport] = consumer.conns()[-1]
        conns = consumer.conns()
        assert len(conns) == 3
        assert [c.rdy_count for c in conns] == [10, 10, 10], "max_in_flight 30 / 3 connections"
        assert all(total <= 30 for _, _, total in rdy_log), rdy_log
        settled = len(rdy_log)

        bodies = [b"%05d" % i for i in range(10_000)]
        for i, b in enumerate(brokers):
            part = bodies[i::3]
            with Producer(b.tcp_hostport) as p:
                for j in range(0, len(part), 500):
                    p.multi_publish(topic, part[j:j + 500])
        wait_until(lambda: len(holder.bodies) >= 10_000, 30, interval_s=0.05,
                   what="10,000 messages")
        wait_until(lambda: consumer.stats().messages_finished >= 10_000, 5, what="all FINs")
    finally:
        consumer.close()
        holder.stop()
    assert holder.violations == []
    assert sorted(holder.bodies) == bodies, "lost or duplicated messages"
    assert all(holder.per_conn[b.tcp_hostport] in (3333, 3334) for b in brokers)
    # every connection was filled up to, and never past, its share
    assert all(holder.max_seen[b.tcp_hostport] == 10 for b in brokers), holder.max_seen
    assert {count for _, count, _ in rdy_log[settled:]} <= {10}, "RDY above the share"
    assert all(total <= 30 for _, _, total in rdy_log)


def test_backoff_rdy_zero_then_one_then_full(any_broker: BrokerProcess) -> None:
    topic = unique_name("flow_backoff")
    events: list[tuple[float, int]] = []
    failed = threading.Event()

    def handler(msg: Message) -> None:
        if not failed.is_set():
            failed.set()
            raise RuntimeError("fail once")

    with Producer(any_broker.tcp_hostport) as p:
        p.multi_publish(topic, [b"m%d" % i for i in range(20)])
    c = Consumer(topic, "ch", handler, max_in_flight=5, backoff_multiplier=0.1,
                 default_requeue_delay=0,
                 on_rdy=lambda conn, n: events.append((time.monotonic(), n)))
    c.connect_to_nsqd(any_broker.tcp_hostport)
    try:
        wait_until(lambda: c.stats().messages_finished >= 20, 15, what="20 FINs")
    finally:
        c.close()
    counts = [n for _, n in events]
    assert counts[0] == 5
    i0 = counts.index(0)
    assert counts[i0 + 1] == 1, f"no trial RDY 1 after RDY 0: {counts}"
    assert counts[i0 + 2] == 5, f"no return to full RDY after the trial: {counts}"
    waited = events[i0 + 1][0] - events[i0][0]
    assert waited >= 0.19, f"trial RDY 1 after {waited:.3f}s, backoff was 0.2s"
    assert 0 not in counts[i0 + 1:], "backed off again without a failure"
    stats = c.stats()
    assert stats.messages_requeued == 1 and stats.messages_finished == 20


class GivingUpHandler:
    """Always fails; records attempts and the give-up call (go-nsq's FailedMessageLogger)."""

    def __init__(self) -> None:
        self.attempts: list[int] = []
        self.given_up: list[Message] = []

    def __call__(self, msg: Message) -> None:
        self.attempts.append(msg.attempts)
        raise RuntimeError("always fails")

    def log_failed_message(self, msg: Message) -> None:
        self.given_up.append(msg)


def test_max_attempts_gives_up_and_finishes(any_broker: BrokerProcess) -> None:
    topic = unique_name("flow_attempts")
    handler = GivingUpHandler()
    with Producer(any_broker.tcp_hostport) as p:
        p.publish(topic, b"poison")
    c = Consumer(topic, "ch", handler, max_attempts=3, default_requeue_delay=0,
                 backoff_multiplier=0.01, msg_timeout=1.0)
    c.connect_to_nsqd(any_broker.tcp_hostport)
    try:
        wait_until(lambda: handler.given_up, 15, what="the give-up hook")
        wait_all_finished(any_broker, topic, "ch")      # given up means FIN'd
    finally:
        c.close()
    assert handler.attempts == [1, 2, 3]
    assert [m.attempts for m in handler.given_up] == [4]
    assert handler.given_up[0].body == b"poison"
    assert c.stats().messages_finished == 1


def test_give_up_hook_argument(any_broker: BrokerProcess) -> None:
    topic = unique_name("flow_giveup")
    gave_up: list[int] = []
    calls: list[int] = []

    def handler(msg: Message) -> None:
        calls.append(msg.attempts)
        raise RuntimeError("fails")

    with Producer(any_broker.tcp_hostport) as p:
        p.publish(topic, b"x")
    c = Consumer(topic, "ch", handler, max_attempts=1, default_requeue_delay=0,
                 backoff_multiplier=0.01, on_give_up=lambda m: gave_up.append(m.attempts))
    c.connect_to_nsqd(any_broker.tcp_hostport)
    try:
        wait_until(lambda: gave_up, 10, what="the give-up hook")
    finally:
        c.close()
    assert calls == [1] and gave_up == [2]


def test_rdy_redistributed_to_the_busy_connection(make_broker: Callable[..., BrokerProcess],
                                                  broker_kind: str) -> None:
    idle, busy = make_broker(kind=broker_kind), make_broker(kind=broker_kind)
    topic = unique_name("flow_redist")
    totals: list[int] = []
    got: list[str] = []
    consumer: Any = None

    def on_rdy(conn: Conn, count: int) -> None:
        totals.append(sum(c.rdy_count for c in consumer.conns()))

    consumer = Consumer(topic, "ch", lambda m: got.append(m.nsqd_address), max_in_flight=1,
                        rdy_redistribute_interval=0.1, low_rdy_idle_timeout=0.3,
                        on_rdy=on_rdy)
    try:
        consumer.connect_to_nsqd(idle.tcp_hostport)
        consumer.connect_to_nsqd(busy.tcp_hostport)
        by_addr = {c.address: c for c in consumer.conns()}
        assert by_addr[idle.tcp_hostport].rdy_count == 1
        assert by_addr[busy.tcp_hostport].rdy_count == 0, "RDY 1 twice with max_in_flight 1"
        with Producer(busy.tcp_hostport) as p:
            p.multi_publish(topic, [b"%d" % i for i in range(20)])
        wait_until(lambda: len(got) >= 20, 15, what="20 messages from the busy server")
    finally:
        consumer.close()
    assert set(got) == {busy.tcp_hostport}
    assert max(totals) <= 1, f"total RDY above max_in_flight: {totals}"


def test_change_max_in_flight_pauses_and_resumes(any_broker: BrokerProcess) -> None:
    topic = unique_name("flow_change")
    got: list[bytes] = []
    rdys: list[int] = []
    c = Consumer(topic, "ch", lambda m: got.append(m.body), max_in_flight=4,
                 on_rdy=lambda conn, n: rdys.append(n))
    c.connect_to_nsqd(any_broker.tcp_hostport)
    try:
        c.change_max_in_flight(0)                 # go-nsq: ChangeMaxInFlight(0) pauses
        assert rdys == [4, 0] and c.conns()[0].rdy_count == 0
        with Producer(any_broker.tcp_hostport) as p:
            p.multi_publish(topic, [b"%d" % i for i in range(10)])
        time.sleep(0.5)
        assert got == [], "messages delivered with RDY 0"
        c.change_max_in_flight(2)
        wait_until(lambda: len(got) == 10, 10, what="delivery after resuming")
        assert max(rdys[2:]) == 2
    finally:
        c.close()


def test_max_in_flight_1_one_rdy_for_a_backlog(any_broker: BrokerProcess) -> None:
    """RDY caps in-flight messages on the server: RDY 1 once drains a whole backlog.

    The consumer sends RDY only when its count changes (not after every delivery), so
    a server that used RDY up per message would stop after the first one here. The
    handler runs on the handler thread, never on the IO loop's.
    """
    topic = unique_name("flow_mif1")
    bodies = [b"%04d" % i for i in range(2000)]
    with Producer(any_broker.tcp_hostport) as p:
        p.multi_publish(topic, bodies)
    got: list[bytes] = []
    threads: set[str] = set()
    rdys: list[int] = []

    def handler(msg: Message) -> None:
        threads.add(threading.current_thread().name)
        got.append(msg.body)

    c = Consumer(topic, "ch", handler, max_in_flight=1,
                 on_rdy=lambda conn, n: rdys.append(n))
    c.connect_to_nsqd(any_broker.tcp_hostport)
    try:
        wait_until(lambda: len(got) >= len(bodies), 30, what="the backlog at max_in_flight 1")
        wait_until(lambda: c.stats().messages_finished >= len(bodies), 5, what="every FIN")
        wait_all_finished(any_broker, topic, "ch")
    finally:
        c.close()
    assert sorted(got) == bodies, "lost or duplicated messages"
    assert rdys == [1], "RDY sent again though its count never changed"
    assert threads == {f"nsq-handler-{topic}-0"}, threads
