"""pynsq (tornado) against the broker: 10,000 messages published with PUB, MPUB and DPUB
and consumed with max_in_flight=50, each exactly once; errors as a pynsq user sees them.

The tornado IOLoop runs on asyncio inside asyncio.run(), with a deadline.
"""
from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any

import nsq
import pytest

from tests.support.broker import BrokerProcess, unique_name
from tests.support.each_once import DEADLINE_S, QUIET_S, assert_each_once, workload
from tests.support.each_once import async_wait as wait_for

WORK = workload()      # 10,000 messages: PUB, MPUB and DPUB


async def publish_and_consume(addr: str, topic: str) -> tuple[list[Any], Counter[bytes]]:
    received: Counter[bytes] = Counter()

    def handler(message: nsq.Message) -> bool:
        received[message.body] += 1
        return True  # FIN

    reader = nsq.Reader(topic=topic, channel="ch", message_handler=handler,
                        nsqd_tcp_addresses=[addr], max_in_flight=50)
    writer = nsq.Writer([addr])
    responses: list[Any] = []

    def on_response(conn: Any, data: Any) -> None:
        responses.append(data)

    try:
        await wait_for(lambda: writer.conns, "the writer to connect")
        for body in WORK.pubs:
            writer.pub(topic, body, callback=on_response)
        for batch in WORK.batches:
            writer.mpub(topic, batch, callback=on_response)
        for delay_ms, body in WORK.dpubs:
            writer.dpub(topic, delay_ms, body, callback=on_response)
        await wait_for(lambda: len(responses) >= WORK.n_commands, "publish responses",
                       DEADLINE_S)
        await wait_for(lambda: len(received) >= WORK.total, "all messages", DEADLINE_S)
        await asyncio.sleep(QUIET_S)  # room for any duplicate delivery to show up
    finally:
        reader.close()
        for conn in list(writer.conns.values()):
            conn.close()
    return responses, received


@pytest.mark.timeout(180)
def test_pynsq_ten_thousand_messages_each_once(any_broker: BrokerProcess) -> None:
    topic = unique_name("pynsq")
    responses, received = asyncio.run(publish_and_consume(any_broker.tcp_hostport, topic))
    assert responses == [b"OK"] * WORK.n_commands
    assert_each_once(received, WORK.expected())


async def publish_errors(addr: str) -> list[Any]:
    writer = nsq.Writer([addr], reconnect_interval=60.0)
    results: list[Any] = []
    try:
        await wait_for(lambda: writer.conns, "the writer to connect")
        writer.dpub(unique_name(), 3_600_001, b"too late",
                    callback=lambda conn, data: results.append(data))
        await wait_for(lambda: results, "the DPUB answer")
        await wait_for(lambda: not writer.conns, "the server to close the connection")
    finally:
        for conn in list(writer.conns.values()):
            conn.close()
    return results


def test_pynsq_sees_fatal_error(any_broker: BrokerProcess,
                                caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.CRITICAL, logger="nsq")
    results = asyncio.run(publish_errors(any_broker.tcp_hostport))
    assert len(results) == 1
    error = results[0]
    assert isinstance(error, nsq.Error), error
    assert "E_INVALID DPUB timeout 3600001 out of range 0-3600000" in str(error), str(error)
