"""gnsq (gevent) against the broker: 10,000 messages published with PUB, MPUB and DPUB
and consumed with max_in_flight=50, each exactly once; server errors raised as gnsq's
E_* exception classes.

gnsq uses gevent's own sockets and primitives, so it runs here cooperatively in the
test's thread WITHOUT monkey-patching (patching would change the whole pytest process).
Waiting is done with gevent.sleep, which lets gnsq's greenlets run.
"""
from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import gevent
import gnsq
import gnsq.errors
import pytest

from tests.support.broker import BrokerProcess, unique_name
from tests.support.each_once import DEADLINE_S, QUIET_S, assert_each_once, green_wait, workload

WORK = workload()      # 10,000 messages: PUB, MPUB and DPUB


@pytest.mark.timeout(180)
def test_gnsq_ten_thousand_messages_each_once(any_broker: BrokerProcess) -> None:
    addr = any_broker.tcp_hostport
    topic = unique_name("gnsq")
    received: Counter[bytes] = Counter()
    consumer = gnsq.Consumer(topic, "ch", nsqd_tcp_addresses=[addr], max_in_flight=50)

    def handler(_consumer: Any, message: Any) -> None:
        received[message.body] += 1  # gnsq FINs after a handler returns normally

    consumer.on_message.connect(handler, weak=False)

    producer = gnsq.Producer(nsqd_tcp_addresses=[addr])
    try:
        consumer.start(block=False)
        producer.start()
        results = [producer.publish(topic, body, raise_error=False) for body in WORK.pubs]
        results += [producer.multipublish(topic, batch, raise_error=False)
                    for batch in WORK.batches]
        results += [producer.publish(topic, body, defer=delay, raise_error=False)
                    for delay, body in WORK.dpubs]
        answers = [r.get(timeout=DEADLINE_S) for r in results]
        assert answers == [b"OK"] * len(results)
        green_wait(lambda: len(received) >= WORK.total, "all messages", DEADLINE_S)
        gevent.sleep(QUIET_S)  # room for any duplicate delivery to show up
    finally:
        producer.close()
        consumer.close()
        producer.join(5)
        consumer.join(5)
    assert_each_once(received, WORK.expected())


@pytest.mark.parametrize("kwargs, exc_class, text", [
    ({"data": b"too late", "defer": 3_600_001}, gnsq.errors.NSQInvalid,
     "DPUB timeout 3600001 out of range 0-3600000"),
    ({"data": b""}, gnsq.errors.NSQBadMessage, "PUB invalid message body size 0"),
])
def test_gnsq_raises_error_classes(any_broker: BrokerProcess, kwargs: dict[str, Any],
                                   exc_class: type[Exception], text: str,
                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.CRITICAL)
    producer = gnsq.Producer(nsqd_tcp_addresses=[any_broker.tcp_hostport])
    try:
        producer.start()
        with pytest.raises(exc_class) as info:
            producer.publish(unique_name(), timeout=10, **kwargs)
        assert text in str(info.value), str(info.value)
    finally:
        producer.close()
        producer.join(5)


def test_gnsq_tcp_client_finish_failed_is_not_fatal(any_broker: BrokerProcess) -> None:
    """gnsq's low-level client reports NSQFinishFailed (not fatal) for an unknown id and
    the connection goes on."""
    topic = unique_name("gnsq")
    assert any_broker.tcp_address is not None
    client = gnsq.NsqdTCPClient(*any_broker.tcp_address)
    try:
        client.connect()
        client.identify()
        client.publish(topic, b"after")
        assert client.read_response() == (0, b"OK")
        client.subscribe(topic, "ch")
        assert client.read_response() == (0, b"OK")
        client.finish(b"0123456789abcdef")
        frame, error = client.read_response()
        assert frame == 1 and isinstance(error, gnsq.errors.NSQFinishFailed), error
        assert not error.fatal and client.is_connected
        client.ready(1)
        frame, message = client.read_response()
        assert frame == 2 and message.body == b"after" and message.attempts == 1
        client.finish(message.id)
        client.nop()
    finally:
        client.close_stream()
