"""Read amplification, as an operator sees it in /stats (``log_bytes_read``, a topic's
bytes read back from its segment files) and /metrics: a backlog on disk drained at RDY 1
by several consumers reads each byte about once (a channel's cursor reads ahead and
keeps its batch; before, every dispatch re-read a 256 KiB chunk from the sparse index),
and so do /topic/read pages read one after the other (the logread thread keeps the
cursor a page ended with), also when several readers page through their own ranges at
once, as the Spark source's executors do (its LogClient, stdlib only, no Spark needed).

Consumers are raw sockets (tests/support/wire.py encodes every command) served by one
selector in the test, so the broker, not the client, sets the pace.
"""
from __future__ import annotations

import json
import selectors
import socket
import struct
import time
import urllib.request
from typing import Any

from pybroker.spark.log_client import LogClient
from tests.support import wire
from tests.support.broker import BrokerProcess, unique_name
from tests.support.wire import WireClient

MESSAGES = 200_000
BODY = 200
FRAME = 4 + 4 + 8 + 2 + 16 + BODY     # a message frame on the wire
CONSUMERS = 32   # as bench_io's rdy1: more at once drain faster (the broker sets the pace)
_HEAD = struct.Struct(">ii")


def topic_stats(b: BrokerProcess, topic: str) -> dict[str, Any]:
    url = f"http://{b.http_hostport}/stats?format=json&topic={topic}"
    with urllib.request.urlopen(url, timeout=10) as r:
        doc = json.load(r)
    for t in doc["topics"]:
        if t["topic_name"] == topic:
            return dict(t)
    raise AssertionError(f"no topic {topic} in /stats")


def metric(b: BrokerProcess, name: str, topic: str) -> float:
    with urllib.request.urlopen(f"http://{b.http_hostport}/metrics", timeout=10) as r:
        text = r.read().decode()
    want = f'{name}{{topic="{topic}"}} '
    for line in text.splitlines():
        if line.startswith(want):
            return float(line[len(want):])
    raise AssertionError(f"{want!r} not in /metrics")


def publish(b: BrokerProcess, topic: str, n: int) -> None:
    with WireClient.connect(b.tcp_address) as c:  # type: ignore[arg-type]
        for k in range(0, n, 500):
            c.mpub(topic, [b"%08d" % (k + i) + b"x" * (BODY - 8) for i in range(500)])


def drain_rdy1(b: BrokerProcess, topic: str, n: int, timeout_s: float = 240) -> int:
    """CONSUMERS connections at RDY 1 FIN every message until n were received;
    returns the bytes of message frames received."""
    sel = selectors.DefaultSelector()
    socks = []
    for _ in range(CONSUMERS):
        s = socket.create_connection(b.tcp_address, timeout=10)
        s.sendall(wire.MAGIC_V2)
        s.sendall(wire.sub(topic, "ch"))
        kind, data = wire.read_frame(s)
        assert (kind, data) == (0, b"OK"), data
        s.sendall(wire.rdy(1))
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ, bytearray())
        socks.append(s)
    got = nbytes = 0
    seen = bytearray(n)          # each message once: no timeouts, no redeliveries
    deadline = time.monotonic() + timeout_s
    try:
        while got < n:
            assert time.monotonic() < deadline, f"drained {got} of {n}"
            for key, _ in sel.select(1.0):
                s, buf = key.fileobj, key.data
                assert isinstance(s, socket.socket)
                chunk = s.recv(65536)
                assert chunk, "the broker closed a consumer"
                buf += chunk
                pos = 0
                fins = []
                while len(buf) - pos >= 8:
                    size, kind = _HEAD.unpack_from(buf, pos)
                    if len(buf) - pos < 4 + size:
                        break
                    if kind == 2:
                        msg_id = bytes(buf[pos + 18:pos + 34])
                        i = int(bytes(buf[pos + 34:pos + 42]))
                        assert not seen[i], f"message {i} delivered twice"
                        seen[i] = 1
                        fins.append(wire.fin(msg_id))
                        got += 1
                        nbytes += 4 + size
                    elif bytes(buf[pos + 8:pos + 4 + size]) == b"_heartbeat_":
                        fins.append(wire.nop())
                    pos += 4 + size
                del buf[:pos]
                if fins:
                    s.sendall(b"".join(fins))
    finally:
        for s in socks:
            sel.unregister(s)
            s.close()
        sel.close()
    return nbytes


def test_backlog_on_disk_drained_at_rdy_1_reads_each_byte_about_once(
        make_broker: Any) -> None:
    b = make_broker()       # defaults: 10,000 messages in memory, the rest on disk
    topic = unique_name("amp")
    publish(b, topic, MESSAGES)
    before = topic_stats(b, topic)
    assert before["depth"] == MESSAGES and before["backend_depth"] >= MESSAGES - 11_000
    delivered = drain_rdy1(b, topic, MESSAGES)
    assert delivered == MESSAGES * FRAME
    after = topic_stats(b, topic)
    read = after["log_bytes_read"] - before["log_bytes_read"]
    assert after["channels"][0]["depth"] == 0
    # the records on disk were read back (a record is its frame plus 16 bytes)...
    assert read >= (MESSAGES - 11_000) * FRAME
    # ...about once each (before: ~150x at RDY 8, more at RDY 1)
    assert read <= 1.2 * delivered, f"{read} bytes read for {delivered} delivered"
    assert metric(b, "pybroker_topic_log_read_bytes_total", topic) == \
        after["log_bytes_read"]


def test_topic_read_pages_in_order_read_each_byte_about_once(make_broker: Any) -> None:
    b = make_broker()
    topic = unique_name("amp_read")
    n = 50_000
    publish(b, topic, n)
    before = topic_stats(b, topic)["log_bytes_read"]
    off = returned = 0
    while off < n:
        url = (f"http://{b.http_hostport}/topic/read?topic={topic}&offset={off}"
               f"&max_bytes={16 * 1024}")
        with urllib.request.urlopen(url, timeout=10) as r:
            body = r.read()
            nxt = int(r.headers["X-Pybroker-Next-Offset"])
        assert nxt > off
        returned += len(body)
        off = nxt
    assert returned == n * (FRAME + 16)
    read = topic_stats(b, topic)["log_bytes_read"] - before
    on_disk = (n - 11_000) * (FRAME + 16)
    assert on_disk <= read <= 1.2 * returned, f"{read} bytes read for {returned} returned"


def test_spark_source_ranges_read_at_once_read_each_byte_about_once(
        make_broker: Any) -> None:
    """The Spark source's executors page their offset ranges through /topic/read with
    LogClient.read: four ranges read interleaved page by page each keep their cursor."""
    b = make_broker()
    topic = unique_name("amp_spark")
    n = 60_000
    publish(b, topic, n)
    before = topic_stats(b, topic)["log_bytes_read"]
    parts = 4
    bounds = [n * k // parts for k in range(parts + 1)]
    clients = [LogClient(b.http_hostport) for _ in range(parts)]
    try:
        pages = [c.read(topic, bounds[k], bounds[k + 1], 32 * 1024)
                 for k, c in enumerate(clients)]
        nxt = bounds[:-1]
        returned = 0
        live = list(range(parts))
        while live:
            for k in list(live):        # one page of each range in turn
                chunk = next(pages[k], None)
                if chunk is None:
                    assert nxt[k] == bounds[k + 1]
                    live.remove(k)
                    continue
                assert chunk.first == nxt[k] and chunk.next > chunk.first
                nxt[k] = chunk.next
                returned += len(chunk.data)
    finally:
        for c in clients:
            c.close()
    assert returned == n * (FRAME + 16)
    read = topic_stats(b, topic)["log_bytes_read"] - before
    on_disk = (n - 11_000) * (FRAME + 16)
    assert on_disk <= read <= 1.2 * returned, f"{read} bytes read for {returned} returned"
