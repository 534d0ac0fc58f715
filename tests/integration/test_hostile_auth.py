"""Hostile and slow auth servers against a real broker: pybroker and nsqd 1.3.0 side by side.

The AUTH rows of issue 21's table: a server that trickles its body, 40 AUTHs waiting on
slow answers while one should be answered at once, a backtracking grant pattern, Go's
``\\z``, and (pybroker) an answer over the size bound. The auth server is scripted per
secret (tests.support.hostile.AuthServer); the broker's request timeout is 2 s.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest

from tests.support import wire
from tests.support.broker import BrokerProcess, unique_name, wait_until
from tests.support.hostile import AuthServer, probing
from tests.support.wire import WireClient

REQUEST_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def auth_server() -> Iterator[AuthServer]:
    # slow answers come after 1 s: half the request timeout, so they are answered in time
    # even on a loaded machine, and a fast AUTH that waited behind one would take >= 1 s
    server = AuthServer(slow_s=1.0).start()
    yield server
    server.stop()


@pytest.fixture
def target(make_broker: Callable[..., BrokerProcess], broker_kind: str,
           auth_server: AuthServer) -> BrokerProcess:
    args = [f"--auth-http-address=127.0.0.1:{auth_server.port}",
            f"--http-client-request-timeout={REQUEST_TIMEOUT_S:g}s"]
    if broker_kind == "pybroker":
        args.append("--loop-threads=1")
    return make_broker(*args, kind=broker_kind)


def _auth(b: BrokerProcess, secret: str) -> WireClient:
    assert b.tcp_address is not None
    c = WireClient.connect(b.tcp_address)
    c.identify(feature_negotiation=True)
    c.send(wire.command("AUTH", body=secret.encode()))
    return c


def test_a_trickling_auth_server_gets_one_deadline(target: BrokerProcess) -> None:
    """Headers at once, then one body byte a second: failed at the request timeout."""
    t0 = time.monotonic()
    c = _auth(target, "trickle")
    try:
        c.expect_error(b"E_AUTH_FAILED", b"E_AUTH_FAILED AUTH failed", timeout=15)
    finally:
        c.close()
    elapsed = time.monotonic() - t0
    print(f"{target.kind}: E_AUTH_FAILED after {elapsed:.2f}s")
    assert REQUEST_TIMEOUT_S - 0.5 <= elapsed <= REQUEST_TIMEOUT_S + 2.0


def test_slow_answers_do_not_hold_up_a_fast_one(target: BrokerProcess,
                                                auth_server: AuthServer) -> None:
    """40 AUTHs waiting on slow answers (1 s each), then one whose answer is at once."""
    slow = [_auth(target, "slow") for _ in range(40)]
    try:
        assert auth_server.wait_slow(40, timeout_s=10), "the slow queries did not arrive"
        t0 = time.monotonic()
        fast = _auth(target, "fast")
        try:
            answer = fast.expect_response(None, timeout=10)
        finally:
            fast.close()
        waited = time.monotonic() - t0
        print(f"{target.kind}: fast AUTH answered in {waited * 1000:.0f} ms behind 40 slow")
        assert b'"permission_count":1' in answer
        assert waited < 1.0
        for c in slow:
            c.expect_response(None, timeout=10)
    finally:
        for c in slow:
            c.close()


def test_a_backtracking_grant_pattern(target: BrokerProcess) -> None:
    """Granted ``^([a-z0-9]+_?)*$``: a PUB to a 27-character topic the pattern does not
    match is refused at once, and nobody else waits (Python's re would take seconds)."""
    assert target.tcp_address is not None
    c = _auth(target, "backtrack")
    try:
        c.expect_response(None)
        with probing(target.tcp_address, unique_name("probe"), auth_secret="fast") as p:
            t0 = time.monotonic()
            c.send(wire.pub("a" * 26 + "-", b"x"))
            c.expect_error(b"E_UNAUTHORIZED", timeout=10)
            elapsed = time.monotonic() - t0
            time.sleep(0.2)
        assert elapsed < 0.5, elapsed
        assert not p.errors and p.worst_ms < 250, p.summary()
    finally:
        c.close()


def test_go_regexp_syntax_is_accepted(target: BrokerProcess) -> None:
    r"""Granted ``^t3\z`` (valid in Go and RE2): PUB t3 is allowed, PUB t33 is not."""
    c = _auth(target, "t3z")
    try:
        c.expect_response(None)
        c.pub("t3", b"x")
    finally:
        c.close()
    c = _auth(target, "t3z")
    try:
        c.expect_response(None)
        c.send(wire.pub("t33", b"x"))
        c.expect_error(b"E_UNAUTHORIZED")
    finally:
        c.close()


def test_an_oversized_answer_is_refused(make_broker: Callable[..., BrokerProcess],
                                        auth_server: AuthServer) -> None:
    """pybroker reads at most 1 MiB of an answer (nsqd reads it all)."""
    b = make_broker(f"--auth-http-address=127.0.0.1:{auth_server.port}")
    c = _auth(b, "huge")
    try:
        c.expect_error(b"E_AUTH_FAILED", timeout=10)
    finally:
        c.close()
    wait_until(lambda: "response larger than" in b.stderr_text(), what="the log line")


def test_auth_answers_keep_flowing_while_a_server_hangs(
        make_broker: Callable[..., BrokerProcess], auth_server: AuthServer) -> None:
    """pybroker: a second auth address that never answers (accepts, then nothing) costs
    each query at most the request timeout before the good server is asked."""
    hang = threading.Event()
    import socket

    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(64)
    try:
        b = make_broker(f"--auth-http-address=127.0.0.1:{lsock.getsockname()[1]}",
                        f"--auth-http-address=127.0.0.1:{auth_server.port}",
                        f"--http-client-request-timeout={REQUEST_TIMEOUT_S:g}s")
        t0 = time.monotonic()
        clients = [_auth(b, "fast") for _ in range(5)]
        for c in clients:
            c.expect_response(None, timeout=10)
            c.close()
        assert time.monotonic() - t0 < REQUEST_TIMEOUT_S + 2.0
    finally:
        hang.set()
        lsock.close()
