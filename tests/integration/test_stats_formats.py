"""The pure pieces behind /stats and statsd, checked without a server: the e2e latency
window (halves, expiry, weighted quantiles), Go's value formats used by the text stats,
and statsd lines and packets (counters as differences, packets within the size limit).
"""
from __future__ import annotations

import pytest

from pybroker.core.stats import LatencyWindow, e2e_result, quantiles
from pybroker.http.statsd import packets, stat_lines
from pybroker.http.statstext import go_duration, ns_to_human

S = 1_000_000_000


def test_window_counts_and_quantiles() -> None:
    w = LatencyWindow(10 * S, now_ns=0)
    for v in range(1, 101):
        w.insert(v * 1000, now_ns=S)
    parts = w.snapshot(2 * S)
    assert e2e_result([0.5, 0.99], parts) == {
        "count": 100, "percentiles": [{"quantile": 0.5, "value": 50_000},
                                      {"quantile": 0.99, "value": 99_000}]}


def test_window_forgets_old_halves() -> None:
    w = LatencyWindow(10 * S, now_ns=0)
    w.insert(7, now_ns=1 * S)
    w.insert(9, now_ns=6 * S)  # the second half
    assert sum(c for c, _ in w.snapshot(6 * S)) == 2
    assert sum(c for c, _ in w.snapshot(11 * S)) == 1  # the first half has been dropped
    assert w.snapshot(10_000 * S) == []  # idle for far longer than the window


def test_window_reservoir_keeps_counts_exact() -> None:
    w = LatencyWindow(100 * S, now_ns=0)
    for i in range(10_000):
        w.insert(i, now_ns=1)
    ((count, sample),) = w.snapshot(2)
    assert count == 10_000 and len(sample) == LatencyWindow.RESERVOIR
    (p50,) = quantiles([(count, sample)], [0.5])
    assert 3000 < p50 < 7000


def test_weighted_quantiles_across_parts() -> None:
    # one part stands for 1000 values of 10, the other for 10 values of 1000
    parts = [(1000, [10] * 10), (10, [1000] * 10)]
    assert quantiles(parts, [0.5, 0.999]) == [10, 1000]
    assert quantiles([], [0.5]) == [0]


def test_e2e_result_without_percentiles_or_stream() -> None:
    assert e2e_result([], [(1, [5])]) == {"count": 0, "percentiles": None}
    assert e2e_result([0.9], None) == {"count": 0, "percentiles": None}
    assert e2e_result([0.9], []) == {"count": 0, "percentiles": [{"quantile": 0.9, "value": 0}]}


@pytest.mark.parametrize("ns, text", [
    (0, "0s"), (999, "999ns"), (1500, "1.5µs"), (250_000_000, "250ms"),
    (1_151_756_427, "1.151756427s"), (131_687_532_146, "2m11.687532146s"),
    (3_605 * S, "1h0m5s"), (60 * S, "1m0s"), (-2 * S, "-2s"),
])
def test_go_duration(ns: int, text: str) -> None:
    assert go_duration(ns) == text


def test_ns_to_human() -> None:
    assert [ns_to_human(v) for v in (0, 999, 1500, 2_500_000, 3.25e9)] == [
        "0.0ns", "999.0ns", "1.5us", "2.5ms", "3.2s"]


def _topic(name: str, count: int) -> dict[str, object]:
    return {"topic_name": name, "message_count": count, "message_bytes": count * 10,
            "depth": 1, "backend_depth": 0,
            "e2e_processing_latency": {"count": 0, "percentiles": [
                {"quantile": 0.99, "value": 1234.0}]},
            "channels": [{"channel_name": "c", "message_count": count, "depth": 2,
                          "backend_depth": 0, "in_flight_count": 3, "deferred_count": 4,
                          "requeue_count": 5, "timeout_count": 6, "client_count": 7,
                          "e2e_processing_latency": {"count": 0, "percentiles": None}}]}


def test_statsd_lines_send_counter_differences() -> None:
    last: dict[str, int] = {}
    first = stat_lines([_topic("t", 10)], last, "p.")
    assert "p.topic.t.message_count:10|c" in first
    assert "p.topic.t.e2e_processing_latency_99:1234|g" in first
    assert "p.topic.t.channel.c.requeue_count:5|c" in first
    assert "p.topic.t.channel.c.clients:7|g" in first
    second = stat_lines([_topic("t", 15)], last, "p.")
    assert "p.topic.t.message_count:5|c" in second
    assert "p.topic.t.channel.c.requeue_count:0|c" in second
    stat_lines([], last, "p.")  # the topic went away: it starts from zero if it returns
    assert "p.topic.t.message_count:3|c" in stat_lines([_topic("t", 3)], last, "p.")


def test_statsd_ephemeral_exclusion() -> None:
    lines = stat_lines([_topic("t#ephemeral", 1)], {}, "", exclude_ephemeral=True)
    assert lines == []


def test_statsd_packets_respect_the_size() -> None:
    lines = [f"key.{i}:{i}|g" for i in range(200)]
    out = packets(lines, 100)
    assert all(len(p) <= 100 for p in out)
    assert b"".join(out).decode().splitlines() == lines
