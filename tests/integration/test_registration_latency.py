"""Topics and channels reach nsqlookupd at once, as nsqd's lookupLoop sends them.

A real nsqlookupd (skipped when none is on PATH) and the broker registered with it; each
topic or channel is created or deleted the ways clients do it (PUB, MPUB and DPUB over
TCP, /pub and /mpub over HTTP, /topic/create, SUB, /channel/create, /topic/delete, an
ephemeral channel's last consumer leaving), then nsqlookupd's
/lookup (or /channels) is polled over one keep-alive connection until it shows the
change. The time from the broker's answer to nsqlookupd's is the registration latency:
nsqd's is well under a millisecond; pybroker's must stay within a few (median <= 10 ms),
however the registrar waits between its PINGs. The same test runs against nsqd.
"""
from __future__ import annotations

import http.client
import json
import re
import shutil
import statistics
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from tests.support import wire
from tests.support.broker import BrokerProcess, unique_name, wait_until

pytestmark = pytest.mark.skipif(shutil.which("nsqlookupd") is None,
                                reason="no nsqlookupd binary on PATH to register with")
MEDIAN_LIMIT_MS = 10.0
EACH_LIMIT_MS = 250.0  # far below the registrar's old 1 s wake-up and 15 s PING interval


class Lookupd:
    """A real nsqlookupd on ephemeral loopback ports (its log in a file, so a full pipe
    never stalls it), stopped by PID."""

    def __init__(self, log_path: Path) -> None:
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(["nsqlookupd", "--tcp-address=127.0.0.1:0",
                                      "--http-address=127.0.0.1:0"],
                                     stdout=subprocess.DEVNULL, stderr=self.log)

        def listening() -> dict[str, str] | None:
            assert self.proc.poll() is None, "nsqlookupd exited"
            found = dict(re.findall(r"(TCP|HTTP): listening on (\S+)", log_path.read_text()))
            return found if len(found) == 2 else None

        addrs: Any = wait_until(listening, timeout_s=10, what="nsqlookupd to listen")
        self.tcp, self.http = addrs["TCP"], addrs["HTTP"]
        host, _, port = self.http.rpartition(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=5)

    def get(self, path: str) -> tuple[int, Any]:
        self.conn.request("GET", path)
        r = self.conn.getresponse()
        return r.status, json.loads(r.read() or b"null")

    def producers(self, topic: str) -> list[int]:
        status, body = self.get(f"/lookup?topic={topic}")
        return [p["tcp_port"] for p in body["producers"]] if status == 200 else []

    def channels(self, topic: str) -> list[str]:
        status, body = self.get(f"/channels?topic={topic}")
        return list(body["channels"]) if status == 200 else []

    def stop(self) -> None:
        self.conn.close()
        self.proc.terminate()
        self.proc.wait(10)
        self.log.close()


@pytest.fixture
def lookupd(tmp_path: Path) -> Iterator[Lookupd]:
    lk = Lookupd(tmp_path / "nsqlookupd.log")
    yield lk
    lk.stop()


def _http(b: BrokerProcess, method: str, path: str, body: bytes = b"") -> None:
    assert b.http_address is not None
    host, port = b.http_address
    req = urllib.request.Request(f"http://{host}:{port}{path}", data=body or None,
                                 method=method)
    with urllib.request.urlopen(req, timeout=5) as r:
        assert r.status == 200


def _latency_ms(change: Callable[[], None], seen: Callable[[], bool]) -> float:
    """Make the change (its answer received), then poll until nsqlookupd shows it."""
    change()
    t0 = time.perf_counter()
    deadline = t0 + 5.0
    while not seen():
        if time.perf_counter() > deadline:
            raise AssertionError("nsqlookupd never saw the change")
    return (time.perf_counter() - t0) * 1000


def test_creation_and_deletion_reach_nsqlookupd_at_once(
        lookupd: Lookupd, broker_kind: str, make_broker: Callable[..., BrokerProcess]) -> None:
    b = make_broker(f"--lookupd-tcp-address={lookupd.tcp}", kind=broker_kind)
    assert b.tcp_address is not None
    port = b.tcp_address[1]
    # the broker's IDENTIFY is in: from here on the registrar waits for changes or PINGs
    wait_until(lambda: any(p["tcp_port"] == port for p in lookupd.get("/nodes")[1]["producers"]),
               timeout_s=10, what="the broker in nsqlookupd's /nodes")
    pub = wire.WireClient.connect(b.tcp_address)
    subs: list[wire.WireClient] = []
    figures: dict[str, float] = {}

    def tcp(cmd: bytes) -> Callable[[], None]:
        def run() -> None:
            pub.send(cmd)
            assert pub.read_frame()[1] == b"OK"
        return run

    def subscribe(topic: str, channel: str) -> Callable[[], None]:
        def run() -> None:
            c = wire.WireClient.connect(b.tcp_address)  # type: ignore[arg-type]
            c.send(wire.sub(topic, channel))
            assert c.read_frame()[1] == b"OK"
            subs.append(c)
        return run

    try:
        topics = {k: unique_name(k) for k in ("pub", "mpub", "dpub", "http_pub", "http_mpub",
                                              "create", "pub2", "pub3")}
        makers = {
            "pub": tcp(wire.pub(topics["pub"], b"x")),
            "mpub": tcp(wire.mpub(topics["mpub"], [b"a", b"b"])),
            "dpub": tcp(wire.dpub(topics["dpub"], 1000, b"x")),
            "http_pub": lambda: _http(b, "POST", f"/pub?topic={topics['http_pub']}", b"x"),
            "http_mpub": lambda: _http(b, "POST", f"/mpub?topic={topics['http_mpub']}",
                                       b"a\nb"),
            "create": lambda: _http(b, "POST", f"/topic/create?topic={topics['create']}"),
            "pub2": tcp(wire.pub(topics["pub2"], b"x")),
            "pub3": tcp(wire.pub(topics["pub3"], b"x")),
        }
        for kind, make in makers.items():
            figures[f"topic via {kind}"] = _latency_ms(
                make, lambda t=topics[kind]: port in lookupd.producers(t))  # type: ignore[misc]
        t = topics["pub"]
        figures["channel via SUB"] = _latency_ms(
            subscribe(t, "c1"), lambda: "c1" in lookupd.channels(t))
        figures["channel via /channel/create"] = _latency_ms(
            lambda: _http(b, "POST", f"/channel/create?topic={t}&channel=c2"),
            lambda: "c2" in lookupd.channels(t))
        # nsqlookupd keeps a deleted channel's name with no producer, except an ephemeral
        # one: that goes when its last consumer does (UNREGISTER), which shows
        figures["channel via SUB #ephemeral"] = _latency_ms(
            subscribe(t, "c3#ephemeral"), lambda: "c3#ephemeral" in lookupd.channels(t))
        figures["ephemeral channel gone"] = _latency_ms(
            lambda: subs.pop().close(), lambda: "c3#ephemeral" not in lookupd.channels(t))
        figures["topic /topic/delete"] = _latency_ms(
            lambda: _http(b, "POST", f"/topic/delete?topic={topics['create']}"),
            lambda: port not in lookupd.producers(topics["create"]))
    finally:
        pub.close()
        for c in subs:
            c.close()
    report = ", ".join(f"{k} {v:.2f} ms" for k, v in figures.items())
    print(f"{broker_kind} registration latency: {report}")
    median = statistics.median(figures.values())
    assert median <= MEDIAN_LIMIT_MS, report
    assert max(figures.values()) <= EACH_LIMIT_MS, report
