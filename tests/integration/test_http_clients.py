"""A real third-party NSQ HTTP client drives the broker: gnsq's NsqdHTTPClient publishes
(PUB, text and binary MPUB, deferred), manages topics and channels, and reads /stats,
/ping and /info, over one urllib3 keep-alive pool. Against pybroker and, when found, nsqd.
"""
from __future__ import annotations

import time

import gnsq  # type: ignore[import-untyped]
import gnsq.errors  # type: ignore[import-untyped]
import pytest

from tests.support.broker import BrokerProcess, unique_name, wait_until
from tests.support.wire import WireClient


@pytest.fixture
def client(any_broker: BrokerProcess) -> gnsq.NsqdHTTPClient:
    host, port = any_broker.http_address  # type: ignore[misc]
    return gnsq.NsqdHTTPClient(host, port)


def topic_stats(client: gnsq.NsqdHTTPClient, topic: str) -> dict:  # type: ignore[type-arg]
    data = client.stats(topic=topic)
    (t,) = data["topics"]
    assert t["topic_name"] == topic
    return t  # type: ignore[no-any-return]


def test_gnsq_publish_and_consume(any_broker: BrokerProcess,
                                  client: gnsq.NsqdHTTPClient) -> None:
    topic = unique_name("gh")
    assert any_broker.tcp_address
    with WireClient.connect(any_broker.tcp_address) as c:
        c.sub(topic, "ch")
        c.rdy(50)
        assert client.publish(topic, b"single") == b"OK"
        assert client.multipublish(topic, [b"t1", b"t2", b"t3"]) == b"OK"
        assert client.multipublish(topic, [b"b\n1", b"b\x002"], binary=True) == b"OK"
        sent = time.monotonic()
        assert client.publish(topic, b"deferred", defer=500) == b"OK"
        got = [m.body for m in c.read_messages(6)]
        assert got == [b"single", b"t1", b"t2", b"t3", b"b\n1", b"b\x002"]
        # nsqd's queue scanner learns of new channels every 5 s (its
        # QueueScanRefreshInterval): a deferred message in a channel made since then
        # waits for that refresh before its 100 ms scans see it
        assert c.read_message(timeout=15).body == b"deferred"
        assert time.monotonic() - sent >= 0.5
    t = topic_stats(client, topic)
    assert t["message_count"] == 7


def test_gnsq_topics_and_channels(client: gnsq.NsqdHTTPClient) -> None:
    topic = unique_name("ghm")
    client.create_topic(topic)
    client.create_channel(topic, "c1")
    client.create_channel(topic, "c2")
    client.multipublish(topic, [b"x", b"y"])
    t = topic_stats(client, topic)
    assert [c["channel_name"] for c in t["channels"]] == ["c1", "c2"]
    assert [c["depth"] for c in t["channels"]] == [2, 2]
    client.pause_channel(topic, "c1")
    client.pause_topic(topic)
    t = topic_stats(client, topic)
    assert t["paused"] and t["channels"][0]["paused"] and not t["channels"][1]["paused"]
    client.unpause_topic(topic)
    client.unpause_channel(topic, "c1")
    client.empty_channel(topic, "c1")
    t = topic_stats(client, topic)
    assert [c["depth"] for c in t["channels"]] == [0, 2] and not t["paused"]
    client.delete_channel(topic, "c1")
    assert [c["channel_name"] for c in topic_stats(client, topic)["channels"]] == ["c2"]
    client.empty_topic(topic)
    client.delete_topic(topic)
    assert client.stats(topic=topic)["topics"] is None
    with pytest.raises(gnsq.errors.NSQHttpError) as e:
        client.delete_topic(topic)
    assert "<404>" in str(e.value)
    with pytest.raises(gnsq.errors.NSQHttpError) as e:
        client.create_channel(unique_name("ghnone"), "c")
    assert "<404>" in str(e.value)


def test_gnsq_ping_info_and_text_stats(any_broker: BrokerProcess,
                                       client: gnsq.NsqdHTTPClient) -> None:
    assert client.ping() == b"OK"
    info = client.info()
    assert info["version"] == "1.3.0"
    assert info["tcp_port"] == any_broker.tcp_address[1]  # type: ignore[index]
    topic = unique_name("ght")
    client.publish(topic, b"x")
    text = client.stats(topic=topic, text=True)
    assert f"[{topic:<15}] depth: 1 ".encode() in text


def test_gnsq_many_requests_on_one_pool(client: gnsq.NsqdHTTPClient) -> None:
    topic = unique_name("ghp")
    for i in range(200):
        client.publish(topic, b"%d" % i)
    wait_until(lambda: topic_stats(client, topic)["message_count"] == 200,
               what="200 messages")
