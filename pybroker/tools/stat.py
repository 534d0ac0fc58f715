"""``pybroker stat``: a live table of one channel's numbers across nsqds (nsq_stat).

Every ``--interval`` it reads ``/stats?format=json`` from each nsqd holding the topic
(given directly, or found through nsqlookupd's ``/lookup``), adds the channel's numbers
up, and prints a row: ingress/egress rates per second, depth (total, memory, disk),
in-flight, deferred, requeue and timeout counts, messages and clients. The header repeats
every 25 rows; the first poll only sets the baseline. ``--count N`` stops after N rows.
A channel with ``max_attempts`` set (or dead letters counted) at the first poll gets one
more column, ``dead``: its dead-lettered count (pybroker only); otherwise the output is
nsq_stat's.
"""
from __future__ import annotations

import ssl
import sys
import urllib.error
import urllib.parse
from dataclasses import dataclass
from typing import List, Optional, cast

import typer

from pybroker import __version__
from pybroker.client.lookupd import get_json, http_url, lookup_producers, producer_http_address
from pybroker.jsonvalue import Json, JsonObject
from pybroker.stopflag import StopFlag
from pybroker.tools._common import StopSignals, duration, fatal, opt, setup_logging

HEADER = ("%s+%s+%s" % ("------rate------", "----------------depth----------------",
                        "--------------metadata---------------") + "\n"
          + "%7s %7s | %7s %7s %7s %5s %5s | %7s %7s %12s %7s" % (
              "ingress", "egress", "total", "mem", "disk", "inflt", "def", "req", "t-o",
              "msgs", "clients") + "\n")
_LINES = HEADER.rstrip("\n").split("\n")
DEAD_HEADER = _LINES[0] + "-" * 8 + "\n" + _LINES[1] + " %7s" % "dead" + "\n"


@dataclass
class ChannelStats:
    """One channel's numbers, summed over nsqds (nsqd's /stats names)."""

    depth: int = 0
    backend_depth: int = 0
    in_flight_count: int = 0
    deferred_count: int = 0
    requeue_count: int = 0
    timeout_count: int = 0
    message_count: int = 0
    client_count: int = 0
    paused: bool = False
    max_attempts: int = 0
    dead_letter_count: int = 0

    @property
    def memory_depth(self) -> int:
        return self.depth - self.backend_depth

    def add(self, c: JsonObject) -> None:
        for name in ("depth", "backend_depth", "in_flight_count", "deferred_count",
                     "requeue_count", "timeout_count", "message_count", "client_count"):
            setattr(self, name, getattr(self, name) + _count(c.get(name)))
        self.paused = self.paused or bool(c.get("paused"))
        self.max_attempts = max(self.max_attempts, _count(c.get("max_attempts")))
        self.dead_letter_count += _count(c.get("dead_letter_count"))


def _count(v: Json) -> int:
    """A count of a /stats document (0 when missing or null; a number as text is read)."""
    if isinstance(v, (int, float, str)) and v:
        return int(v)
    return 0


def _objects(v: Json) -> list[JsonObject]:
    """The objects of a /stats array (none when missing or null)."""
    return [x for x in v if isinstance(x, dict)] if isinstance(v, list) else []


def format_row(cur: ChannelStats, old: ChannelStats, interval_s: float,
               dead: bool = False) -> str:
    """nsq_stat's row; rates are per second over the interval, truncated like Go's int64().
    ``dead``: with the dead-lettered count at the end."""
    msgs = cur.message_count - old.message_count
    row = "%7d %7d | %7d %7d %7d %5d %5d | %7d %7d %12d %7d" % (
        int(msgs / interval_s), int((msgs - (cur.depth - old.depth)) / interval_s),
        cur.depth, cur.memory_depth, cur.backend_depth, cur.in_flight_count,
        cur.deferred_count, cur.requeue_count, cur.timeout_count, cur.message_count,
        cur.client_count)
    return row + (" %7d\n" % cur.dead_letter_count if dead else "\n")


# HTTPS for /stats (nsqadmin's --http-client-tls-* flags); None: plain HTTP
_tls: ssl.SSLContext | None = None


def _stats(address: str, query: dict[str, str], timeout_s: float) -> JsonObject:
    url = http_url(address, "/stats?" + urllib.parse.urlencode(query),
                   "https" if _tls is not None else "http")
    data = get_json(url, timeout_s, _tls)
    # json.loads' output: a JSON value
    return cast(JsonObject, data) if isinstance(data, dict) else {}


def _tls_context(root_ca: str, cert: str, key: str, insecure: bool) -> ssl.SSLContext | None:
    if not (root_ca or cert or key or insecure):
        return None
    ctx = ssl.create_default_context(cafile=root_ca or None)
    if cert or key:
        ctx.load_cert_chain(cert, key or None)
    if insecure:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


def topic_producers(topic: str, nsqd_http: list[str], lookupd_http: list[str],
                    timeout_s: float) -> list[str]:
    """HTTP addresses of the nsqds that have ``topic``.

    Raises:
        OSError, ValueError: a server could not be queried.
    """
    if lookupd_http:
        found: dict[str, None] = {}
        for addr in lookupd_http:
            for p in lookup_producers(addr, topic, timeout_s):
                found[producer_http_address(p)] = None
        return list(found)
    out = []
    for addr in nsqd_http:
        data = _stats(addr, {"format": "json", "topic": topic, "include_clients": "false"},
                      timeout_s)
        if any(t.get("topic_name") == topic for t in _objects(data.get("topics"))):
            out.append(addr)
    return out


def channel_stats(producers: list[str], topic: str, channel: str,
                  timeout_s: float) -> ChannelStats | None:
    """The channel's numbers summed over ``producers``; None if no nsqd has it."""
    total: ChannelStats | None = None
    for addr in producers:
        data = _stats(addr, {"format": "json", "topic": topic, "channel": channel,
                             "include_clients": "false"}, timeout_s)
        for t in _objects(data.get("topics")):
            if t.get("topic_name") != topic:
                continue
            for c in _objects(t.get("channels")):
                if c.get("channel_name") == channel:
                    total = total or ChannelStats()
                    total.add(c)
    return total


def _check_addrs(addrs: list[str], flag: str) -> None:
    for a in addrs:
        if a.startswith("http"):
            fatal(f"--{flag} error - address should not contain scheme")


def stat_command(
    topic: str = opt("", "topic", help="NSQ topic"),
    channel: str = opt("", "channel", help="NSQ channel"),
    interval: str = opt("2s", "interval", help="duration of time between polling/printing "
                        "output"),
    count: Optional[int] = opt(None, "count", help="number of reports", metavar="N"),
    nsqd_http_address: List[str] = opt([], "nsqd-http-address", help="nsqd HTTP address "
                                       "(may be given multiple times)"),
    lookupd_http_address: List[str] = opt([], "lookupd-http-address", help="lookupd HTTP "
                                          "address (may be given multiple times)"),
    http_client_connect_timeout: str = opt("2s", "http-client-connect-timeout",
                                           help="timeout for HTTP connect"),
    http_client_request_timeout: str = opt("5s", "http-client-request-timeout",
                                           help="timeout for HTTP request"),
    http_client_tls_root_ca_file: str = opt(
        "", "http-client-tls-root-ca-file",
        help="path to CA file for the HTTP client (queries nsqd over HTTPS)"),
    http_client_tls_cert: str = opt("", "http-client-tls-cert",
                                    help="path to certificate file for the HTTP client"),
    http_client_tls_key: str = opt("", "http-client-tls-key",
                                   help="path to key file for the HTTP client"),
    http_client_tls_insecure_skip_verify: bool = opt(
        False, "http-client-tls-insecure-skip-verify",
        help="configure the HTTP client to skip verification of TLS certificates"),
    version: bool = opt(False, "version", help="print version"),
) -> None:
    """Poll /stats and print a channel's numbers every interval (nsq_stat)."""
    global _tls
    if version:
        typer.echo(f"pybroker stat v{__version__}")
        return
    setup_logging("warn")
    if not topic or not channel:
        fatal("--topic and --channel are required")
    interval_s = duration(interval, "interval")
    if interval_s <= 0:
        fatal("--interval should be positive")
    if duration(http_client_connect_timeout, "http-client-connect-timeout") <= 0:
        fatal("--http-client-connect-timeout should be positive")
    timeout_s = duration(http_client_request_timeout, "http-client-request-timeout")
    if timeout_s <= 0:
        fatal("--http-client-request-timeout should be positive")
    if count is not None and count <= 0:
        fatal("--count should be positive")
    if not nsqd_http_address and not lookupd_http_address:
        fatal("--nsqd-http-address or --lookupd-http-address required")
    if nsqd_http_address and lookupd_http_address:
        fatal("use --nsqd-http-address or --lookupd-http-address not both")
    _check_addrs(nsqd_http_address, "nsqd-http-address")
    _check_addrs(lookupd_http_address, "lookupd-http-address")
    try:
        _tls = _tls_context(http_client_tls_root_ca_file, http_client_tls_cert,
                            http_client_tls_key, http_client_tls_insecure_skip_verify)
    except (OSError, ssl.SSLError) as e:
        fatal(f"failed to load the HTTP client's TLS settings - {e}")

    with StopSignals() as signals:
        _stat_loop(signals.stop, topic, channel, interval_s, count, nsqd_http_address,
                   lookupd_http_address, timeout_s)


def _stat_loop(stop: StopFlag, topic: str, channel: str, interval_s: float,
               count: int | None, nsqd_http: list[str], lookupd_http: list[str],
               timeout_s: float) -> None:
    out = sys.stdout
    old: ChannelStats | None = None
    dead: bool | None = None
    i = 0
    while count is None or count >= i:
        try:
            producers = topic_producers(topic, nsqd_http, lookupd_http, timeout_s)
        except (OSError, ValueError) as e:
            fatal(f"ERROR: failed to get topic producers - {e}")
        try:
            cur = channel_stats(producers, topic, channel, timeout_s)
        except (OSError, ValueError) as e:
            fatal(f"ERROR: failed to get nsqd stats - {e}")
        if cur is None:
            fatal(f"ERROR: failed to find channel({channel}) in stats metadata for "
                  f"topic({topic})")
        if dead is None:
            dead = cur.max_attempts > 0 or cur.dead_letter_count > 0
        if i % 25 == 0:
            out.write(DEAD_HEADER if dead else HEADER)
        if old is not None:
            out.write(format_row(cur, old, interval_s, dead))
        out.flush()
        old = cur
        i += 1
        if count is not None and count < i:
            break
        if stop.wait(interval_s):
            return
