"""HTTPS on ``https_address``, on pybroker and nsqd 1.3.0 with the same certificates:
curl verifying the server with --cacert, client certificates, and tls_required."""
from __future__ import annotations

import json
import socket
import ssl
import subprocess
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.broker import BrokerProcess, unique_name
from tests.support.certs import CertSet, make_certs
from tests.support.layers import client_context
from tests.support.programs import require_program


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertSet:
    return make_certs(Path(tmp_path_factory.mktemp("certs")))


def _tls(certs: CertSet, *extra: str) -> tuple[str, ...]:
    return (f"--tls-cert={certs.server_cert}", f"--tls-key={certs.server_key}",
            "--https-address=127.0.0.1:0", *extra)


def _curl(*args: str) -> subprocess.CompletedProcess[str]:
    curl = require_program("curl", "to check the HTTPS listener with")
    return subprocess.run([curl, "-sS", "--max-time", "10", *args], capture_output=True,
                          text=True, timeout=20)


def test_https_serves_the_api_verified_with_cacert(
        make_any_broker: Callable[..., BrokerProcess], certs: CertSet) -> None:
    b = make_any_broker(*_tls(certs))
    assert b.https_address is not None
    base = f"https://localhost:{b.https_address[1]}"
    r = _curl("--cacert", certs.ca, f"{base}/ping")
    assert (r.returncode, r.stdout) == (0, "OK"), r.stderr
    topic = unique_name()
    r = _curl("--cacert", certs.ca, "-d", "over https", f"{base}/pub?topic={topic}")
    assert (r.returncode, r.stdout) == (0, "OK"), r.stderr
    r = _curl("--cacert", certs.ca, f"{base}/stats?format=json&topic={topic}")
    stats = json.loads(r.stdout)
    assert stats["topics"][0]["message_count"] == 1
    # without the CA, curl refuses the server's certificate
    r = _curl(f"{base}/ping")
    assert r.returncode == 60, (r.returncode, r.stderr)
    # plain HTTP stays open when TLS is not required
    with urllib.request.urlopen(f"http://{b.http_hostport}/ping", timeout=5) as resp:
        assert resp.read() == b"OK"


def test_https_with_a_required_client_certificate(
        make_any_broker: Callable[..., BrokerProcess], certs: CertSet) -> None:
    b = make_any_broker(*_tls(certs, "--tls-client-auth-policy=require-verify",
                              f"--tls-root-ca-file={certs.ca}"))
    assert b.https_address is not None
    base = f"https://localhost:{b.https_address[1]}"
    r = _curl("--cacert", certs.ca, "--cert", certs.client_cert, "--key", certs.client_key,
              f"{base}/ping")
    assert (r.returncode, r.stdout) == (0, "OK"), r.stderr
    r = _curl("--cacert", certs.ca, f"{base}/ping")  # no client certificate
    assert r.returncode != 0 and r.stdout == ""
    ctx = client_context(certs, certs.stranger_cert, certs.stranger_key)
    with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
        urllib.request.urlopen(f"{base}/ping", timeout=5, context=ctx).read()
    # the policy implies tls_required=true: plain HTTP is refused with nsqd's body
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"http://{b.http_hostport}/ping", timeout=5)
    assert e.value.code == 403
    body = e.value.read()
    assert body == b'{"message": "TLS_REQUIRED", "https_port": %d}' % b.https_address[1]


def test_tls_required_tcp_https_leaves_plain_http_open(
        make_any_broker: Callable[..., BrokerProcess], certs: CertSet) -> None:
    b = make_any_broker(*_tls(certs, "--tls-required=tcp-https"))
    with urllib.request.urlopen(f"http://{b.http_hostport}/ping", timeout=5) as resp:
        assert resp.read() == b"OK"


def test_plain_http_sent_to_the_https_port(make_any_broker: Callable[..., BrokerProcess],
                                           certs: CertSet) -> None:
    b = make_any_broker(*_tls(certs))
    assert b.https_address is not None
    with socket.create_connection(b.https_address, timeout=5) as sock:
        sock.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while chunk := sock.recv(4096):
            data += chunk
    # matches Go's net/http
    assert data == b"HTTP/1.0 400 Bad Request\r\n\r\nClient sent an HTTP request to an HTTPS server.\n"
    # the broker is unaffected
    r = _curl("--cacert", certs.ca, f"https://localhost:{b.https_address[1]}/ping")
    assert r.stdout == "OK"
