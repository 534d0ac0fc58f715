"""Abuse and operator mistakes, against the real server process: a second broker on the
same data_path, numbers no client should send, JSON nested without end, and running out
of file descriptors. Each case gets nsqd's answer (compared with a real nsqd where one
is found), never a traceback, a hang or a dead loop."""
from __future__ import annotations

import json
import resource
import socket
import subprocess
import threading
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable

import pytest

from tests.support.broker import BrokerProcess, rss_kb, project_root, unique_name, wait_until
from tests.support.durability import consume, ping
from tests.support.wire import WireClient, command, identify

MakeBroker = Callable[..., BrokerProcess]
HUGE = "9" * 5000          # past Python's 4,300-digit int-string limit


def test_second_broker_on_the_same_data_path_exits_2(make_broker: MakeBroker) -> None:
    b = make_broker()
    topic = unique_name("lock")
    with WireClient.connect(b.tcp_address) as c:  # type: ignore[arg-type]
        c.pub(topic, b"kept")
    second = subprocess.run(
        [sys.executable, "-m", "pybroker", "serve", "--tcp-address=127.0.0.1:0",
         "--http-address=127.0.0.1:0", f"--data-path={b.data_path}"],
        cwd=project_root(), capture_output=True, text=True, timeout=30)
    assert second.returncode == 2, second.stderr
    problems = [ln for ln in second.stderr.splitlines() if " INFO: " not in ln]
    assert len(problems) == 1 and "failed to lock data-path" in problems[0], second.stderr
    assert str(b.data_path) in problems[0]
    # the first one is untouched: it serves, and a restart keeps the message
    assert ping(b) == (200, "OK")
    b.stop()
    b.start()
    assert [r.msg.body for r in consume(b, topic, "ch", expect=1)] == [b"kept"]


@pytest.fixture(params=["pybroker", "pybroker-2-loops", "nsqd"])
def odd_broker(request: pytest.FixtureRequest, make_broker: MakeBroker) -> BrokerProcess:
    if request.param == "nsqd":
        return make_broker(kind="nsqd")
    if request.param == "pybroker-2-loops":
        return make_broker("--loop-threads=2")
    return make_broker()


def _subscribed(b: BrokerProcess) -> WireClient:
    c = WireClient.connect(b.tcp_address)  # type: ignore[arg-type]
    c.sub(unique_name("odd"), "ch")
    return c


def test_huge_rdy_count_is_nsqds_error(odd_broker: BrokerProcess) -> None:
    # nsqd parses digits into a uint64 that wraps, then checks the range
    c = _subscribed(odd_broker)
    c.send(command("RDY", HUGE))
    # 5,000 nines wrap to 2**64 - 1, which is -1 as an int64
    c.expect_error("E_INVALID", "E_INVALID RDY count -1 out of range 0-2500")
    c.assert_closed()


def test_huge_req_timeout_is_clamped(odd_broker: BrokerProcess) -> None:
    b = odd_broker
    topic = unique_name("oddreq")
    c = WireClient.connect(b.tcp_address)  # type: ignore[arg-type]
    c.sub(topic, "ch")
    c.rdy(1)
    with WireClient.connect(b.tcp_address) as p:  # type: ignore[arg-type]
        p.pub(topic, b"m")
    m = c.read_message()
    c.send(command("REQ", m.id, HUGE))
    c.assert_alive()      # clamped into range: no error, connection open
    c.close()


def test_huge_dpub_timeout_is_nsqds_error(odd_broker: BrokerProcess) -> None:
    with WireClient.connect(odd_broker.tcp_address) as c:  # type: ignore[arg-type]
        c.send(command("DPUB", unique_name("odddpub"), HUGE, body=b"x"))
        c.expect_error("E_INVALID",
                       "E_INVALID DPUB timeout 18446744073709551615 out of range 0-3600000")
        c.assert_closed()


def test_huge_http_defer_is_invalid(odd_broker: BrokerProcess) -> None:
    url = f"http://{odd_broker.http_hostport}/pub?topic={unique_name('odddefer')}&defer={HUGE}"
    req = urllib.request.Request(url, data=b"x", method="POST")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 400 and json.loads(e.value.read()) == {"message": "INVALID_DEFER"}


def test_deeply_nested_identify_is_a_bad_body(odd_broker: BrokerProcess) -> None:
    body = b'{"client_id": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with WireClient.connect(odd_broker.tcp_address) as c:  # type: ignore[arg-type]
        c.send(command("IDENTIFY", body=body))
        c.expect_error("E_BAD_BODY", "E_BAD_BODY IDENTIFY failed to decode JSON body")
        c.assert_closed()
    # and the broker serves on
    with WireClient.connect(odd_broker.tcp_address) as c:  # type: ignore[arg-type]
        c.send(identify(client_id="after"))
        c.expect_response(b"OK")


def test_out_of_file_descriptors_no_spin_and_service_resumes(make_broker: MakeBroker) -> None:
    """With the fd limit reached, accept fails: the listener backs off instead of
    spinning (a rate-limited log line, not thousands), and once clients leave, new
    ones are served again. The start-up log says the limit was raised."""
    b = make_broker()
    assert any("fd limit" in ln for ln in b.stderr_lines), b.stderr_text()
    assert b.proc is not None
    pid = b.proc.pid
    # every part of the broker up and serving (HTTP and TCP answer) before its fds run
    # short: the test is about accepting, not about a start-up that was still opening
    wait_until(lambda: ping(b) == (200, "OK"), timeout_s=10, what="/ping before the test")
    with WireClient.connect(b.tcp_address) as c:  # type: ignore[arg-type]
        c.send(identify(client_id="first"))
        c.expect_response(b"OK")
    _, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (64, hard))
    socks = []
    try:
        for _ in range(120):
            s = socket.create_connection(b.tcp_address, timeout=5)  # type: ignore[arg-type]
            socks.append(s)
        wait_until(lambda: any("accept failed" in ln for ln in b.stderr_lines),
                   what="an accept failure")
        before = sum("accept failed" in ln for ln in b.stderr_lines)
        time.sleep(2.0)     # the log rate over two seconds
        after = sum("accept failed" in ln for ln in b.stderr_lines)
        assert after - before <= 3, f"{after - before} accept-failure lines in 2 s"
    finally:
        for s in socks:
            s.close()
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (hard, hard))
    wait_until(lambda: ping(b) == (200, "OK"), timeout_s=10, what="/ping once fds are free")
    with WireClient.connect(b.tcp_address) as c:  # type: ignore[arg-type]
        c.send(identify(client_id="back"))
        c.expect_response(b"OK")


@pytest.mark.parametrize("verb", ["FIN", "PUB"])
def test_client_that_never_reads_costs_bounded_memory(make_broker: MakeBroker,
                                                      verb: str) -> None:
    """A client streams commands that each get a reply (E_FIN_FAILED for unknown ids, or
    OK for PUBs) and never reads one. The broker stops reading it once its unread
    replies pass the cap: its memory stays bounded, and another client's round trips
    stay fast."""
    b = make_broker()
    assert b.proc is not None
    topic = unique_name("flood")
    flood = socket.create_connection(b.tcp_address)  # type: ignore[arg-type]
    flood.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    flood.sendall(b"  V2")
    if verb == "FIN":
        flood.sendall(b"SUB " + topic.encode() + b" ch\n")
        chunk = b"".join(b"FIN %016x\n" % (10**12 + i) for i in range(5000))
    else:
        chunk = (b"PUB " + topic.encode() + b"\n" + (4).to_bytes(4, "big") + b"spam") * 5000
    flood.setblocking(False)
    rss0 = rss_kb(b.proc.pid)
    sent = 0
    rtts = []
    deadline = time.monotonic() + 8
    left = memoryview(b"")
    with WireClient.connect(b.tcp_address) as probe:  # type: ignore[arg-type]
        while time.monotonic() < deadline:
            if not left:
                left = memoryview(chunk)    # whole commands only, never cut between
            try:
                n = flood.send(left)
                sent += n
                left = left[n:]
            except BlockingIOError:
                pass           # the broker stopped reading us: as it should
            t0 = time.perf_counter()
            probe.pub(topic + "_probe", b"p")
            rtts.append(time.perf_counter() - t0)
    grew = rss_kb(b.proc.pid) - rss0
    flood.close()
    print(f"{verb}: sent {sent / 1e6:.1f} MB without reading; RSS grew {grew / 1024:.1f} MiB; "
          f"probe max {max(rtts) * 1e3:.1f} ms over {len(rtts)} round trips")
    assert grew < 100 * 1024, f"RSS grew by {grew / 1024:.0f} MiB"
    assert max(rtts) < 0.5
    assert ping(b) == (200, "OK")


def test_delete_and_create_topics_while_publishing(make_broker: MakeBroker) -> None:
    """Topics deleted and created over HTTP again and again while clients publish to
    them: publishes land on the topic of that name (the old one, or the new one), no
    publisher is closed, no E_PUB_FAILED, no traceback, and /ping stays OK."""
    from tests.support.durability import http

    b = make_broker("--loop-threads=2")
    topics = [unique_name("churn") for _ in range(3)]
    stop = threading.Event()
    errors: list[str] = []
    counts = [0]

    def publisher(i: int) -> None:
        try:
            with WireClient.connect(b.tcp_address) as c:  # type: ignore[arg-type]
                while not stop.is_set():
                    c.pub(topics[i % len(topics)], b"x")
                    c.mpub(topics[(i + 1) % len(topics)], [b"y"] * 20)
                    counts[0] += 1
        except Exception as e:   # any error answer or a closed connection
            errors.append(f"{type(e).__name__}: {e}")

    pubs = [threading.Thread(target=publisher, args=(i,)) for i in range(4)]
    for p in pubs:
        p.start()
    deadline = time.monotonic() + 5
    n = 0
    while time.monotonic() < deadline:
        t = topics[n % len(topics)]
        assert http(b, "POST", f"/topic/delete?topic={t}")[0] in (200, 404)
        assert http(b, "POST", f"/channel/create?topic={t}&channel=ch")[0] in (200, 404)
        n += 1
    stop.set()
    for p in pubs:
        p.join(10)
    assert not errors, errors[:5]
    assert counts[0] > 100 and n > 50
    assert ping(b) == (200, "OK")
    assert "Traceback" not in b.stderr_text()


def test_two_thousand_connections_held_and_served() -> None:
    """loadtest/bench_connections.py, small: 2,000 connections (half consumers with RDY
    1 on 100 channels, half producers) are all answered and served while held."""
    out = subprocess.run([sys.executable, "loadtest/bench_connections.py", "--connections",
                          "2000", "--hold", "2"], cwd=project_root(), capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2000 of 2000 connections answered" in out.stdout, out.stdout
    assert "received by the held consumers (approx.): 1000" in out.stdout, out.stdout
