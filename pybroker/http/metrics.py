"""GET /metrics: the Prometheus text exposition format (version 0.0.4).

Per topic and channel: depth, disk depth, in-flight, deferred, message, requeue and
timeout counts, clients, paused, e2e latency quantiles; per event-loop thread:
connections and owned channels; the HTTP server; and the process (``process_*``,
``python_*``). Built from the same Collected stats as /stats, so both always agree.
"""
from __future__ import annotations

import gc
from collections.abc import Iterable
from typing import TYPE_CHECKING

from pybroker import NSQ_COMPAT_VERSION, __version__
from pybroker.core.statsdoc import ChannelFigure, TopicFigure
from pybroker.evloop import TURN_BUCKETS_NS, TurnTimes
from pybroker.http.collect import Collected
from pybroker.http.process import process_figures

if TYPE_CHECKING:
    from pybroker.http.views import HttpFigures

CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"

# (name, type, help, key in the topic dict)
_TOPIC: tuple[tuple[str, str, str, TopicFigure], ...] = (
    ("nsq_topic_depth", "gauge", "Messages waiting in the topic (memory and disk).", "depth"),
    ("nsq_topic_backend_depth", "gauge", "Messages of the topic on disk.", "backend_depth"),
    ("nsq_topic_messages_total", "counter", "Messages published to the topic.", "message_count"),
    ("nsq_topic_message_bytes_total", "counter", "Bytes published to the topic.",
     "message_bytes"),
    ("nsq_topic_paused", "gauge", "1 if the topic is paused.", "paused"),
    ("pybroker_topic_log_read_bytes_total", "counter",
     "Bytes read back from the topic's segment files (by channels, /topic/read, lookups).",
     "log_bytes_read"),
)
_CHANNEL: tuple[tuple[str, str, str, ChannelFigure], ...] = (
    ("nsq_channel_depth", "gauge", "Messages waiting in the channel (memory and disk).",
     "depth"),
    ("nsq_channel_backend_depth", "gauge", "Messages of the channel on disk.", "backend_depth"),
    ("nsq_channel_in_flight_messages", "gauge", "Messages sent and not yet finished.",
     "in_flight_count"),
    ("nsq_channel_deferred_messages", "gauge", "Messages deferred (DPUB, REQ with delay).",
     "deferred_count"),
    ("nsq_channel_messages_total", "counter", "Messages the channel received.",
     "message_count"),
    ("nsq_channel_requeued_total", "counter", "Messages requeued (REQ, client gone).",
     "requeue_count"),
    ("nsq_channel_timed_out_total", "counter", "In-flight messages that timed out.",
     "timeout_count"),
    ("nsq_channel_clients", "gauge", "Consumers subscribed to the channel.", "client_count"),
    ("nsq_channel_paused", "gauge", "1 if the channel is paused.", "paused"),
    ("pybroker_channel_dead_lettered_total", "counter",
     "Messages out of attempts published to the dead-letter topic.", "dead_letter_count"),
    ("pybroker_channel_dead_letter_cycles_total", "counter",
     "Messages out of attempts kept back: their dead-letter topic is one they came from.",
     "dead_letter_cycles"),
)


def _esc(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(pairs: Iterable[tuple[str, str]]) -> str:
    inner = ",".join(f'{k}="{_esc(v)}"' for k, v in pairs)
    return "{" + inner + "}" if inner else ""


Labels = tuple[tuple[str, str], ...]
Sample = tuple[Iterable[tuple[str, str]], int | float | bool]


def _num(v: int | float | bool) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, float):
        return repr(v)
    return str(v)


class _Out:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def _head(self, name: str, kind: str, text: str) -> None:
        self.lines.append(f"# HELP {name} {text}")
        self.lines.append(f"# TYPE {name} {kind}")

    def family(self, name: str, kind: str, text: str,
               samples: Iterable[Sample]) -> None:
        self._head(name, kind, text)
        for labels, value in samples:
            self.lines.append(f"{name}{_labels(labels)} {_num(value)}")

    def histogram(self, name: str, text: str,
                  series: Iterable[tuple[Labels, list[tuple[str, int]], float, int]]) -> None:
        """A histogram family: per series its labels, its cumulative (le, count)
        buckets ending with +Inf, its sum and its count."""
        self._head(name, "histogram", text)
        for labels, buckets, total, count in series:
            for le, n in buckets:
                self.lines.append(f"{name}_bucket{_labels((*labels, ('le', le)))} {n}")
            self.lines.append(f"{name}_sum{_labels(labels)} {_num(total)}")
            self.lines.append(f"{name}_count{_labels(labels)} {count}")


def _turn_buckets(turns: TurnTimes) -> list[tuple[str, int]]:
    """TurnTimes as cumulative Prometheus buckets (le in seconds, then +Inf)."""
    out: list[tuple[str, int]] = []
    above = sum(turns.over)             # turns past the first bound
    n = turns.turns - above
    out.append((_num(TURN_BUCKETS_NS[0] / 1e9), n))
    for i in range(1, len(TURN_BUCKETS_NS)):
        n += turns.over[i - 1]
        out.append((_num(TURN_BUCKETS_NS[i] / 1e9), n))
    out.append(("+Inf", turns.turns))
    return out


def render(stats: Collected, health: str, start_time: int, http: HttpFigures) -> bytes:
    """The /metrics body. ``http`` holds the HTTP server's own figures."""
    o = _Out()
    topics = stats.topics or []
    o.family("nsq_info", "gauge", "Versions: the NSQ protocol served and pybroker's own.",
             [((("version", NSQ_COMPAT_VERSION), ("pybroker_version", __version__)), 1)])
    o.family("nsq_healthy", "gauge", "1 while /ping answers OK.", [((), health == "OK")])
    o.family("nsq_start_time_seconds", "gauge", "When the broker started (Unix time).",
             [((), start_time)])
    o.family("nsq_topics", "gauge", "Topics.", [((), len(topics))])
    for name, kind, text, tkey in _TOPIC:
        o.family(name, kind, text, [((("topic", t["topic_name"]),), t[tkey]) for t in topics])
    chans = [(t["topic_name"], c) for t in topics for c in t["channels"]]
    for name, kind, text, ckey in _CHANNEL:
        o.family(name, kind, text,
                 [((("topic", tn), ("channel", c["channel_name"])), c[ckey]) for tn, c in chans])
    t_lat = [((("topic", t["topic_name"]), ("quantile", str(p["quantile"]))), p["value"] / 1e9)
             for t in topics for p in t["e2e_processing_latency"]["percentiles"] or ()]
    c_lat = [((("topic", tn), ("channel", c["channel_name"]), ("quantile", str(p["quantile"]))),
              p["value"] / 1e9)
             for tn, c in chans for p in c["e2e_processing_latency"]["percentiles"] or ()]
    if t_lat or c_lat:
        o.family("nsq_topic_e2e_processing_latency_seconds", "gauge",
                 "Publish-to-finish latency quantiles over the e2e window.", t_lat)
        o.family("nsq_channel_e2e_processing_latency_seconds", "gauge",
                 "Publish-to-finish latency quantiles over the e2e window.", c_lat)
    loops = sorted(stats.loops, key=lambda s: s.name)
    o.family("nsq_loop_connections", "gauge", "TCP client connections served by each loop thread.",
             [((("loop", s.name),), s.connections) for s in loops])
    o.family("nsq_loop_channels", "gauge", "Channels owned by each loop thread.",
             [((("loop", s.name),), s.owned) for s in loops])
    o.family("nsq_loop_sender", "gauge",
             "1 while the loop's sender thread writes its passes to 8+ consumers at RDY 1-2, "
             "0 while the loop writes them itself (loop_sender).",
             [((("loop", s.name),), int(s.sender)) for s in loops])
    o.family("nsq_loop_sender_rounds_total", "counter",
             "Rounds of measuring both ways of writing such passes (loop_sender auto).",
             [((("loop", s.name),), s.sender_rounds) for s in loops])
    turns = [(s.name, s.turns) for s in loops] + [("http", http["turns"])]
    o.histogram("pybroker_loop_turn_seconds",
                "How long each loop thread's turns took, the HTTP server's as loop "
                "\"http\" (their work, not the wait for events; a turn's budget is 20 ms).",
                [((("loop", name),), _turn_buckets(t), t.total_ns / 1e9, t.turns)
                 for name, t in turns])
    o.family("pybroker_loop_turn_longest_seconds", "gauge",
             "Each loop thread's longest turn since the start (counted from 1 ms on).",
             [((("loop", name),), t.longest_ns / 1e9) for name, t in turns])
    o.family("nsq_producers", "gauge", "Connected clients that have published.",
             [((), len(stats.producers or ()))])
    o.family("nsq_http_connections", "gauge", "Open HTTP connections.",
             [((), http["connections"])])
    o.family("nsq_refused_connections_total", "counter",
             "Connections refused by the descriptor reserve or max_connections, by listener.",
             [((("listener", k),), n) for k, n in sorted(http.get("refused", {}).items())])
    o.family("nsq_http_requests_total", "counter", "HTTP requests answered, by status code.",
             [((("code", str(code)),), n) for code, n in sorted(http["requests"].items())])
    proc = process_figures()
    for key, kind, text in (
            ("cpu_seconds_total", "counter", "Total user and system CPU time in seconds."),
            ("resident_memory_bytes", "gauge", "Resident memory size in bytes."),
            ("virtual_memory_bytes", "gauge", "Virtual memory size in bytes."),
            ("start_time_seconds", "gauge", "Start time of the process since unix epoch."),
            ("open_fds", "gauge", "Number of open file descriptors."),
            ("max_fds", "gauge", "Maximum number of open file descriptors."),
            ("threads", "gauge", "Number of OS threads in the process.")):
        if key in proc:
            o.family("process_" + key, kind, text, [((), proc[key])])
    gstats = gc.get_stats()
    o.family("python_gc_collections_total", "counter", "Garbage collections, by generation.",
             [((("generation", str(i)),), s.get("collections", 0)) for i, s in enumerate(gstats)])
    o.family("python_gc_objects_collected_total", "counter",
             "Objects collected by the garbage collector, by generation.",
             [((("generation", str(i)),), s.get("collected", 0)) for i, s in enumerate(gstats)])
    import platform  # here, not at start-up: only /metrics uses it

    o.family("python_info", "gauge", "Python platform information.",
             [((("implementation", platform.python_implementation()),
                ("version", platform.python_version())), 1)])
    return ("\n".join(o.lines) + "\n").encode()
