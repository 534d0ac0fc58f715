"""StatsdPusher: nsqd's statsd loop (nsqd/statsd.go) on its own ``statsd`` thread.

Every ``statsd_interval`` it collects the stats (a Gather on the event loops, waited for
with a deadline) and sends nsqd's keys over UDP to ``statsd_address``: counters as the
change since the previous push (``|c``), depths and counts as gauges (``|g``), with the
expanded ``statsd_prefix``, in packets of at most ``statsd_udp_packet_size`` bytes.
"""
from __future__ import annotations

import logging
import socket
import threading
from typing import TYPE_CHECKING

from pybroker.config import split_hostport
from pybroker.http.collect import plan_stats
from pybroker.http.gather import run_blocking
from pybroker.http.process import memory_stats

if TYPE_CHECKING:
    from pybroker.core.statsdoc import TopicStats
    from pybroker.server.services import HttpHost
    from pybroker.http.views import ServerView


log = logging.getLogger("pybroker")


def _pct_key(q: float) -> str:
    return f"{q * 100.0:.0f}"


def stat_lines(topics: list[TopicStats], last: dict[str, int], prefix: str,
               exclude_ephemeral: bool = False) -> list[str]:
    """nsqd's statsd lines for one push; ``last`` holds the previous counters (updated)."""
    lines: list[str] = []

    def incr(key: str, value: int) -> None:
        diff = value - last.get(key, 0)
        last[key] = value
        lines.append(f"{prefix}{key}:{diff}|c")

    def gauge(key: str, value: float) -> None:
        lines.append(f"{prefix}{key}:{int(value)}|g")

    seen: set[str] = set()
    for t in topics:
        tn = t["topic_name"]
        if exclude_ephemeral and tn.endswith("#ephemeral"):
            continue
        base = f"topic.{tn}"
        incr(f"{base}.message_count", t["message_count"])
        incr(f"{base}.message_bytes", t["message_bytes"])
        seen.update((f"{base}.message_count", f"{base}.message_bytes"))
        gauge(f"{base}.depth", t["depth"])
        gauge(f"{base}.backend_depth", t["backend_depth"])
        for p in t["e2e_processing_latency"]["percentiles"] or ():
            gauge(f"{base}.e2e_processing_latency_{_pct_key(p['quantile'])}", p["value"])
        for c in t["channels"]:
            cn = c["channel_name"]
            if exclude_ephemeral and cn.endswith("#ephemeral"):
                continue
            cb = f"{base}.channel.{cn}"
            incr(f"{cb}.message_count", c["message_count"])
            gauge(f"{cb}.depth", c["depth"])
            gauge(f"{cb}.backend_depth", c["backend_depth"])
            gauge(f"{cb}.in_flight_count", c["in_flight_count"])
            gauge(f"{cb}.deferred_count", c["deferred_count"])
            incr(f"{cb}.requeue_count", c["requeue_count"])
            incr(f"{cb}.timeout_count", c["timeout_count"])
            gauge(f"{cb}.clients", c["client_count"])
            seen.update(f"{cb}.{k}" for k in ("message_count", "requeue_count", "timeout_count"))
            for p in c["e2e_processing_latency"]["percentiles"] or ():
                gauge(f"{cb}.e2e_processing_latency_{_pct_key(p['quantile'])}", p["value"])
    # matches nsqd: a topic or channel that went away starts from zero if it comes back
    for key in [k for k in last if k.startswith("topic.") and k not in seen]:
        del last[key]
    return lines


def mem_lines(last: dict[str, int], prefix: str) -> list[str]:
    ms = memory_stats()
    lines = [f"{prefix}mem.{k}:{ms[k]}|g" for k in (
        "heap_objects", "heap_idle_bytes", "heap_in_use_bytes", "heap_released_bytes",
        "gc_pause_usec_100", "gc_pause_usec_99", "gc_pause_usec_95", "next_gc_bytes")]
    runs = ms["gc_total_runs"]
    lines.append(f"{prefix}mem.gc_runs:{runs - last.get('mem.gc_runs', 0)}|c")
    last["mem.gc_runs"] = runs
    return lines


def packets(lines: list[str], size: int) -> list[bytes]:
    """Lines packed into datagrams of at most ``size`` bytes (nsqd's boundary writer)."""
    out: list[bytes] = []
    buf = b""
    for line in lines:
        data = line.encode() + b"\n"
        if buf and len(buf) + len(data) > size:
            out.append(buf)
            buf = b""
        buf += data
    if buf:
        out.append(buf)
    return out


class StatsdPusher:
    """Owns the ``statsd`` thread and the counters of the previous push."""

    def __init__(self, runtime: HttpHost, server: ServerView) -> None:
        self.runtime = runtime
        self.server = server
        self.options = runtime.options
        self._stop = threading.Event()
        self._last: dict[str, int] = {}
        self._thread = threading.Thread(target=self._run, name="statsd", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        interval_s = self.options.statsd_interval / 1e9
        while not self._stop.wait(interval_s):
            try:
                self.push()
            except Exception:
                log.exception("STATSD: push failed")
        log.info("STATSD: closing")

    def push(self) -> None:
        o = self.options
        addr = str(o.statsd_address)
        try:
            host, port = split_hostport(addr)
            family, kind, proto, _, sockaddr = socket.getaddrinfo(
                host, port, 0, socket.SOCK_DGRAM)[0]
        except (ValueError, OSError):
            log.error("failed to create UDP socket to statsd(%s)", addr)
            return
        log.info("STATSD: pushing stats to %s", addr)
        collected = run_blocking(plan_stats(self.runtime, include_clients=False))
        prefix = self.server.statsd_prefix()
        exclude = bool(getattr(o, "statsd_exclude_ephemeral", False))
        lines = stat_lines(collected.topics or [], self._last, prefix, exclude)
        if o.statsd_mem_stats:
            lines += mem_lines(self._last, prefix)
        with socket.socket(family, kind, proto) as sock:
            for packet in packets(lines, int(o.statsd_udp_packet_size)):
                try:
                    sock.sendto(packet, sockaddr)
                except OSError as e:
                    log.error("STATSD: send to %s failed: %s", addr, e.strerror)
                    return
