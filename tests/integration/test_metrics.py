"""GET /metrics (pybroker only: nsqd has no Prometheus endpoint), parsed with
prometheus_client's own text parser and checked against /stats; and statsd pushes,
which pybroker sends as nsqd does (both brokers, received on a UDP socket here).
"""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pybroker._native.batchio import Sender
from tests.support.broker import BrokerProcess, loadtest_module, unique_name, wait_until
from tests.support.wire import WireClient

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def http(b: BrokerProcess, method: str, path: str, body: bytes | None = None) -> Any:
    req = urllib.request.Request(f"http://{b.http_hostport}{path}", body, method=method)
    return urllib.request.urlopen(req, timeout=10)


def scrape(b: BrokerProcess) -> tuple[Samples, dict[str, str]]:
    """All samples as {(name, sorted labels): value}, and each family's type."""
    with http(b, "GET", "/metrics") as r:
        assert r.status == 200
        assert r.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        text = r.read().decode()
    samples: Samples = {}
    types: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples, types


def stats(b: BrokerProcess, topic: str) -> dict[str, Any]:
    with http(b, "GET", f"/stats?format=json&include_mem=false&topic={topic}") as r:
        t: dict[str, Any] = json.loads(r.read())["topics"][0]
        return t


def _per_loop(samples: Samples, name: str) -> dict[str, float]:
    """A per-loop family's samples: loop name -> value."""
    return {dict(k[1])["loop"]: v for k, v in samples.items() if k[0] == name}


def test_metrics_parse_and_agree_with_stats(broker: BrokerProcess) -> None:
    topic = unique_name("prom")
    assert broker.tcp_address
    with WireClient.connect(broker.tcp_address) as c:
        c.sub(topic, "ch")
        http(broker, "POST", f"/mpub?topic={topic}", b"a\nbb\nccc").close()
        c.rdy(1)
        m1 = c.read_message()
        c.req(m1.id, 60_000)  # deferred; m2 takes its place, m3 stays queued
        c.read_message()
        c.rdy(0)
        wait_until(lambda: stats(broker, topic)["channels"][0]["deferred_count"] == 1,
                   what="the REQ")
        samples, types = scrape(broker)
        t = stats(broker, topic)
    ch = t["channels"][0]
    tl = (("topic", topic),)
    cl = (("channel", "ch"), ("topic", topic))
    assert samples[("nsq_topic_depth", tl)] == t["depth"] == 0
    assert samples[("nsq_topic_messages_total", tl)] == t["message_count"] == 3
    assert samples[("nsq_topic_message_bytes_total", tl)] == t["message_bytes"] == 6
    assert samples[("nsq_topic_paused", tl)] == 0
    assert samples[("nsq_channel_depth", cl)] == ch["depth"] == 1
    assert samples[("nsq_channel_in_flight_messages", cl)] == ch["in_flight_count"] == 1
    assert samples[("nsq_channel_deferred_messages", cl)] == ch["deferred_count"] == 1
    assert samples[("nsq_channel_messages_total", cl)] == ch["message_count"] == 3
    assert samples[("nsq_channel_requeued_total", cl)] == ch["requeue_count"] == 1
    assert samples[("nsq_channel_timed_out_total", cl)] == ch["timeout_count"] == 0
    assert samples[("nsq_channel_clients", cl)] == ch["client_count"] == 1
    assert types["nsq_topic_messages"] == "counter" and types["nsq_channel_depth"] == "gauge"
    loops = _per_loop(samples, "nsq_loop_connections")
    assert loops and all(name.startswith("loop-") for name in loops)
    owned = _per_loop(samples, "nsq_loop_channels")
    assert set(owned) == set(loops) and sum(owned.values()) >= 1
    assert samples[("nsq_healthy", ())] == 1
    assert samples[("process_resident_memory_bytes", ())] > 1_000_000
    assert samples[("process_open_fds", ())] > 3
    assert samples[("process_cpu_seconds_total", ())] > 0
    assert abs(samples[("process_start_time_seconds", ())] - time.time()) < 24 * 3600
    assert samples[("nsq_http_requests_total", (("code", "200"),))] >= 1
    assert samples[("nsq_http_connections", ())] >= 1


def test_metrics_loop_connections_count_clients(broker: BrokerProcess) -> None:
    def total() -> float:
        samples, _ = scrape(broker)
        return sum(_per_loop(samples, "nsq_loop_connections").values())

    before = total()
    assert broker.tcp_address
    clients = [WireClient.connect(broker.tcp_address) for _ in range(5)]
    try:
        for c in clients:
            c.pub(unique_name("promc"), b"x")
        wait_until(lambda: total() >= before + 5, what="5 more connections")
    finally:
        for c in clients:
            c.close()
    wait_until(lambda: total() <= before, what="the connections to go")


def test_metrics_time_each_loops_turns(broker: BrokerProcess) -> None:
    """pybroker_loop_turn_seconds: a histogram per loop thread and for the HTTP server
    (parsed by prometheus_client), its buckets cumulative up to +Inf = its count, which
    grows with the turns traffic makes; the longest turn beside it."""
    def turns() -> dict[str, float]:
        samples, types = scrape(broker)
        assert types["pybroker_loop_turn_seconds"] == "histogram"
        counts = _per_loop(samples, "pybroker_loop_turn_seconds_count")
        for loop, n in counts.items():
            buckets = sorted(((float(dict(k[1])["le"]), v) for k, v in samples.items()
                              if k[0] == "pybroker_loop_turn_seconds_bucket"
                              and dict(k[1])["loop"] == loop))
            assert [le for le, _ in buckets] == [0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5,
                                                 float("inf")]
            assert all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:]))
            assert buckets[-1][1] == n
            assert samples[("pybroker_loop_turn_seconds_sum", (("loop", loop),))] >= 0
            assert samples[("pybroker_loop_turn_longest_seconds", (("loop", loop),))] >= 0
        return counts

    before = turns()
    assert "http" in before and len(before) >= 2     # the loops and the HTTP server
    assert all(n > 0 for n in before.values())
    assert broker.tcp_address
    c = WireClient.connect(broker.tcp_address)
    try:
        for _ in range(20):
            c.pub(unique_name("turns"), b"x")
    finally:
        c.close()
    wait_until(lambda: sum(turns().values()) >= sum(before.values()) + 20,
               what="the turns of 20 publishes counted")


def test_metrics_method_and_paused(broker: BrokerProcess) -> None:
    with pytest.raises(urllib.error.HTTPError) as e:
        http(broker, "POST", "/metrics")
    assert e.value.code == 405
    topic = unique_name("promp")
    http(broker, "POST", f"/topic/create?topic={topic}").close()
    http(broker, "POST", f"/channel/create?topic={topic}&channel=c").close()
    http(broker, "POST", f"/channel/pause?topic={topic}&channel=c").close()
    samples, _ = scrape(broker)
    assert samples[("nsq_channel_paused", (("channel", "c"), ("topic", topic)))] == 1


def test_metrics_e2e_quantiles(make_broker: Callable[..., BrokerProcess]) -> None:
    b = make_broker("--e2e-processing-latency-percentile=0.99,0.5")
    topic = unique_name("prome")
    assert b.tcp_address
    with WireClient.connect(b.tcp_address) as c:
        c.sub(topic, "ch")
        c.rdy(5)
        http(b, "POST", f"/mpub?topic={topic}", b"1\n2\n3\n4\n5").close()
        for m in c.read_messages(5):
            c.fin(m.id)
        c.pub(topic + "_probe", b"x")
    samples, _ = scrape(b)
    for q in ("0.99", "0.5"):
        v = samples[("nsq_channel_e2e_processing_latency_seconds",
                     (("channel", "ch"), ("quantile", q), ("topic", topic)))]
        assert 0 < v < 30
        assert samples[("nsq_topic_e2e_processing_latency_seconds",
                        (("quantile", q), ("topic", topic)))] > 0


# -- statsd -------------------------------------------------------------------------------
def test_statsd_push(make_any_broker: Callable[..., BrokerProcess]) -> None:
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    udp.settimeout(0.2)
    try:
        port = udp.getsockname()[1]
        b = make_any_broker(f"--statsd-address=127.0.0.1:{port}", "--statsd-interval=2s",
                            "--statsd-prefix=test.%s")
        topic = unique_name("statsd")
        http(b, "POST", f"/topic/create?topic={topic}").close()
        http(b, "POST", f"/channel/create?topic={topic}&channel=c").close()
        http(b, "POST", f"/mpub?topic={topic}", b"a\nb\nc").close()
        host_key = f"{socket.gethostname()}:{b.http_address[1]}"  # type: ignore[index]
        prefix = "test." + host_key.replace(".", "_").replace(":", "_") + "."
        lines: list[str] = []
        deadline = time.monotonic() + 12
        base = f"{prefix}topic.{topic}"

        def counted(key: str) -> int:
            return sum(int(ln.split(":")[1].split("|")[0]) for ln in lines
                       if ln.startswith(key + ":") and ln.endswith("|c"))

        gauges = [f"{base}.depth:0|g", f"{base}.backend_depth:0|g",
                  f"{base}.channel.c.depth:3|g", f"{base}.channel.c.in_flight_count:0|g",
                  f"{base}.channel.c.deferred_count:0|g", f"{base}.channel.c.clients:0|g"]

        def mem_seen() -> bool:
            return (any(ln.startswith(f"{prefix}mem.heap_objects:") and ln.endswith("|g")
                        for ln in lines)
                    and any(ln.startswith(f"{prefix}mem.gc_runs:") and ln.endswith("|c")
                            for ln in lines))

        def done() -> bool:
            return (counted(f"{base}.message_count") >= 3 and mem_seen()
                    and all(g in lines for g in gauges))

        while time.monotonic() < deadline and not done():
            try:
                packet = udp.recv(65536)
            except TimeoutError:
                continue
            assert len(packet) <= 508  # statsd_udp_packet_size
            lines += packet.decode().splitlines()
        assert counted(f"{base}.message_count") == 3, lines
        assert counted(f"{base}.message_bytes") == 3
        assert counted(f"{base}.channel.c.message_count") == 3
        for gauge in gauges:
            assert gauge in lines, (gauge, lines)
        assert mem_seen(), lines
    finally:
        udp.close()


@pytest.mark.parametrize("mode", ["on", "off"])
def test_metrics_say_who_writes_a_loops_passes(make_broker: Callable[..., BrokerProcess],
                                               mode: str) -> None:
    """``loop_sender`` fixed: every loop reports that way (the sender only where the
    compiled codec can run one), and no rounds of measuring."""
    b = make_broker("--loop-threads=2", f"--loop-sender={mode}")
    samples, types = scrape(b)
    sender = _per_loop(samples, "nsq_loop_sender")
    rounds = _per_loop(samples, "nsq_loop_sender_rounds_total")
    assert set(sender) == set(rounds) == set(_per_loop(samples, "nsq_loop_connections"))
    assert len(sender) == 2
    want = int(mode == "on" and Sender.possible())
    assert set(sender.values()) == {want}
    assert set(rounds.values()) == {0}
    assert types["nsq_loop_sender"] == "gauge"
    assert types["nsq_loop_sender_rounds"] == "counter"


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (cc) for rdy_reader")
@pytest.mark.timeout(120)
def test_auto_measures_both_ways_while_consumers_at_rdy_1_read(
        make_broker: Callable[..., BrokerProcess]) -> None:
    """``loop_sender = "auto"`` (the default): while 16 consumers at RDY 1 read a
    backlog (``loadtest/rdy_reader.c``, each FIN sent at once, so a turn's FINs bring a
    pass of many consumers), the loop measures a round of both ways: its counter moves,
    and the gauge says which way won. Every message is still read once the flow stops."""
    b = make_broker()
    topic = unique_name("snd")
    assert b.tcp_address
    http(b, "POST", f"/topic/create?topic={topic}").close()
    http(b, "POST", f"/channel/create?topic={topic}&channel=ch").close()
    body = b"\n".join(b"m%07d" % i for i in range(500))
    for _ in range(400):                 # 200,000 messages
        http(b, "POST", f"/mpub?topic={topic}", body).close()
    before, _ = scrape(b)
    assert sum(_per_loop(before, "nsq_loop_sender_rounds_total").values()) == 0
    reader = loadtest_module("bench_io").rdy_reader_binary()

    def rounds() -> float:
        return sum(_per_loop(scrape(b)[0], "nsq_loop_sender_rounds_total").values())

    deadline = time.monotonic() + 60
    while rounds() < 1 and stats(b, topic)["channels"][0]["depth"] > 0:
        assert time.monotonic() < deadline, "no round of measuring in 60 s"
        subprocess.run([reader, b.tcp_hostport, topic, "ch", "16", "1", "2"],
                       capture_output=True, text=True, timeout=60, check=True)
    assert rounds() >= 1
    samples, _ = scrape(b)
    assert set(_per_loop(samples, "nsq_loop_sender").values()) <= {0, 1}
