"""TLS, snappy and deflate negotiation on raw sockets, against pybroker and nsqd 1.3.0.

Both brokers get the same certificates (made by the test); the client side is the
stdlib's ssl, zlib and python-snappy, never pybroker's code. Negotiation answers are
compared byte for byte, error codes exactly and texts by nsqd's words.
"""
from __future__ import annotations

import json
import socket
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support import wire
from tests.support.broker import BrokerProcess, unique_name
from tests.support.certs import CertSet, make_certs
from tests.support.layers import client_context, negotiate, raw_handshake
from tests.support.wire import WireClient

Connect = Callable[..., WireClient]


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertSet:
    return make_certs(Path(tmp_path_factory.mktemp("certs")))


def tls_args(certs: CertSet, *extra: str) -> tuple[str, ...]:
    return (f"--tls-cert={certs.server_cert}", f"--tls-key={certs.server_key}", *extra)


@pytest.fixture
def tls_broker(make_module_broker: Callable[..., BrokerProcess], broker_kind: str,
               certs: CertSet) -> BrokerProcess:
    return make_module_broker(*tls_args(certs, "--max-deflate-level=3"), kind=broker_kind)


def expected_answer(**over: Any) -> bytes:
    fields: dict[str, Any] = {
        "max_rdy_count": 2500, "version": "1.3.0", "max_msg_timeout": 900000,
        "msg_timeout": 60000, "tls_v1": False, "deflate": False, "deflate_level": 6,
        "max_deflate_level": 6, "snappy": False, "sample_rate": 0, "auth_required": False,
        "output_buffer_size": 16384, "output_buffer_timeout": 250}
    fields.update(over)
    return json.dumps(fields, separators=(",", ":")).encode()


def client_stats(b: BrokerProcess, topic: str, certs: CertSet | None = None
                 ) -> list[dict[str, Any]]:
    """The clients in /stats that published to or subscribe to topic (over HTTPS with a
    client certificate when the broker has an HTTPS listener)."""
    path = f"/stats?format=json&topic={topic}"
    if b.https_address is not None:
        assert certs is not None
        ctx = client_context(certs, certs.client_cert, certs.client_key)
        with urllib.request.urlopen(f"https://localhost:{b.https_address[1]}{path}",
                                    timeout=5, context=ctx) as r:
            stats = json.load(r)
    else:
        with urllib.request.urlopen(f"http://{b.http_hostport}{path}", timeout=5) as r:
            stats = json.load(r)
    out = [p for p in stats.get("producers", [])
           if any(pc["topic"] == topic for pc in p.get("pub_counts", []))]
    for t in stats["topics"]:
        for ch in t["channels"]:
            out.extend(ch["clients"])
    return out


def roundtrip(c: WireClient, topic: str, n: int = 50) -> None:
    """PUB n messages, MPUB n more, consume and FIN all 2n on the same connection."""
    bodies = [b"body-%d-" % i + b"x" * (i * 37 % 500) for i in range(2 * n)]
    for body in bodies[:n]:
        c.pub(topic, body)
    c.mpub(topic, bodies[n:])
    c.sub(topic, "ch")
    c.rdy(2 * n)
    got = c.read_messages(2 * n)
    assert sorted(m.body for m in got) == sorted(bodies)
    c.send(b"".join(wire.fin(m.id) for m in got))
    c.assert_alive()


# -- negotiation ------------------------------------------------------------------------
def test_tls_refused_when_not_configured(any_broker: BrokerProcess, connect: Connect) -> None:
    c = connect(any_broker)
    c.send(wire.identify(feature_negotiation=True, tls_v1=True))
    assert c.expect_response(None) == expected_answer()
    c.assert_alive()  # still plaintext


def test_identify_answer_grants_each_feature(tls_broker: BrokerProcess,
                                             connect: Connect) -> None:
    c = connect(tls_broker)
    c.send(wire.identify(feature_negotiation=True, deflate=True, deflate_level=9))
    # matches nsqd: a level above max_deflate_level is clamped, not refused
    assert c.expect_response(None) == expected_answer(deflate=True, deflate_level=3,
                                                      max_deflate_level=3)
    c = connect(tls_broker)
    c.send(wire.identify(feature_negotiation=True, tls_v1=True, snappy=True))
    assert c.expect_response(None) == expected_answer(tls_v1=True, snappy=True,
                                                      deflate_level=3, max_deflate_level=3)


def test_both_compressions_at_once_fail(tls_broker: BrokerProcess, connect: Connect) -> None:
    c = connect(tls_broker)
    c.send(wire.identify(feature_negotiation=True, snappy=True, deflate=True))
    c.expect_error("E_IDENTIFY_FAILED", "E_IDENTIFY_FAILED cannot enable both deflate and "
                                        "snappy compression")


def test_disabled_compression_is_not_granted(make_any_broker: Callable[..., BrokerProcess],
                                             connect: Connect) -> None:
    b = make_any_broker("--snappy=false", "--deflate=false")
    c = connect(b)
    c.send(wire.identify(feature_negotiation=True, snappy=True, deflate=True))
    assert c.expect_response(None) == expected_answer()
    c.assert_alive()


@pytest.mark.parametrize("mode", ["tls", "snappy", "deflate", "tls+snappy", "tls+deflate"])
def test_each_mode_carries_the_protocol(tls_broker: BrokerProcess, connect: Connect,
                                        certs: CertSet, mode: str) -> None:
    c = connect(tls_broker)
    answer = negotiate(c, certs, tls="tls" in mode, snappy="snappy" in mode,
                       deflate="deflate" in mode, deflate_level=1)
    assert answer["tls_v1"] == ("tls" in mode)
    topic = unique_name("mode")
    roundtrip(c, topic)
    seen = client_stats(tls_broker, topic)
    assert seen, "the client is not in /stats"
    for s in seen:
        assert (s["tls"], s["snappy"], s["deflate"]) == (
            "tls" in mode, "snappy" in mode, "deflate" in mode)
        if "tls" in mode:
            assert s["tls_version"] == "TLS1.3"
            assert s["tls_cipher_suite"].startswith("Unknown 48")  # TLS 1.3 suites, unnamed
            assert s["tls_negotiated_protocol_is_mutual"] is True


def test_large_messages_over_tls_and_deflate(tls_broker: BrokerProcess, connect: Connect,
                                             certs: CertSet) -> None:
    c = connect(tls_broker)
    negotiate(c, certs, tls=True, deflate=True)
    topic = unique_name("big")
    bodies = [bytes([i]) * 300_000 for i in range(1, 4)]
    c.mpub(topic, bodies)
    c.sub(topic, "ch")
    c.rdy(10)
    assert sorted(m.body for m in c.read_messages(3)) == bodies


# -- tls_required --------------------------------------------------------------------------
@pytest.mark.parametrize("required", ["true", "tcp-https"])
def test_tls_required_refuses_plaintext(make_any_broker: Callable[..., BrokerProcess],
                                        connect: Connect, certs: CertSet,
                                        required: str) -> None:
    b = make_any_broker(*tls_args(certs, f"--tls-required={required}"))
    topic = unique_name()
    c = connect(b)
    c.send(wire.pub(topic, b"plain"))
    c.expect_error("E_INVALID", "E_INVALID cannot PUB in current state (TLS required)")
    c = connect(b)
    c.identify()
    c.send(wire.sub(topic, "ch"))
    c.expect_error("E_INVALID", "E_INVALID cannot SUB in current state (TLS required)")
    c = connect(b)
    negotiate(c, certs, tls=True)
    c.pub(topic, b"over tls")


# -- client certificates -----------------------------------------------------------------
@pytest.fixture
def verify_broker(make_module_broker: Callable[..., BrokerProcess], broker_kind: str,
                  certs: CertSet) -> BrokerProcess:
    return make_module_broker(*tls_args(certs, "--tls-client-auth-policy=require-verify",
                                        f"--tls-root-ca-file={certs.ca}",
                                        "--https-address=127.0.0.1:0"), kind=broker_kind)


def _start_tls(b: BrokerProcess) -> socket.socket:
    c = WireClient.connect(b.tcp_address)  # type: ignore[arg-type]
    c.send(wire.identify(feature_negotiation=True, tls_v1=True))
    assert json.loads(c.expect_response(None))["tls_v1"] is True
    return c.sock


def test_client_certificate_required_and_missing(verify_broker: BrokerProcess,
                                                 certs: CertSet) -> None:
    sock = _start_tls(verify_broker)
    try:
        _, raw = raw_handshake(sock, client_context(certs))
    finally:
        sock.close()
    # matches nsqd: after the TLS alert, a plaintext error frame, then the close
    text = b"E_IDENTIFY_FAILED IDENTIFY failed tls: client didn't provide a certificate"
    assert wire.encode_frame(wire.FRAME_ERROR, text) in raw, raw


def test_client_certificate_from_another_ca_is_refused(verify_broker: BrokerProcess,
                                                       certs: CertSet) -> None:
    sock = _start_tls(verify_broker)
    try:
        _, raw = raw_handshake(sock, client_context(certs, certs.stranger_cert,
                                                    certs.stranger_key))
    finally:
        sock.close()
    prefix = b"\x00\x00\x00\x01E_IDENTIFY_FAILED IDENTIFY failed tls: "
    assert prefix in raw, raw


def test_client_certificate_accepted(verify_broker: BrokerProcess, connect: Connect,
                                     certs: CertSet) -> None:
    c = connect(verify_broker)
    negotiate(c, certs, tls=True, cert=certs.client_cert, key=certs.client_key)
    topic = unique_name()
    c.pub(topic, b"with a client certificate")
    (s,) = client_stats(verify_broker, topic, certs)
    assert s["tls"] is True
    if verify_broker.kind == "pybroker":  # nsqd 1.3.0 does not show the name
        assert s["tls_client_cert_common_name"] == "client-1"


def test_stalled_handshake_closes_that_connection_only(tls_broker: BrokerProcess,
                                                       connect: Connect) -> None:
    stalled = connect(tls_broker)
    stalled.send(wire.identify(feature_negotiation=True, tls_v1=True))
    stalled.expect_response(None)
    other = connect(tls_broker)
    other.identify()
    other.assert_alive()  # served while the stalled handshake waits
    start = time.monotonic()
    # matches nsqd: the handshake has 5 s, then E_IDENTIFY_FAILED and a close
    ftype, data = wire.read_frame(stalled.sock, timeout=10)
    assert (ftype, data[:33]) == (wire.FRAME_ERROR, b"E_IDENTIFY_FAILED IDENTIFY failed")
    stalled.assert_closed()
    assert 3 < time.monotonic() - start < 9
    other.assert_alive()


def test_garbage_instead_of_a_handshake(tls_broker: BrokerProcess, connect: Connect) -> None:
    c = connect(tls_broker)
    c.send(wire.identify(feature_negotiation=True, tls_v1=True))
    c.expect_response(None)
    c.send(b"PUB t\n\x00\x00\x00\x01x" + b"\x00" * 64)
    c.expect_error("E_IDENTIFY_FAILED", "E_IDENTIFY_FAILED IDENTIFY failed tls: first record "
                                        "does not look like a TLS handshake")
