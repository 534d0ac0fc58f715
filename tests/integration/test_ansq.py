"""ansq (asyncio) against the broker: 10,000 messages published with PUB, MPUB and DPUB
and consumed with RDY 50 on one connection, each exactly once; errors as ansq shows them.

ansq's Reader keeps RDY=1 per connection, so the consumer here is ansq's own
NSQConnection with subscribe(..., messages_count=50), which is how ansq users get a
max_in_flight above one. asyncio is used by the test only, never by pybroker.
"""
from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any

import ansq
import pytest

from tests.support.broker import BrokerProcess, unique_name
from tests.support.each_once import DEADLINE_S, QUIET_S, assert_each_once, workload

WORK = workload()      # 10,000 messages: PUB, MPUB and DPUB
CHUNK = 500  # publish commands in flight at once


async def consume(conn: Any, received: Counter[bytes]) -> None:
    async for message in conn.messages():
        received[message.body] += 1
        await message.fin()
        if len(received) >= WORK.total:
            return


async def publish_and_consume(host: str, port: int, topic: str
                              ) -> tuple[list[Any], Counter[bytes]]:
    received: Counter[bytes] = Counter()
    reader = await ansq.open_connection(host, port)
    writer = await ansq.create_writer(nsqd_tcp_addresses=[f"{host}:{port}"])
    await reader.subscribe(topic, "ch", 50)
    try:
        consumer = asyncio.create_task(consume(reader, received))
        calls = ([writer.pub(topic, body) for body in WORK.pubs]
                 + [writer.mpub(topic, *batch) for batch in WORK.batches]
                 + [writer.dpub(topic, body, delay) for delay, body in WORK.dpubs])
        responses: list[Any] = []
        for start in range(0, len(calls), CHUNK):
            responses += await asyncio.wait_for(
                asyncio.gather(*calls[start:start + CHUNK]), DEADLINE_S)
        await asyncio.wait_for(consumer, DEADLINE_S)
        await asyncio.sleep(QUIET_S)  # room for any duplicate delivery to show up
        assert reader.message_queue.qsize() == 0, "a message was delivered twice"
    finally:
        await writer.close()
        await reader.close()
    return responses, received


@pytest.mark.timeout(180)
def test_ansq_ten_thousand_messages_each_once(any_broker: BrokerProcess) -> None:
    host, port = any_broker.tcp_address or ("", 0)
    responses, received = asyncio.run(publish_and_consume(host, port, unique_name("ansq")))
    assert len(responses) == WORK.n_commands
    bad = [r for r in responses if not (r.is_response and r.body == b"OK")]
    assert not bad, bad[:5]
    assert_each_once(received, WORK.expected())


async def bad_dpub(host: str, port: int) -> tuple[Any, bool]:
    conn = await ansq.open_connection(host, port, connection_options=ansq.ConnectionOptions(
        auto_reconnect=False))
    try:
        response = await conn.dpub(unique_name(), b"too late", 3_600_001)
        deadline = asyncio.get_running_loop().time() + 5
        while conn.is_connected and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        return response, conn.is_connected
    finally:
        await conn.close()


def test_ansq_sees_error_response_and_close(any_broker: BrokerProcess,
                                            caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.CRITICAL)
    host, port = any_broker.tcp_address or ("", 0)
    response, still_connected = asyncio.run(bad_dpub(host, port))
    assert response.is_error and not response
    assert response.code == "E_INVALID"
    assert response.body.startswith(b"DPUB timeout 3600001 out of range 0-3600000"), response
    assert not still_connected, "a fatal error must close the connection"
