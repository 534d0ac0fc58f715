"""/stats in its default text format, laid out exactly as nsqd's printStats, plus the Go
value formats it uses (time.Duration strings, RFC 3339 times, NanoSecondToHuman)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from pybroker import NSQ_COMPAT_VERSION, __version__

if TYPE_CHECKING:
    from pybroker.core.statsdoc import ClientStats, E2eResult, StatsDocument


def go_duration(ns: int) -> str:
    """Go's time.Duration.String(): "0s", "250ms", "1.5µs", "2m11.687532146s", "1h0m5s"."""
    if ns == 0:
        return "0s"
    sign = "-" if ns < 0 else ""
    u = abs(ns)

    def frac(value: int, unit: int, digits: int) -> str:
        whole, rest = divmod(value, unit)
        return str(whole) + ("." + f"{rest:0{digits}d}".rstrip("0") if rest else "")

    if u < 1000:
        return f"{sign}{u}ns"
    if u < 1_000_000:
        return sign + frac(u, 1000, 3) + "µs"
    if u < 1_000_000_000:
        return sign + frac(u, 1_000_000, 6) + "ms"
    secs, rest = divmod(u, 1_000_000_000)
    h, rem = divmod(secs, 3600)
    m, s = divmod(rem, 60)
    text = frac(s * 1_000_000_000 + rest, 1_000_000_000, 9) + "s"
    if h or m:
        text = f"{m}m" + text
    if h:
        text = f"{h}h" + text
    return sign + text


def rfc3339(ts: float) -> str:
    """A local time as Go's time.RFC3339 prints it ("Z" for UTC)."""
    import datetime  # the text /stats only: not loaded at start-up

    t = datetime.datetime.fromtimestamp(int(ts)).astimezone()
    text = t.isoformat(timespec="seconds")
    return text[:-6] + "Z" if text.endswith("+00:00") else text


def ns_to_human(v: float) -> str:
    """nsqd's stringy.NanoSecondToHuman."""
    if v > 1_000_000_000:
        return f"{v / 1_000_000_000:0.1f}s"
    if v > 1_000_000:
        return f"{v / 1_000_000:0.1f}ms"
    if v > 1000:
        return f"{v / 1000:0.1f}us"
    return f"{v:0.1f}ns"


def _e2e(result: E2eResult) -> str:
    return ", ".join(ns_to_human(p["value"]) for p in result.get("percentiles") or ())


def client_line(c: ClientStats, now_s: float) -> str:
    """nsqd's ClientV2Stats.String(): a producer line if it has pub_counts, else a consumer line."""
    connected = go_duration(max(0, int(now_s) - c["connect_ts"]) * 1_000_000_000)
    port = c["remote_address"].rpartition(":")[2]
    ident = f"{c['hostname']}:{port} {c['user_agent']}"
    pubs = c.get("pub_counts")
    if pubs:
        total = sum(p["count"] for p in pubs)
        topics = ",".join(f"{p['topic']}={p['count']}" for p in pubs)
        return (f"[{c['version']} {ident:<21}] msgs: {total:<8d} topics: {topics} "
                f"connected: {connected}")
    return (f"[{c['version']} {ident:<21}] state: {c['state']} inflt: {c['in_flight_count']:<4d} "
            f"rdy: {c['ready_count']:<4d} fin: {c['finish_count']:<8d} "
            f"re-q: {c['requeue_count']:<8d} msgs: {c['message_count']:<8d} "
            f"connected: {connected}")


def render(doc: StatsDocument, now_s: float, uptime_ns: int) -> bytes:
    """The text body of /stats for a stats document (core.stats.document)."""
    out = [f"nsqd v{NSQ_COMPAT_VERSION} (pybroker v{__version__})\n",
           f"start_time {rfc3339(doc['start_time'])}\n",
           f"uptime {go_duration(uptime_ns)}\n",
           f"\nHealth: {doc['health']}\n"]
    mem = doc.get("memory")
    if mem is not None:
        out.append("\nMemory:\n")
        for key in ("heap_objects", "heap_idle_bytes", "heap_in_use_bytes",
                    "heap_released_bytes", "gc_pause_usec_100", "gc_pause_usec_99",
                    "gc_pause_usec_95", "next_gc_bytes", "gc_total_runs"):
            out.append(f"   {key:<25}\t{mem[key]}\n")
    topics = doc["topics"] or []
    out.append("\nTopics: None\n" if not topics else "\nTopics:")
    for t in topics:
        mark = "*P " if t["paused"] else "   "
        out.append(f"\n{mark}[{t['topic_name']:<15}] depth: {t['depth']:<5d} "
                   f"be-depth: {t['backend_depth']:<5d} msgs: {t['message_count']:<8d} "
                   f"e2e%: {_e2e(t['e2e_processing_latency'])}\n")
        for c in t["channels"]:
            mark = "   *P " if c["paused"] else "      "
            out.append(f"{mark}[{c['channel_name']:<25}] depth: {c['depth']:<5d} "
                       f"be-depth: {c['backend_depth']:<5d} inflt: {c['in_flight_count']:<4d} "
                       f"def: {c['deferred_count']:<4d} re-q: {c['requeue_count']:<5d} "
                       f"timeout: {c['timeout_count']:<5d} msgs: {c['message_count']:<8d} "
                       f"e2e%: {_e2e(c['e2e_processing_latency'])}\n")
            for client in c["clients"] or ():
                out.append(f"        {client_line(client, now_s)}\n")
    producers = doc["producers"] or []
    if not producers:
        out.append("\nProducers: None\n")
    else:
        out.append("\nProducers:\n")
        for p in producers:
            out.append(f"   {client_line(p, now_s)}\n")
    return "".join(out).encode()
