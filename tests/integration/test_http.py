"""nsqd's HTTP API on a running broker: every endpoint's success, error statuses and
bodies, headers, keep-alive and pipelining, /pub with defer, /mpub text and binary,
pause/unpause seen by a TCP consumer, /config/:opt.

Every test runs against pybroker and, when the binary is found, a real nsqd 1.3.0: the
answers (status, body, the headers nsqd sends) must be the same. Requests go through
the stdlib's http.client or a raw socket (for pipelining and protocol details); the TCP
side is driven with tests/support/wire.py.
"""
from __future__ import annotations

import http.client
import json
import socket
import struct
import time
from typing import Any

import pytest

from tests.support.broker import BrokerProcess, unique_name, wait_until
from tests.support.wire import WireClient, subscribe

NSQ_HEADER = ("x-nsq-content-type", "nsq; version=1.0")
JSON_CT = "application/json; charset=utf-8"
TEXT_CT = "text/plain; charset=utf-8"


# -- helpers ------------------------------------------------------------------------------
class Resp:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    def json(self) -> Any:
        return json.loads(self.body)

    def __repr__(self) -> str:
        return f"Resp({self.status}, {self.body[:200]!r})"


def call(b: BrokerProcess, method: str, path: str, body: bytes | None = None,
         headers: dict[str, str] | None = None, timeout: float = 10.0) -> Resp:
    conn = http.client.HTTPConnection(*b.http_address, timeout=timeout)  # type: ignore[misc]
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        data = r.read()
        return Resp(r.status, {k.lower(): v for k, v in r.getheaders()}, data)
    finally:
        conn.close()


def read_response(f: Any, method: str = "GET") -> Resp:
    """One response from a raw socket's file (several may follow each other)."""
    status_line = f.readline()
    assert status_line, "connection closed before a response"
    status = int(status_line.split()[1])
    headers: dict[str, str] = {}
    while (line := f.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    n = int(headers.get("content-length", "0"))
    body = f.read(n) if method != "HEAD" and n else b""
    return Resp(status, headers, body)


def connect(b: BrokerProcess) -> socket.socket:
    assert b.http_address
    s = socket.create_connection(b.http_address, timeout=5)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def req(method: str, path: str, body: bytes | None = None, extra: str = "") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: test\r\n{extra}"
    if body is not None:
        head += f"Content-Length: {len(body)}\r\n"
    return head.encode() + b"\r\n" + (body or b"")


def is_closed(s: socket.socket, timeout: float = 3.0) -> bool:
    s.settimeout(timeout)
    try:
        while s.recv(65536):
            pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def stats(b: BrokerProcess, topic: str, channel: str = "") -> dict[str, Any]:
    q = f"/stats?format=json&include_mem=false&topic={topic}"
    if channel:
        q += f"&channel={channel}"
    r = call(b, "GET", q)
    assert r.status == 200, r
    doc: dict[str, Any] = r.json()
    return doc


def topic_stats(b: BrokerProcess, topic: str) -> dict[str, Any]:
    topics = stats(b, topic)["topics"]
    assert topics and topics[0]["topic_name"] == topic, topics
    t: dict[str, Any] = topics[0]
    return t


def channel_stats(b: BrokerProcess, topic: str, channel: str) -> dict[str, Any]:
    chans = topic_stats(b, topic)["channels"]
    found = [c for c in chans if c["channel_name"] == channel]
    assert found, chans
    c: dict[str, Any] = found[0]
    return c


def consumer(b: BrokerProcess, topic: str, channel: str = "ch", rdy: int = 100) -> WireClient:
    assert b.tcp_address
    c = WireClient.connect(b.tcp_address)
    return subscribe(c, topic, channel, rdy=rdy)


# -- /ping, /info ---------------------------------------------------------------------
def test_ping(any_broker: BrokerProcess) -> None:
    r = call(any_broker, "GET", "/ping")
    assert (r.status, r.body) == (200, b"OK")
    assert r.headers["content-type"] == TEXT_CT
    assert "x-nsq-content-type" not in r.headers  # nsqd's PlainText route


def test_info(any_broker: BrokerProcess) -> None:
    r = call(any_broker, "GET", "/info")
    assert r.status == 200
    assert r.headers["content-type"] == JSON_CT
    assert r.headers["x-nsq-content-type"] == NSQ_HEADER[1]
    info = r.json()
    assert list(info) == ["version", "broadcast_address", "hostname", "http_port", "tcp_port",
                          "start_time", "max_heartbeat_interval", "max_output_buffer_size",
                          "max_output_buffer_timeout", "max_deflate_level"]
    major, minor, patch = (int(x) for x in info["version"].split("."))
    assert (major, minor, patch) <= (1, 3, 0)
    assert info["http_port"] == any_broker.http_address[1]  # type: ignore[index]
    assert info["tcp_port"] == any_broker.tcp_address[1]  # type: ignore[index]
    assert info["hostname"] == socket.gethostname()
    assert abs(info["start_time"] - time.time()) < 24 * 3600
    assert info["max_heartbeat_interval"] == 60_000_000_000  # ns, as Go encodes a Duration
    assert info["max_output_buffer_size"] == 65536
    assert info["max_output_buffer_timeout"] == 30_000_000_000
    assert info["max_deflate_level"] == 6


# -- /pub -----------------------------------------------------------------------------
def test_pub_reaches_a_tcp_consumer(any_broker: BrokerProcess) -> None:
    topic = unique_name("hpub")
    with consumer(any_broker, topic) as c:
        r = call(any_broker, "POST", f"/pub?topic={topic}", b"hello \x00 world")
        assert (r.status, r.body) == (200, b"OK")
        assert r.headers["x-nsq-content-type"] == NSQ_HEADER[1]
        assert r.headers["content-type"] == TEXT_CT
        m = c.read_message()
        assert m.body == b"hello \x00 world" and m.attempts == 1


def test_pub_with_a_chunked_body(any_broker: BrokerProcess) -> None:
    topic = unique_name("hchunk")
    with consumer(any_broker, topic) as c:
        s = connect(any_broker)
        with s:
            s.sendall(f"POST /pub?topic={topic} HTTP/1.1\r\nHost: t\r\n"
                      "Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n"
                      "0\r\n\r\n".encode())
            r = read_response(s.makefile("rb"))
        assert (r.status, r.body) == (200, b"OK")
        assert c.read_message().body == b"hello world"


def test_pub_creates_the_topic_and_counts(any_broker: BrokerProcess) -> None:
    topic = unique_name("hpubc")
    for i in range(3):
        assert call(any_broker, "POST", f"/pub?topic={topic}", b"m%d" % i).status == 200
    t = topic_stats(any_broker, topic)
    assert (t["depth"], t["message_count"], t["message_bytes"]) == (3, 3, 6)


def test_pub_with_defer_is_delivered_no_earlier_than_asked(any_broker: BrokerProcess) -> None:
    topic = unique_name("hdefer")
    with consumer(any_broker, topic) as c:
        sent = time.monotonic()
        r = call(any_broker, "POST", f"/pub?topic={topic}&defer=1200", b"later")
        assert (r.status, r.body) == (200, b"OK")
        wait_until(lambda: channel_stats(any_broker, topic, "ch")["deferred_count"] == 1,
                   what="deferred_count 1")
        m = c.read_message(timeout=10)
        assert m.body == b"later"
        assert time.monotonic() - sent >= 1.2
        assert channel_stats(any_broker, topic, "ch")["deferred_count"] == 0


@pytest.mark.parametrize("path, body, status, message", [
    ("/pub?topic={t}", b"", 400, "MSG_EMPTY"),
    ("/pub", b"", 400, "MSG_EMPTY"),  # the body is checked first
    ("/pub", b"x", 400, "MISSING_ARG_TOPIC"),
    ("/pub?topic=", b"x", 400, "INVALID_TOPIC"),
    ("/pub?topic=a%20b", b"x", 400, "INVALID_TOPIC"),
    ("/pub?topic=bad!", b"x", 400, "INVALID_TOPIC"),
    ("/pub?topic=" + "a" * 65, b"x", 400, "INVALID_TOPIC"),
    ("/pub?topic=abc%0A", b"x", 400, "INVALID_TOPIC"),
    ("/pub?topic={t};x", b"x", 400, "INVALID_REQUEST"),
    ("/pub?topic=%zz", b"x", 400, "INVALID_REQUEST"),
    ("/pub?topic={t}&defer=x", b"x", 400, "INVALID_DEFER"),
    ("/pub?topic={t}&defer=-1", b"x", 400, "INVALID_DEFER"),
    ("/pub?topic={t}&defer=1.5", b"x", 400, "INVALID_DEFER"),
    ("/pub?topic={t}&defer=3600001", b"x", 400, "INVALID_DEFER"),
    ("/pub?topic={t}", b"x" * (1024 * 1024 + 1), 413, "MSG_TOO_BIG"),
])
def test_pub_errors(any_broker: BrokerProcess, path: str, body: bytes, status: int,
                    message: str) -> None:
    r = call(any_broker, "POST", path.format(t=unique_name("hpe")), body)
    assert (r.status, r.json()) == (status, {"message": message}), r
    assert r.headers["content-type"] == JSON_CT
    assert r.headers["x-nsq-content-type"] == NSQ_HEADER[1]


def test_pub_defer_limits_are_inclusive(any_broker: BrokerProcess) -> None:
    topic = unique_name("hdl")
    for d in ("0", "%2B5", "3600000"):  # %2B: "+" alone means a space
        assert call(any_broker, "POST", f"/pub?topic={topic}&defer={d}", b"x").status == 200
    assert topic_stats(any_broker, topic)["message_count"] == 3


# -- /mpub ----------------------------------------------------------------------------
def test_mpub_text(any_broker: BrokerProcess) -> None:
    topic = unique_name("hmpt")
    with consumer(any_broker, topic) as c:
        body = b"one\n\ntwo\r\nthree\n"
        r = call(any_broker, "POST", f"/mpub?topic={topic}", body)
        assert (r.status, r.body) == (200, b"OK")
        got = [m.body for m in c.read_messages(3)]
        # empty lines are dropped; a CR is part of the message (nsqd splits on LF only)
        assert got == [b"one", b"two\r", b"three"]
        c.expect_nothing(0.3)


@pytest.mark.parametrize("flag", ["true", "1", "yes"])
def test_mpub_binary(any_broker: BrokerProcess, flag: str) -> None:
    topic = unique_name("hmpb")
    bodies = [b"a\nb", b"\x00" * 10, b"x" * 1000]
    payload = struct.pack(">i", 3) + b"".join(struct.pack(">i", len(p)) + p for p in bodies)
    with consumer(any_broker, topic) as c:
        r = call(any_broker, "POST", f"/mpub?topic={topic}&binary={flag}", payload + b"TRAIL")
        assert (r.status, r.body) == (200, b"OK")
        assert [m.body for m in c.read_messages(3)] == bodies  # trailing bytes ignored
        c.expect_nothing(0.3)


def test_mpub_binary_false_is_text(any_broker: BrokerProcess) -> None:
    topic = unique_name("hmpf")
    r = call(any_broker, "POST", f"/mpub?topic={topic}&binary=false", b"a\nb")
    assert r.status == 200
    assert topic_stats(any_broker, topic)["depth"] == 2


def test_mpub_empty_body_creates_the_topic(any_broker: BrokerProcess) -> None:
    topic = unique_name("hmpe")
    assert call(any_broker, "POST", f"/mpub?topic={topic}", b"").status == 200
    assert topic_stats(any_broker, topic)["message_count"] == 0


def _bin(*parts: bytes, count: int | None = None) -> bytes:
    n = len(parts) if count is None else count
    return struct.pack(">i", n) + b"".join(struct.pack(">i", len(p)) + p for p in parts)


@pytest.mark.parametrize("query, body, status, message", [
    ("", b"x", 400, "MISSING_ARG_TOPIC"),
    ("topic=bad!", b"x", 400, "INVALID_TOPIC"),
    ("topic={t}&binary=true", b"x", 413, "BAD_BODY"),
    ("topic={t}&binary=true", struct.pack(">i", 0), 413, "BAD_BODY"),
    ("topic={t}&binary=true", struct.pack(">i", -1), 413, "BAD_BODY"),
    ("topic={t}&binary=true", struct.pack(">i", 2_000_000), 413, "BAD_BODY"),
    ("topic={t}&binary=true", struct.pack(">ii", 1, 0), 413, "BAD_MESSAGE"),
    ("topic={t}&binary=true", struct.pack(">ii", 2, 1) + b"x", 413, "BAD_MESSAGE"),
    ("topic={t}&binary=true", struct.pack(">ii", 1, 5) + b"x", 413, "BAD_MESSAGE"),
    ("topic={t}&binary=true", struct.pack(">ii", 1, 1024 * 1024 + 1) + b"x", 413,
     "BAD_MESSAGE"),
    ("topic={t}", b"ok\n" + b"x" * (1024 * 1024 + 1), 413, "MSG_TOO_BIG"),
])
def test_mpub_errors(any_broker: BrokerProcess, query: str, body: bytes, status: int,
                     message: str) -> None:
    topic = unique_name("hmpx")
    r = call(any_broker, "POST", "/mpub?" + query.format(t=topic), body)
    assert (r.status, r.json()) == (status, {"message": message}), r


def test_mpub_body_too_big(any_broker: BrokerProcess) -> None:
    # the broker answers as soon as it sees Content-Length: the body is never sent
    topic = unique_name("hmpbig")
    s = connect(any_broker)
    with s:
        s.sendall(f"POST /mpub?topic={topic} HTTP/1.1\r\nHost: t\r\n"
                  f"Content-Length: {5 * 1024 * 1024 + 1}\r\n\r\n".encode())
        r = read_response(s.makefile("rb"), "POST")
    assert (r.status, r.json()) == (413, {"message": "BODY_TOO_BIG"})
    assert r.headers["connection"] == "close"


def test_mpub_is_atomic(any_broker: BrokerProcess) -> None:
    topic = unique_name("hmpa")
    bad = _bin(b"good", b"x" * (1024 * 1024 + 1))
    assert call(any_broker, "POST", f"/mpub?topic={topic}&binary=true", bad).status == 413
    big_line = b"good\n" + b"x" * (1024 * 1024 + 1)
    assert call(any_broker, "POST", f"/mpub?topic={topic}", big_line).status == 413
    # matches nsqd: the topic exists (created before the body is read) but got nothing
    assert topic_stats(any_broker, topic)["message_count"] == 0


# -- topics and channels ----------------------------------------------------------------
def test_topic_and_channel_lifecycle(any_broker: BrokerProcess) -> None:
    b, topic = any_broker, unique_name("hlife")
    r = call(b, "POST", f"/topic/create?topic={topic}")
    assert (r.status, r.body) == (200, b"")
    assert "content-type" not in r.headers and r.headers["x-nsq-content-type"]
    assert topic_stats(b, topic)["channels"] == []
    for ch in ("c2", "c1"):
        assert call(b, "POST", f"/channel/create?topic={topic}&channel={ch}").status == 200
    assert [c["channel_name"] for c in topic_stats(b, topic)["channels"]] == ["c1", "c2"]
    assert call(b, "POST", f"/channel/create?topic={topic}&channel=c1").status == 200  # again
    assert call(b, "POST", f"/channel/delete?topic={topic}&channel=c1").status == 200
    r = call(b, "POST", f"/channel/delete?topic={topic}&channel=c1")
    assert (r.status, r.json()) == (404, {"message": "CHANNEL_NOT_FOUND"})
    assert [c["channel_name"] for c in topic_stats(b, topic)["channels"]] == ["c2"]
    assert call(b, "POST", f"/topic/delete?topic={topic}").status == 200
    assert stats(b, topic)["topics"] is None
    r = call(b, "POST", f"/topic/delete?topic={topic}")
    assert (r.status, r.json()) == (404, {"message": "TOPIC_NOT_FOUND"})


def test_channel_delete_closes_its_consumers(any_broker: BrokerProcess) -> None:
    topic = unique_name("hcdel")
    with consumer(any_broker, topic) as c:
        assert call(any_broker, "POST", f"/channel/delete?topic={topic}&channel=ch").status == 200
        c.assert_closed()


def test_topic_empty_and_channel_empty(any_broker: BrokerProcess) -> None:
    b, topic = any_broker, unique_name("hempty")
    call(b, "POST", f"/mpub?topic={topic}", b"1\n2\n3")
    assert topic_stats(b, topic)["depth"] == 3
    assert call(b, "POST", f"/topic/empty?topic={topic}").status == 200
    assert topic_stats(b, topic)["depth"] == 0
    call(b, "POST", f"/channel/create?topic={topic}&channel=ch")
    call(b, "POST", f"/mpub?topic={topic}", b"1\n2\n3\n4")
    wait_until(lambda: channel_stats(b, topic, "ch")["depth"] == 4, what="channel depth 4")
    r = call(b, "POST", f"/channel/empty?topic={topic}&channel=ch")
    assert (r.status, r.body) == (200, b"")
    c = channel_stats(b, topic, "ch")
    assert (c["depth"], c["message_count"]) == (0, 4)


def test_channel_empty_drops_in_flight(any_broker: BrokerProcess) -> None:
    b, topic = any_broker, unique_name("hemptyif")
    with consumer(b, topic, rdy=10) as c:
        call(b, "POST", f"/mpub?topic={topic}", b"1\n2")
        c.read_messages(2)
        assert channel_stats(b, topic, "ch")["in_flight_count"] == 2
        assert call(b, "POST", f"/channel/empty?topic={topic}&channel=ch").status == 200
        assert channel_stats(b, topic, "ch")["in_flight_count"] == 0


@pytest.mark.parametrize("path, status, message", [
    ("/topic/create", 400, "MISSING_ARG_TOPIC"),
    ("/topic/create?topic=bad!", 400, "INVALID_TOPIC"),
    ("/topic/create?topic=a;b", 400, "INVALID_REQUEST"),
    ("/topic/delete", 400, "MISSING_ARG_TOPIC"),
    ("/topic/delete?topic=bad!", 404, "TOPIC_NOT_FOUND"),  # nsqd does not check the name
    ("/topic/delete?topic={t}", 404, "TOPIC_NOT_FOUND"),
    ("/topic/empty", 400, "MISSING_ARG_TOPIC"),
    ("/topic/empty?topic=bad!", 400, "INVALID_TOPIC"),
    ("/topic/empty?topic={t}", 404, "TOPIC_NOT_FOUND"),
    ("/topic/pause", 400, "MISSING_ARG_TOPIC"),
    ("/topic/pause?topic={t}", 404, "TOPIC_NOT_FOUND"),
    ("/topic/unpause?topic={t}", 404, "TOPIC_NOT_FOUND"),
    ("/channel/create", 400, "MISSING_ARG_TOPIC"),
    ("/channel/create?channel=c", 400, "MISSING_ARG_TOPIC"),
    ("/channel/create?topic=bad!&channel=c", 400, "INVALID_ARG_TOPIC"),
    ("/channel/create?topic={t}", 400, "MISSING_ARG_CHANNEL"),
    ("/channel/create?topic={t}&channel=bad!", 400, "INVALID_ARG_CHANNEL"),
    ("/channel/create?topic={t}&channel=c", 404, "TOPIC_NOT_FOUND"),
    ("/channel/delete?topic={t}&channel=c", 404, "TOPIC_NOT_FOUND"),
    ("/channel/empty?topic={t}&channel=c", 404, "TOPIC_NOT_FOUND"),
    ("/channel/pause?topic={t}&channel=c", 404, "TOPIC_NOT_FOUND"),
    ("/channel/unpause?topic={t}&channel=c", 404, "TOPIC_NOT_FOUND"),
    ("/channel/delete?topic={e}&channel=nope", 404, "CHANNEL_NOT_FOUND"),
    ("/channel/empty?topic={e}&channel=nope", 404, "CHANNEL_NOT_FOUND"),
    ("/channel/pause?topic={e}&channel=nope", 404, "CHANNEL_NOT_FOUND"),
    ("/channel/unpause?topic={e}&channel=nope", 404, "CHANNEL_NOT_FOUND"),
])
def test_topic_and_channel_errors(any_broker: BrokerProcess, path: str, status: int,
                                  message: str) -> None:
    existing = unique_name("hexists")
    assert call(any_broker, "POST", f"/topic/create?topic={existing}").status == 200
    r = call(any_broker, "POST", path.format(t=unique_name("hnone"), e=existing))
    assert (r.status, r.json()) == (status, {"message": message}), r
    assert r.headers["x-nsq-content-type"] == NSQ_HEADER[1]


# -- pause / unpause ------------------------------------------------------------------
def test_channel_pause_stops_and_resumes_delivery(any_broker: BrokerProcess) -> None:
    b, topic = any_broker, unique_name("hcpause")
    with consumer(b, topic) as c:
        assert call(b, "POST", f"/channel/pause?topic={topic}&channel=ch").status == 200
        assert channel_stats(b, topic, "ch")["paused"] is True
        call(b, "POST", f"/pub?topic={topic}", b"held")
        c.expect_nothing(0.5)
        ch = channel_stats(b, topic, "ch")
        assert (ch["depth"], ch["in_flight_count"]) == (1, 0)
        assert call(b, "POST", f"/channel/unpause?topic={topic}&channel=ch").status == 200
        assert c.read_message().body == b"held"
        assert channel_stats(b, topic, "ch")["paused"] is False


def test_topic_pause_stops_copying_to_channels(any_broker: BrokerProcess) -> None:
    b, topic = any_broker, unique_name("htpause")
    with consumer(b, topic) as c:
        assert call(b, "POST", f"/topic/pause?topic={topic}").status == 200
        t = topic_stats(b, topic)
        assert t["paused"] is True
        call(b, "POST", f"/mpub?topic={topic}", b"a\nb")
        c.expect_nothing(0.5)
        t = topic_stats(b, topic)
        assert t["depth"] == 2 and t["channels"][0]["depth"] == 0
        assert call(b, "POST", f"/topic/unpause?topic={topic}").status == 200
        assert sorted(m.body for m in c.read_messages(2)) == [b"a", b"b"]
        assert topic_stats(b, topic)["paused"] is False


# -- routing: 404, 405, OPTIONS, redirects, HEAD ----------------------------------------
ROUTES = {"/ping": "GET, OPTIONS", "/info": "GET, OPTIONS", "/stats": "GET, OPTIONS",
          "/pub": "OPTIONS, POST", "/mpub": "OPTIONS, POST", "/topic/create": "OPTIONS, POST",
          "/channel/unpause": "OPTIONS, POST", "/config/log_level": "GET, OPTIONS, PUT"}


@pytest.mark.parametrize("path, allow", sorted(ROUTES.items()))
def test_method_not_allowed(any_broker: BrokerProcess, path: str, allow: str) -> None:
    wrong = "POST" if allow.startswith("GET") else "GET"
    for method in (wrong, "DELETE", "PATCH"):
        r = call(any_broker, method, path)
        assert (r.status, r.json()) == (405, {"message": "METHOD_NOT_ALLOWED"}), method
        assert r.headers["allow"] == allow
        assert r.headers["x-nsq-content-type"] == NSQ_HEADER[1]
    r = call(any_broker, "OPTIONS", path)
    assert (r.status, r.body, r.headers["allow"]) == (200, b"", allow)
    r = call(any_broker, "HEAD", path)  # nsqd has no HEAD routes
    assert (r.status, r.body) == (405, b"")


@pytest.mark.parametrize("method, path", [
    ("GET", "/"), ("GET", "/nope"), ("POST", "/nope"), ("GET", "/config"), ("GET", "/config/"),
    ("GET", "/config/a/b"), ("OPTIONS", "/nope"), ("GET", "/topic"), ("POST", "/ping/"),
])
def test_not_found(any_broker: BrokerProcess, method: str, path: str) -> None:
    r = call(any_broker, method, path)
    assert (r.status, r.json()) == (404, {"message": "NOT_FOUND"})
    assert r.headers["content-type"] == JSON_CT
    assert r.headers["x-nsq-content-type"] == NSQ_HEADER[1]


@pytest.mark.parametrize("method, path, status, location", [
    ("GET", "/ping/", 301, "/ping"),
    ("GET", "/PING", 301, "/ping"),
    ("GET", "/stats/?format=json", 301, "/stats?format=json"),
    ("POST", "/pub/?topic=x", 307, "/pub?topic=x"),
    ("POST", "//pub?topic=x", 307, "/pub?topic=x"),
])
def test_redirects(any_broker: BrokerProcess, method: str, path: str, status: int,
                   location: str) -> None:
    s = connect(any_broker)
    with s:
        s.sendall(req(method, path, b"" if method == "POST" else None))
        r = read_response(s.makefile("rb"), method)
    assert (r.status, r.headers["location"]) == (status, location)


# -- keep-alive, pipelining, HTTP/1.0, Expect -----------------------------------------------
def test_keep_alive_and_pipelining_answer_in_order(any_broker: BrokerProcess) -> None:
    topic = unique_name("hpipe")
    s = connect(any_broker)
    with s:
        f = s.makefile("rb")
        batch = b"".join([req("POST", f"/pub?topic={topic}", b"m%d" % i) for i in range(20)]
                         + [req("GET", f"/stats?format=json&topic={topic}&include_mem=false"),
                            req("GET", "/nope"), req("GET", "/ping")])
        s.sendall(batch)
        rs = [read_response(f) for _ in range(23)]
        assert [r.body for r in rs[:20]] == [b"OK"] * 20
        assert rs[20].json()["topics"][0]["message_count"] == 20  # after the 20 pubs
        assert (rs[21].status, rs[22].body) == (404, b"OK")
        # the connection stays open for more
        s.sendall(req("GET", "/ping"))
        assert read_response(f).body == b"OK"


def test_pipelined_requests_split_at_every_byte(any_broker: BrokerProcess) -> None:
    topic = unique_name("hbytes")
    data = req("POST", f"/pub?topic={topic}", b"abc") + req("GET", "/ping")
    s = connect(any_broker)
    with s:
        for i in range(len(data)):
            s.sendall(data[i:i + 1])
        f = s.makefile("rb")
        assert [read_response(f).body for _ in range(2)] == [b"OK", b"OK"]


def test_connection_close_and_http10(any_broker: BrokerProcess) -> None:
    s = connect(any_broker)
    with s:
        s.sendall(req("GET", "/ping", extra="Connection: close\r\n"))
        r = read_response(s.makefile("rb"))
        assert (r.body, r.headers["connection"]) == (b"OK", "close")
        assert is_closed(s)
    s = connect(any_broker)
    with s:
        s.sendall(b"GET /ping HTTP/1.0\r\n\r\n")
        data = s.makefile("rb").read()
        assert data.startswith(b"HTTP/1.0 200 OK\r\n") and data.endswith(b"\r\n\r\nOK")
    s = connect(any_broker)
    with s:
        s.sendall(b"GET /ping HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
        f = s.makefile("rb")
        r = read_response(f)
        assert (r.body, r.headers["connection"]) == (b"OK", "keep-alive")
        s.sendall(b"GET /ping HTTP/1.0\r\n\r\n")
        assert read_response(f).body == b"OK"


def test_expect_100_continue(any_broker: BrokerProcess) -> None:
    topic = unique_name("hexpect")
    s = connect(any_broker)
    with s:
        s.sendall(f"POST /pub?topic={topic} HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n"
                  "Expect: 100-continue\r\n\r\n".encode())
        f = s.makefile("rb")
        assert f.readline() == b"HTTP/1.1 100 Continue\r\n" and f.readline() == b"\r\n"
        s.sendall(b"hello")
        assert read_response(f).body == b"OK"
    assert topic_stats(any_broker, topic)["depth"] == 1


def test_oversized_content_length_is_refused_before_the_body(any_broker: BrokerProcess) -> None:
    s = connect(any_broker)
    with s:
        s.sendall(b"POST /pub?topic=x HTTP/1.1\r\nHost: t\r\nContent-Length: 2000000\r\n"
                  b"Expect: 100-continue\r\n\r\n")
        r = read_response(s.makefile("rb"), "POST")
        assert (r.status, r.json()) == (413, {"message": "MSG_TOO_BIG"})
        assert r.headers["connection"] == "close"
        assert is_closed(s)


@pytest.mark.parametrize("data, status", [
    (b"GARBAGE\r\n\r\n", 400),
    (b"GET /ping HTTP/1.1\r\n\r\n", 400),  # HTTP/1.1 without Host
    (b"GET /ping HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", 400),
    (b"GET /ping HTTP/2.0\r\nHost: a\r\n\r\n", 505),
])
def test_malformed_requests_get_go_error_and_close(any_broker: BrokerProcess, data: bytes,
                                                   status: int) -> None:
    s = connect(any_broker)
    with s:
        s.sendall(data)
        f = s.makefile("rb")
        line = f.readline()
        assert line.startswith(b"HTTP/1.1 %d " % status), line
        rest = f.read()
        assert b"Connection: close\r\n" in rest and rest.split(b"\r\n\r\n", 1)[1].startswith(
            str(status).encode())
        assert is_closed(s)


# -- /config/:opt -----------------------------------------------------------------------
@pytest.mark.parametrize("opt, value", [
    ("log_level", b"2"), ("mem_queue_size", b"10000"), ("msg_timeout", b"60000000000"),
    ("max_msg_size", b"1048576"), ("max_body_size", b"5242880"), ("deflate", b"true"),
    ("nsqlookupd_tcp_addresses", b"[]"), ("tls_required", b"0"), ("tls_min_version", b"769"),
    ("output_buffer_timeout", b"250000000"), ("max_rdy_count", b"2500"),
])
def test_config_get(any_broker: BrokerProcess, opt: str, value: bytes) -> None:
    r = call(any_broker, "GET", f"/config/{opt}")
    assert (r.status, r.body) == (200, value)
    assert r.headers["content-type"] == JSON_CT


def test_config_get_string_is_sent_as_text(any_broker: BrokerProcess) -> None:
    r = call(any_broker, "GET", "/config/tcp_address")
    assert r.status == 200 and r.body.startswith(b"127.0.0.1:")
    assert r.headers["content-type"] == TEXT_CT
    r = call(any_broker, "GET", "/config/https_address")
    assert (r.status, r.body) == (200, b"")
    assert "content-type" not in r.headers


def test_config_errors(any_broker: BrokerProcess) -> None:
    for method, path, body, status, message in [
        ("GET", "/config/nope", None, 400, "INVALID_OPTION"),
        ("GET", "/config/node_id", None, 400, "INVALID_OPTION"),  # the config name is "id"
        ("PUT", "/config/msg_timeout", b"5", 400, "INVALID_OPTION"),
        ("PUT", "/config/nope", b"5", 400, "INVALID_OPTION"),
        ("PUT", "/config/nope", b"", 413, "INVALID_VALUE"),  # the body is checked first
        ("PUT", "/config/log_level", b"", 413, "INVALID_VALUE"),
        ("PUT", "/config/log_level", b"loud", 400, "INVALID_VALUE"),
        ("PUT", "/config/nsqlookupd_tcp_addresses", b"nope", 400, "INVALID_VALUE"),
        ("PUT", "/config/nsqlookupd_tcp_addresses", b"[1]", 400, "INVALID_VALUE"),
    ]:
        r = call(any_broker, method, path, body)
        assert (r.status, r.json()) == (status, {"message": message}), (method, path, body)


def test_config_put(any_broker: BrokerProcess) -> None:
    try:
        r = call(any_broker, "PUT", "/config/log_level", b"DEBUG")
        assert (r.status, r.body) == (200, b"1")
        assert call(any_broker, "GET", "/config/log_level").body == b"1"
        r = call(any_broker, "PUT", "/config/log_level", b"warn")
        assert (r.status, r.body) == (200, b"3")
    finally:
        assert call(any_broker, "PUT", "/config/log_level", b"info").body == b"2"
    # JSON null: nsqd keeps a nil list and answers null, until a list comes again
    r = call(any_broker, "PUT", "/config/nsqlookupd_tcp_addresses", b"null")
    assert (r.status, r.body) == (200, b"null")
    assert call(any_broker, "GET", "/config/nsqlookupd_tcp_addresses").body == b"null"
    r = call(any_broker, "PUT", "/config/nsqlookupd_tcp_addresses", b"[]")
    assert (r.status, r.body) == (200, b"[]")


def test_config_put_lookupd_addresses_connects(make_any_broker: Any) -> None:
    b = make_any_broker()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.settimeout(10)
    with listener:
        addr = f"127.0.0.1:{listener.getsockname()[1]}"
        body = json.dumps([addr]).encode()
        r = call(b, "PUT", "/config/nsqlookupd_tcp_addresses", body)
        assert (r.status, r.json()) == (200, [addr])
        assert call(b, "GET", "/config/nsqlookupd_tcp_addresses").json() == [addr]
        peer, _ = listener.accept()  # the broker registers with the new nsqlookupd
        with peer:
            peer.settimeout(10)
            assert peer.recv(4) == b"  V1"
        r = call(b, "PUT", "/config/nsqlookupd_tcp_addresses", b"[]")
        assert (r.status, r.body) == (200, b"[]")
