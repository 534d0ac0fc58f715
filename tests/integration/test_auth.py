"""AUTH against a real auth HTTP server started by the test, on pybroker and nsqd 1.3.0.

The auth server answers by secret: "good" may publish to ``^pub_`` topics and subscribe
to ``^sub_`` topics on channels matching ``^ok``; "none" gets no authorizations;
"short" gets a 1 s TTL; "slow" is answered after a delay. Every query is recorded.
"""
from __future__ import annotations

import json
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.support import wire
from tests.support.broker import BrokerProcess, unique_name, wait_until
from tests.support.certs import make_certs
from tests.support.layers import negotiate
from tests.support.wire import WireClient

Connect = Callable[..., WireClient]
GOOD = {"ttl": 3600, "identity": "alice", "identity_url": "https://id.example/alice",
        "authorizations": [
            {"topic": "^pub_", "channels": [".*"], "permissions": ["publish"]},
            {"topic": "^sub_", "channels": ["^ok"], "permissions": ["subscribe"]}]}


class AuthServer:
    def __init__(self) -> None:
        self.queries: list[dict[str, str]] = []
        self.answers: dict[str, Any] = {
            "good": GOOD, "none": {"ttl": 60, "authorizations": []},
            "short": dict(GOOD, ttl=1), "slow": GOOD}
        self.delay_s = 2.0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                q = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(self.path).query,
                                                keep_blank_values=True))
                owner.queries.append(q)
                if q.get("secret") == "slow":
                    time.sleep(owner.delay_s)
                answer = owner.answers.get(q.get("secret", ""))
                if answer is None:
                    self.send_response(403)
                    self.end_headers()
                    return
                body = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        # a client that gave up on a slow answer (a broker's request timeout) is expected
        self.httpd.handle_error = lambda *args: None  # type: ignore[method-assign]
        self.address = f"127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="auth-server",
                                       daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


@pytest.fixture(scope="module")
def auth_server() -> Iterator[AuthServer]:
    s = AuthServer()
    yield s
    s.stop()


@pytest.fixture
def auth_broker(make_module_broker: Callable[..., BrokerProcess], broker_kind: str,
                auth_server: AuthServer) -> BrokerProcess:
    return make_module_broker(f"--auth-http-address={auth_server.address}",
                              "--http-client-request-timeout=4s", kind=broker_kind)


def authed(b: BrokerProcess, connect: Connect, secret: str = "good") -> WireClient:
    c = connect(b)
    answer = c.identify(feature_negotiation=True)
    assert answer is not None and answer["auth_required"] is True
    c.send(wire.command("AUTH", body=secret.encode()))
    return c


def test_auth_allowed(auth_broker: BrokerProcess, connect: Connect,
                      auth_server: AuthServer) -> None:
    c = authed(auth_broker, connect)
    assert c.expect_response(None) == (b'{"identity":"alice","identity_url":'
                                       b'"https://id.example/alice","permission_count":2}')
    q = auth_server.queries[-1]
    assert q == {"remote_ip": "127.0.0.1", "tls": "false", "secret": "good",
                 "common_name": ""}
    topic = unique_name("pub")
    c.pub(topic, b"allowed")
    c.mpub(topic, [b"a", b"b"])
    c.dpub(topic, 10, b"later")
    sub_topic = unique_name("sub")
    s = authed(auth_broker, connect)
    s.expect_response(None)
    s.sub(sub_topic, "ok_channel")
    with urllib.request.urlopen(f"http://{auth_broker.http_hostport}/stats?format=json",
                                timeout=5) as r:
        stats = json.load(r)
    (producer,) = [p for p in stats["producers"]
                   if any(pc["topic"] == topic for pc in p.get("pub_counts", []))]
    assert (producer["authed"], producer["auth_identity"], producer["auth_identity_url"]) == (
        True, "alice", "https://id.example/alice")


def test_auth_required_first(auth_broker: BrokerProcess, connect: Connect) -> None:
    c = connect(auth_broker)
    c.send(wire.pub(unique_name("pub"), b"x"))
    c.expect_error("E_AUTH_FIRST", "E_AUTH_FIRST AUTH required before PUB")
    c = connect(auth_broker)
    c.send(wire.sub(unique_name("sub"), "ok"))
    c.expect_error("E_AUTH_FIRST", "E_AUTH_FIRST AUTH required before SUB")


def test_auth_denied_for_the_topic(auth_broker: BrokerProcess, connect: Connect) -> None:
    c = authed(auth_broker, connect)
    c.expect_response(None)
    c.send(wire.pub("other_topic", b"x"))
    c.expect_error("E_UNAUTHORIZED", 'E_UNAUTHORIZED AUTH failed for PUB on "other_topic" ""')
    c = authed(auth_broker, connect)
    c.expect_response(None)
    c.send(wire.mpub("other_topic", [b"x"]))
    c.expect_error("E_UNAUTHORIZED", 'E_UNAUTHORIZED AUTH failed for MPUB on "other_topic" ""')
    c = authed(auth_broker, connect)
    c.expect_response(None)
    c.send(wire.sub("pub_only", "ok"))  # publish permission does not grant subscribe
    c.expect_error("E_UNAUTHORIZED", 'E_UNAUTHORIZED AUTH failed for SUB on "pub_only" "ok"')


def test_auth_denied_for_the_channel(auth_broker: BrokerProcess, connect: Connect) -> None:
    c = authed(auth_broker, connect)
    c.expect_response(None)
    c.send(wire.sub("sub_topic", "elsewhere"))
    c.expect_error("E_UNAUTHORIZED", 'E_UNAUTHORIZED AUTH failed for SUB on "sub_topic" '
                                     '"elsewhere"')


def test_auth_without_authorizations(auth_broker: BrokerProcess, connect: Connect) -> None:
    c = authed(auth_broker, connect, "none")
    c.expect_error("E_UNAUTHORIZED", "E_UNAUTHORIZED AUTH no authorizations found")


def test_auth_refused_by_the_server(auth_broker: BrokerProcess, connect: Connect) -> None:
    c = authed(auth_broker, connect, "unknown-secret")  # the auth server answers 403
    c.expect_error("E_AUTH_FAILED", "E_AUTH_FAILED AUTH failed")


def test_auth_twice(auth_broker: BrokerProcess, connect: Connect) -> None:
    c = authed(auth_broker, connect)
    c.expect_response(None)
    c.send(wire.command("AUTH", body=b"good"))
    c.expect_error("E_INVALID", "E_INVALID AUTH already set")


def test_ttl_expiry_asks_again(auth_broker: BrokerProcess, connect: Connect,
                               auth_server: AuthServer) -> None:
    c = authed(auth_broker, connect, "short")
    c.expect_response(None)
    topic = unique_name("pub")
    c.pub(topic, b"first")
    asked = sum(1 for q in auth_server.queries if q["secret"] == "short")
    c.pub(topic, b"within the ttl")  # no new query
    assert sum(1 for q in auth_server.queries if q["secret"] == "short") == asked

    def count() -> int:
        return sum(1 for q in auth_server.queries if q["secret"] == "short")

    def pub_until_asked_again() -> bool:
        c.pub(topic, b"polling")  # answered OK throughout: the re-query allows it
        return count() > asked

    wait_until(pub_until_asked_again, timeout_s=5, interval_s=0.1, what="a re-query")
    # the auth server now takes the grant away: the next re-query denies
    auth_server.answers["short"] = dict(GOOD, ttl=1, authorizations=[
        {"topic": "^nothing$", "channels": [".*"], "permissions": ["publish"]}])
    try:
        deadline = time.monotonic() + 5
        while True:
            assert time.monotonic() < deadline, "the expired grant was never asked again"
            c.send(wire.pub(topic, b"denied once asked again"))
            ftype, data = c.read_frame()
            if ftype == wire.FRAME_ERROR:
                break
            assert data == b"OK"
            time.sleep(0.1)  # poll interval of the loop above
        assert data == f'E_UNAUTHORIZED AUTH failed for PUB on "{topic}" ""'.encode()
        c.assert_closed()
    finally:
        auth_server.answers["short"] = dict(GOOD, ttl=1)


def test_auth_server_down(make_any_broker: Callable[..., BrokerProcess],
                          connect: Connect) -> None:
    import socket

    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    b = make_any_broker(f"--auth-http-address=127.0.0.1:{port}")
    c = authed(b, connect)
    c.expect_error("E_AUTH_FAILED", "E_AUTH_FAILED AUTH failed")


def test_slow_auth_server_delays_that_client_only(auth_broker: BrokerProcess,
                                                  connect: Connect,
                                                  auth_server: AuthServer) -> None:
    slow = authed(auth_broker, connect, "slow")
    start = time.monotonic()
    fast = authed(auth_broker, connect)
    fast.expect_response(None)
    fast.pub(unique_name("pub"), b"while another client waits for its auth server")
    assert time.monotonic() - start < 1.5
    slow.expect_response(None)
    assert time.monotonic() - start >= 1.5
    slow.pub(unique_name("pub"), b"late but allowed")


def test_slow_auth_server_past_the_request_timeout(
        make_any_broker: Callable[..., BrokerProcess], connect: Connect,
        auth_server: AuthServer) -> None:
    b = make_any_broker(f"--auth-http-address={auth_server.address}",
                        "--http-client-request-timeout=500ms")
    slow = authed(b, connect, "slow")
    fast = authed(b, connect)
    fast.expect_response(None)
    slow.expect_error("E_AUTH_FAILED", "E_AUTH_FAILED AUTH failed", timeout=5)
    fast.pub(unique_name("pub"), b"unaffected")


def test_auth_over_tls_sends_the_client_certificate_name(
        make_any_broker: Callable[..., BrokerProcess], connect: Connect,
        auth_server: AuthServer, tmp_path: Path) -> None:
    certs = make_certs(tmp_path / "certs")
    b = make_any_broker(f"--auth-http-address={auth_server.address}",
                        f"--tls-cert={certs.server_cert}", f"--tls-key={certs.server_key}",
                        "--tls-client-auth-policy=require-verify",
                        f"--tls-root-ca-file={certs.ca}")
    c = connect(b)
    answer = negotiate(c, certs, tls=True, cert=certs.client_cert, key=certs.client_key)
    assert answer["auth_required"] is True
    c.send(wire.command("AUTH", body=b"good"))
    c.expect_response(None)
    assert auth_server.queries[-1] == {"remote_ip": "127.0.0.1", "tls": "true",
                                       "secret": "good", "common_name": "client-1"}
    c.pub(unique_name("pub"), b"over tls, authorised")
