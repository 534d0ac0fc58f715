"""pybroker.client and the tools over TLS, snappy, deflate and AUTH, against pybroker and
nsqd 1.3.0 started with the same test-made certificates; /stats shows the negotiation."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pybroker.client import Consumer, Message, Producer
from pybroker.client.errors import IdentifyError
from tests.support.broker import BrokerProcess, unique_name, wait_until
from tests.support.certs import CertSet, make_certs

pytestmark = pytest.mark.timeout(120)
MODES = ["tls", "snappy", "deflate", "tls+snappy", "tls+deflate"]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertSet:
    return make_certs(Path(tmp_path_factory.mktemp("certs")))


@pytest.fixture
def tls_broker(make_module_broker: Callable[..., BrokerProcess], broker_kind: str,
               certs: CertSet) -> BrokerProcess:
    return make_module_broker(f"--tls-cert={certs.server_cert}",
                              f"--tls-key={certs.server_key}", kind=broker_kind)


def mode_options(mode: str, certs: CertSet) -> dict[str, Any]:
    opts: dict[str, Any] = {"snappy": "snappy" in mode, "deflate": "deflate" in mode,
                            "deflate_level": 3}
    if "tls" in mode:
        opts.update(tls_v1=True, tls_root_ca_file=certs.ca)
    return opts


def clients_of(b: BrokerProcess, topic: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"http://{b.http_hostport}/stats?format=json&topic={topic}",
                                timeout=5) as r:
        stats = json.load(r)
    out = [p for p in stats["producers"]
           if any(pc["topic"] == topic for pc in p.get("pub_counts", []))]
    return out + [c for t in stats["topics"] for ch in t["channels"] for c in ch["clients"]]


@pytest.mark.parametrize("mode", MODES)
def test_client_publishes_and_consumes(tls_broker: BrokerProcess, certs: CertSet,
                                       mode: str) -> None:
    topic = unique_name("cli_tls")
    opts = mode_options(mode, certs)
    got: list[bytes] = []
    lock = threading.Lock()

    def handler(m: Message) -> None:
        with lock:
            got.append(m.body)

    bodies = [b"m%d-" % i + b"y" * (i % 700) for i in range(3000)]
    with Producer(tls_broker.tcp_hostport, **opts) as p:
        for i in range(0, 2000, 100):
            p.multi_publish(topic, bodies[i:i + 100])
        for body in bodies[2000:]:
            p.publish(topic, body)
        c = Consumer(topic, "ch", handler, max_in_flight=200, **opts)
        c.connect_to_nsqd(tls_broker.tcp_hostport)
        try:
            wait_until(lambda: len(got) >= len(bodies), 30, what="every message")
            seen = clients_of(tls_broker, topic)
            assert len(seen) == 2
            for s in seen:
                assert (s["tls"], s["snappy"], s["deflate"]) == (
                    "tls" in mode, "snappy" in mode, "deflate" in mode), s
        finally:
            c.stop()
    assert sorted(got) == sorted(bodies)


def test_client_certificate_and_insecure_skip_verify(
        make_any_broker: Callable[..., BrokerProcess], certs: CertSet) -> None:
    b = make_any_broker(f"--tls-cert={certs.server_cert}", f"--tls-key={certs.server_key}",
                        "--tls-client-auth-policy=require-verify",
                        f"--tls-root-ca-file={certs.ca}")
    topic = unique_name("cli_cert")
    with Producer(b.tcp_hostport, tls_v1=True, tls_root_ca_file=certs.ca,
                  tls_cert=certs.client_cert, tls_key=certs.client_key) as p:
        p.publish(topic, b"with a client certificate")
    with Producer(b.tcp_hostport, tls_v1=True, tls_insecure_skip_verify=True,
                  tls_cert=certs.client_cert, tls_key=certs.client_key) as p:
        p.publish(topic, b"server certificate not checked")
    with pytest.raises((IdentifyError, OSError)):
        with Producer(b.tcp_hostport, tls_v1=True, tls_root_ca_file=certs.ca) as p:
            p.publish(topic, b"no client certificate")  # refused by the server


def test_client_refuses_an_unknown_server_certificate(tls_broker: BrokerProcess) -> None:
    with pytest.raises(IdentifyError, match="TLS handshake failed"):
        with Producer(tls_broker.tcp_hostport, tls_v1=True) as p:  # system CAs only
            p.publish(unique_name(), b"x")


@pytest.mark.parametrize("mode", ["tls", "snappy", "deflate"])
def test_tools_take_go_tool_options(tls_broker: BrokerProcess, certs: CertSet,
                                    mode: str) -> None:
    """pub (to_nsq) and tail (nsq_tail) with go-nsq's --producer-opt/--consumer-opt."""
    topic = unique_name("tool_tls")
    opts = {"tls": ["tls_v1,true", f"tls_root_ca_file,{certs.ca}"],
            "snappy": ["snappy,true"], "deflate": ["deflate,true", "deflate_level,2"]}[mode]
    pub = subprocess.run(
        [sys.executable, "-m", "pybroker", "pub", f"--topic={topic}",
         f"--nsqd-tcp-address={tls_broker.tcp_hostport}",
         *[f"--producer-opt={o}" for o in opts]],
        input=b"one\ntwo\nthree\n", capture_output=True, timeout=60)
    assert pub.returncode == 0, pub.stderr.decode()
    tail = subprocess.run(
        [sys.executable, "-m", "pybroker", "tail", f"--topic={topic}",
         f"--nsqd-tcp-address={tls_broker.tcp_hostport}", "-n", "3",
         *[f"--consumer-opt={o}" for o in opts]],
        capture_output=True, timeout=60)
    assert tail.returncode == 0, tail.stderr.decode()
    assert tail.stdout.split() == [b"one", b"two", b"three"]


def test_stat_reads_stats_over_https(make_any_broker: Callable[..., BrokerProcess],
                                     certs: CertSet) -> None:
    """stat with nsqadmin's --http-client-tls-* flags, against a broker that refuses
    plain HTTP (tls_required=true) and wants a client certificate."""
    b = make_any_broker(f"--tls-cert={certs.server_cert}", f"--tls-key={certs.server_key}",
                        "--tls-client-auth-policy=require-verify",
                        f"--tls-root-ca-file={certs.ca}", "--https-address=127.0.0.1:0")
    assert b.https_address is not None
    topic = unique_name("stat_tls")
    with Producer(b.tcp_hostport, tls_v1=True, tls_root_ca_file=certs.ca,
                  tls_cert=certs.client_cert, tls_key=certs.client_key) as p:
        p.publish(topic, b"counted")
        c = Consumer(topic, "ch", lambda m: None, tls_v1=True, tls_root_ca_file=certs.ca,
                     tls_cert=certs.client_cert, tls_key=certs.client_key)
        c.connect_to_nsqd(b.tcp_hostport)
        try:
            r = subprocess.run(
                [sys.executable, "-m", "pybroker", "stat", f"--topic={topic}",
                 "--channel=ch", f"--nsqd-http-address=localhost:{b.https_address[1]}",
                 "--count=1", "--interval=200ms",
                 f"--http-client-tls-root-ca-file={certs.ca}",
                 f"--http-client-tls-cert={certs.client_cert}",
                 f"--http-client-tls-key={certs.client_key}"],
                capture_output=True, timeout=60)
        finally:
            c.stop()
    assert r.returncode == 0, r.stderr.decode()
    rows = r.stdout.decode().splitlines()
    assert len(rows) >= 3 and rows[-1].split()[-1] == "1", rows  # one client counted


def test_client_and_tools_auth_secret(make_any_broker: Callable[..., BrokerProcess]) -> None:
    from pybroker.client.errors import AuthError
    from tests.integration.test_auth import AuthServer

    server = AuthServer()
    try:
        b = make_any_broker(f"--auth-http-address={server.address}")
        topic = unique_name("pub")
        with Producer(b.tcp_hostport, auth_secret="good") as p:
            p.publish(topic, b"authorised")
        assert server.queries[-1]["secret"] == "good"
        with pytest.raises(AuthError, match="E_UNAUTHORIZED"):
            with Producer(b.tcp_hostport, auth_secret="none") as p:
                p.publish(topic, b"x")
        r = subprocess.run(
            [sys.executable, "-m", "pybroker", "pub", f"--topic={topic}",
             f"--nsqd-tcp-address={b.tcp_hostport}", "--producer-opt=auth_secret,good"],
            input=b"via the tool\n", capture_output=True, timeout=60)
        assert r.returncode == 0, r.stderr.decode()
    finally:
        server.stop()
