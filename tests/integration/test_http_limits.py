"""Slow, greedy and malformed HTTP clients: each gets a 4xx or a close, and none of them
stalls other HTTP clients or the TCP side.

Limits that nsqd has too (chunked body over the limit, garbage after a good request) run
against both brokers; the deadlines (nsqd's HTTP server has none) and the header size
limit are pybroker's own and run against pybroker, started with --client-timeout=1s so
that a deadline passes within the test.
"""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

import pytest

from tests.support.broker import BrokerProcess, unique_name, wait_until
from tests.support.http import broker_json
from tests.support.wire import WireClient


def connect(b: BrokerProcess) -> socket.socket:
    assert b.http_address
    s = socket.create_connection(b.http_address, timeout=5)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def read_all(s: socket.socket, timeout: float = 5.0) -> bytes:
    """Everything until the server closes (fails if it does not within timeout)."""
    s.settimeout(timeout)
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    return out


def read_response(s: socket.socket) -> bytes:
    """One response with a Content-Length body (the connection may stay open)."""
    s.settimeout(5)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    while len(body) < length:
        chunk = s.recv(65536)
        assert chunk
        body += chunk
    return head + b"\r\n\r\n" + body


def closed_within(s: socket.socket, timeout: float) -> float | None:
    """Seconds until the server closed s, or None if it stayed open."""
    start = time.monotonic()
    s.settimeout(timeout)
    try:
        while s.recv(65536):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return None
    return time.monotonic() - start


def ping_time(b: BrokerProcess) -> float:
    start = time.monotonic()
    with connect(b) as s:
        s.sendall(b"GET /ping HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        assert read_all(s).endswith(b"\r\n\r\nOK")
    return time.monotonic() - start


def tcp_round_trip(b: BrokerProcess) -> float:
    assert b.tcp_address
    start = time.monotonic()
    with WireClient.connect(b.tcp_address) as c:
        c.pub(unique_name("rt"), b"x")
    return time.monotonic() - start


@pytest.fixture
def strict(make_module_broker: Callable[..., BrokerProcess]) -> BrokerProcess:
    """pybroker with 1 s HTTP deadlines (header, request, idle: from --client-timeout)."""
    return make_module_broker("--client-timeout=1s")


# -- both brokers -----------------------------------------------------------------------------
def test_chunked_body_over_the_limit(any_broker: BrokerProcess) -> None:
    s = connect(any_broker)
    with s:
        s.sendall(b"POST /pub?topic=x HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"a" * 65536
        try:
            for _ in range(17):  # 1 MiB + 64 KiB > max_msg_size
                s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            s.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        data = read_response(s)
    assert data.startswith(b"HTTP/1.1 413 "), data[:200]
    assert data.endswith(b'{"message":"MSG_TOO_BIG"}')


def test_garbage_after_a_good_request(any_broker: BrokerProcess) -> None:
    s = connect(any_broker)
    with s:
        s.sendall(b"GET /ping HTTP/1.1\r\nHost: t\r\n\r\n\x00\x01garbage\r\n\r\n")
        data = read_all(s)
    first, _, second = data.partition(b"\r\n\r\nOK")
    assert first.startswith(b"HTTP/1.1 200 OK")
    assert second.startswith(b"HTTP/1.1 400 Bad Request\r\n")


# -- pybroker's own limits ------------------------------------------------------------------
def test_oversized_headers_get_431_and_a_close(broker: BrokerProcess) -> None:
    s = connect(broker)
    with s:
        try:
            s.sendall(b"GET /ping HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        data = read_all(s)
    assert data.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"), data[:100]
    s = connect(broker)
    with s:
        s.sendall(b"GET /" + b"p" * 70_000 + b" HTTP/1.1\r\nHost: t\r\n\r\n")
        assert read_all(s).startswith(b"HTTP/1.1 431 ")
    assert ping_time(broker) < 1


def test_a_body_no_handler_reads_is_not_read(broker: BrokerProcess) -> None:
    # matches nsqd: /topic/create never reads its body, so a 100 MB one announced is
    # answered as usual at once (nsqd: "200 OK", "Connection: close"), never read or kept
    topic = unique_name("ignored_body")
    s = connect(broker)
    with s:
        s.sendall(f"POST /topic/create?topic={topic} HTTP/1.1\r\nHost: t\r\n".encode()
                  + b"Content-Length: 100000000\r\n\r\n" + b"x" * 65536)
        data = read_all(s)
    assert data.startswith(b"HTTP/1.1 200 OK\r\n") and b"Connection: close\r\n" in data, data
    assert data.endswith(b"Content-Length: 0\r\nConnection: close\r\n\r\n"), data
    status, doc = broker_json(broker, "GET", "/stats", format="json", topic=topic)
    assert status == 200 and [t["topic_name"] for t in doc["topics"]] == [topic], doc
    assert ping_time(broker) < 1


def test_a_chunked_body_no_handler_reads_is_dropped_past_the_limit(
        make_broker: Callable[..., BrokerProcess]) -> None:
    # the same when the size is not announced: once the chunks pass max_body_size the
    # request is answered as usual and the rest is never kept
    b = make_broker("--max-msg-size=1024", "--max-body-size=4096")
    topic = unique_name("ignored_chunked")
    s = connect(b)
    with s:
        s.sendall(f"POST /topic/create?topic={topic} HTTP/1.1\r\nHost: t\r\n".encode()
                  + b"Transfer-Encoding: chunked\r\n\r\n")
        chunk = b"a" * 1024
        try:
            for _ in range(8):
                s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        except (BrokenPipeError, ConnectionResetError):
            pass
        data = read_all(s)
    assert data.startswith(b"HTTP/1.1 200 OK\r\n") and b"Connection: close\r\n" in data, data
    status, doc = broker_json(b, "GET", "/stats", format="json", topic=topic)
    assert status == 200 and [t["topic_name"] for t in doc["topics"]] == [topic], doc


def test_refused_body_closes_even_on_unknown_paths(broker: BrokerProcess) -> None:
    # the unread body cannot be told from a next request: the answer closes
    for path, head in [(b"/nope", b"HTTP/1.1 404 "), (b"/ping", b"HTTP/1.1 405 ")]:
        s = connect(broker)
        with s:
            s.sendall(b"POST %s HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\n"
                      b"Content-Length: 100000000\r\n\r\n" % path)
            data = read_all(s)
        assert data.startswith(head) and b"Connection: close\r\n" in data, data


def test_slowloris_headers_are_closed_and_others_served(strict: BrokerProcess) -> None:
    slow = [connect(strict) for _ in range(30)]
    try:
        for s in slow:
            s.sendall(b"GET /ping HTTP/1.1\r\nHost: t\r\n")  # never finished
        assert ping_time(strict) < 0.5
        assert tcp_round_trip(strict) < 0.5
        for s in slow:
            waited = closed_within(s, 5)
            assert waited is not None and waited < 4
    finally:
        for s in slow:
            s.close()


def test_slow_body_is_closed(strict: BrokerProcess) -> None:
    s = connect(strict)
    with s:
        s.sendall(b"POST /pub?topic=x HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\n\r\nhalf.")
        start = time.monotonic()
        # dribble a byte now and then: progress does not extend the request's deadline
        s.sendall(b"a")
        waited = closed_within(s, 5)
        assert waited is not None and time.monotonic() - start < 4


def test_idle_keep_alive_connection_is_closed(strict: BrokerProcess) -> None:
    s = connect(strict)
    with s:
        s.sendall(b"GET /ping HTTP/1.1\r\nHost: t\r\n\r\n")
        s.settimeout(5)
        assert s.recv(4096).endswith(b"\r\n\r\nOK")
        waited = closed_within(s, 5)
        assert waited is not None and 0.5 < waited < 4


def test_a_busy_connection_is_not_closed_as_idle(strict: BrokerProcess) -> None:
    s = connect(strict)
    with s:
        f = s.makefile("rb")
        for _ in range(8):  # 2 s of requests, 250 ms apart, on a 1 s idle deadline
            s.sendall(b"GET /ping HTTP/1.1\r\nHost: t\r\n\r\n")
            while f.readline() not in (b"\r\n", b""):
                pass
            assert f.read(2) == b"OK"
            time.sleep(0.25)


def test_client_that_never_reads_is_throttled(broker: BrokerProcess) -> None:
    hog = connect(broker)
    hog.settimeout(30)
    request = b"GET /ping HTTP/1.1\r\nHost: t\r\n\r\n" * 1000
    sent = [0]
    stop = threading.Event()

    def flood() -> None:
        try:
            while not stop.is_set() and sent[0] < 400:  # up to 400k requests, never reading
                hog.sendall(request)
                sent[0] += 1
        except OSError:
            pass

    t = threading.Thread(target=flood, name="http-hog", daemon=True)
    t.start()
    try:
        time.sleep(1.0)
        # the server stops reading the hog once its answers pile up: sendall blocks
        assert sent[0] < 400
        assert ping_time(broker) < 0.5
        assert tcp_round_trip(broker) < 0.5
    finally:
        stop.set()
        hog.close()
        t.join(10)
    wait_until(lambda: ping_time(broker) < 0.5, what="a prompt /ping")


def test_many_keep_alive_connections(broker: BrokerProcess) -> None:
    topic = unique_name("many")
    conns = [connect(broker) for _ in range(200)]
    try:
        for i, s in enumerate(conns):
            s.sendall(b"POST /pub?topic=%s HTTP/1.1\r\nHost: t\r\nContent-Length: 1\r\n\r\n%d"
                      % (topic.encode(), i % 10))
        for s in conns:
            s.settimeout(5)
            assert s.recv(4096).endswith(b"\r\n\r\nOK")
    finally:
        for s in conns:
            s.close()


def test_big_mpub_body_arriving_slowly_does_not_stall_tcp(broker: BrokerProcess) -> None:
    topic = unique_name("bigslow")
    body = b"".join(b"message-%06d\n" % i for i in range(200_000))  # ~3 MiB
    s = connect(broker)
    with s:
        s.sendall(b"POST /mpub?topic=%s HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n"
                  % (topic.encode(), len(body)))
        step = len(body) // 10
        for i in range(10):
            s.sendall(body[i * step:(i + 1) * step] if i < 9 else body[9 * step:])
            assert tcp_round_trip(broker) < 0.5
            time.sleep(0.05)
        s.settimeout(30)
        data = b""
        while not data.endswith(b"OK"):
            chunk = s.recv(4096)
            assert chunk
            data += chunk
    assert data.startswith(b"HTTP/1.1 200 OK")
