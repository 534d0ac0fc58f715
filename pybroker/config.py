"""Options: every setting with nsqd's name and default, TOML loading and validation.

TOML keys are nsqd's config names (``mem_queue_size``, ``msg_timeout``), command-line flags
are nsqd's flag names (``--mem-queue-size``), and durations are Go-style strings ("60s",
"1h30m", "250ms"), so an nsqd config file carries over; as in nsqd, a bare number for a
duration in TOML is milliseconds, while a flag needs its unit. Imports only the stdlib, and
at import time only what every start needs (tomllib when a file is read): the start-up
path of ``pybroker serve`` and ``pybroker-nsqd`` imports this module.
"""
from __future__ import annotations

import os
import re
import socket
import zlib
from collections.abc import Callable, Mapping

from pybroker.errors import ConfigError
from pybroker.optiontypes import OptionFields, OptionValue

NS = 1
MS = 1_000_000
S = 1_000_000_000

_DURATION_RE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|\u00b5s|\u03bcs|ms|s|m|h)")
_TOPIC_RE = re.compile(r"[.a-zA-Z0-9_-]+")
# Go accepts both micro signs: U+00B5 (µ) and U+03BC (μ)
_UNIT_NS = {"ns": 1, "us": 1_000, "\u00b5s": 1_000, "\u03bcs": 1_000, "ms": MS, "s": S,
            "m": 60 * S, "h": 3600 * S}
MAX_DURATION_NS = 2**63 - 1  # Go's time.Duration


def parse_duration(text: str) -> int:
    """Parse a Go duration string ("1h30m", "250ms", "1.5µs", "0") into nanoseconds.

    Exact in integers, as Go's time.ParseDuration (a fraction is truncated to whole
    nanoseconds); negative durations are refused (no option takes one).
    """
    t = text.strip()
    if t.startswith("+"):
        t = t[1:]
    if t == "0":
        return 0
    pos, total = 0, 0
    if not t:
        raise ValueError("empty duration")
    while pos < len(t):
        m = _DURATION_RE.match(t, pos)
        if not m:
            raise ValueError(f"invalid duration {text!r} (use e.g. \"60s\", \"250ms\", \"1h\")")
        whole, _, frac = m.group(1).partition(".")
        unit = _UNIT_NS[m.group(2)]
        total += int(whole or 0) * unit
        if frac:
            total += int(frac) * unit // 10 ** len(frac)
        pos = m.end()
    if total > MAX_DURATION_NS:
        raise ValueError(f"invalid duration {text!r} (longer than Go's 2562047h)")
    return total


def format_duration(ns: int) -> str:
    """Format nanoseconds the way Go prints a time.Duration (for /config and logs)."""
    if ns == 0:
        return "0s"
    for unit, size in (("h", 3600 * S), ("m", 60 * S)):
        if ns % size == 0:
            return f"{ns // size}{unit}"
    if ns % S == 0:
        return f"{ns // S}s"
    if ns % MS == 0:
        return f"{ns // MS}ms"
    return f"{ns}ns"


class OptionSpec:
    """One option: its TOML key, kind, default, allowed range and help text.

    A plain class rather than a dataclass: importing dataclasses (and inspect) costs
    milliseconds of every start."""

    __slots__ = ("key", "kind", "default", "help", "low", "high", "flag")

    def __init__(self, key: str, kind: str, default: OptionValue | None, help: str,
                 low: float | None = None, high: float | None = None,
                 flag: str | None = None) -> None:
        self.key = key
        self.kind = kind  # "str", "int", "float", "bool", "duration", "list", "tls_required"
        self.default = default
        self.help = help
        self.low = low
        self.high = high
        self.flag = flag  # nsqd's flag name when it differs from the key

    def __repr__(self) -> str:
        return f"OptionSpec({self.key!r}, {self.kind!r}, {self.default!r})"

    @property
    def flag_name(self) -> str:
        return "--" + (self.flag or self.key.replace("_", "-"))


def _default_node_id() -> int:
    # matches nsqd: the default node id is crc32(md5(hostname)) mod 1024; the builtin
    # _md5 spares hashlib's OpenSSL load at every start
    try:
        from _md5 import md5  # type: ignore[import-not-found]
    except ImportError:  # an interpreter built without it
        from hashlib import md5
    return zlib.crc32(md5(socket.gethostname().encode()).digest()) % 1024


# loop_sender's values (server/sendchoice.py): measured both ways, the sender, the loop
LOOP_SENDER_MODES = ("auto", "on", "off")

SPECS: tuple[OptionSpec, ...] = (
    OptionSpec("id", "int", None, "unique part of message ids, 0..1023 (default: from hostname)",
               0, 1023, flag="node-id"),
    OptionSpec("log_level", "str", "info", "log level: debug, info, warn, error, fatal"),
    OptionSpec("log_prefix", "str", "[pybroker] ",
               "log message prefix (pybroker-nsqd: nsqd's \"[nsqd] \")"),
    OptionSpec("tcp_address", "str", "127.0.0.1:4150", "address to listen on for TCP clients"),
    OptionSpec("http_address", "str", "127.0.0.1:4151",
               "address to listen on for HTTP clients (empty: no HTTP)"),
    OptionSpec("https_address", "str", "127.0.0.1:4152",
               "address to listen on for HTTPS clients (only with tls_cert and tls_key)"),
    OptionSpec("broadcast_address", "str", "",
               "address registered with nsqlookupd (default: this host's name)"),
    OptionSpec("broadcast_tcp_port", "int", 0,
               "TCP port registered with nsqlookupd (0: the port TCP listens on)", 0, 65535),
    OptionSpec("broadcast_http_port", "int", 0,
               "HTTP port registered with nsqlookupd (0: the port HTTP listens on)", 0, 65535),
    OptionSpec("nsqlookupd_tcp_addresses", "list", [],
               "nsqlookupd TCP addresses to register with", flag="lookupd-tcp-address"),
    OptionSpec("data_path", "str", "", "directory for on-disk state (default: current directory)"),
    OptionSpec("mem_queue_size", "int", 10000,
               "newest messages of each topic's log kept in memory", 0, 2**31 - 1),
    OptionSpec("max_bytes_per_file", "int", 104857600, "bytes per topic log segment file",
               1024, 2**40),
    OptionSpec("sync_every", "int", 2500,
               "messages written to a topic between fsyncs of its log (memory durability)",
               1, 2**31 - 1),
    OptionSpec("sync_timeout", "duration", 2 * S, "longest time between fsyncs and channel state saves",
               1 * MS, 3600 * S),
    OptionSpec("queue_scan_interval", "duration", 100 * MS,
               "how often to scan in-flight and deferred queues", 1 * MS, 60 * S),
    OptionSpec("queue_scan_refresh_interval", "duration", 5 * S,
               "how often to refresh the scanner's channel list", 1 * MS, 3600 * S),
    OptionSpec("queue_scan_selection_count", "int", 20, "channels sampled per scan", 1, 1_000_000),
    OptionSpec("queue_scan_worker_pool_max", "int", 4, "most scanner worker threads", 1, 256),
    OptionSpec("queue_scan_dirty_percent", "float", 0.25,
               "rescan at once while more than this fraction of sampled channels was dirty",
               0.0, 1.0),
    OptionSpec("msg_timeout", "duration", 60 * S,
               "default time a message may stay in flight before it is requeued", 1 * MS, 24 * 3600 * S),
    OptionSpec("max_msg_timeout", "duration", 15 * 60 * S,
               "largest msg_timeout a client may ask for", 1 * MS, 24 * 3600 * S),
    OptionSpec("max_msg_size", "int", 1048576, "largest message body in bytes", 1, 2**31 - 1),
    OptionSpec("max_body_size", "int", 5 * 1048576, "largest command body (MPUB, IDENTIFY) in bytes",
               1, 2**31 - 1),
    OptionSpec("max_req_timeout", "duration", 3600 * S, "largest REQ or DPUB delay",
               0, 365 * 24 * 3600 * S),
    OptionSpec("client_timeout", "duration", 60 * S, "default client network timeout", 1 * MS,
               3600 * S),
    OptionSpec("max_heartbeat_interval", "duration", 60 * S,
               "largest heartbeat interval a client may ask for", 1 * S, 3600 * S),
    OptionSpec("max_rdy_count", "int", 2500, "largest RDY count a client may send", 1, 2**31 - 1),
    OptionSpec("max_output_buffer_size", "int", 65536, "largest output buffer a client may ask for",
               64, 2**31 - 1),
    OptionSpec("max_output_buffer_timeout", "duration", 30 * S,
               "largest output buffer timeout a client may ask for", 1 * MS, 3600 * S),
    OptionSpec("min_output_buffer_timeout", "duration", 25 * MS,
               "smallest output buffer timeout a client may ask for", 1 * MS, 3600 * S),
    OptionSpec("output_buffer_timeout", "duration", 250 * MS,
               "default time message frames may wait in a client's output buffer", 1 * MS, 3600 * S),
    OptionSpec("output_buffer_size", "int", 16384,
               "default output buffer size in bytes", 64, 2**31 - 1),
    OptionSpec("max_channel_consumers", "int", 0, "most consumers per channel (0: no limit)",
               0, 2**31 - 1),
    OptionSpec("statsd_address", "str", "", "UDP address of a statsd daemon to push to"),
    OptionSpec("statsd_prefix", "str", "nsq.%s", "prefix of statsd keys (%s: host)"),
    OptionSpec("statsd_interval", "duration", 60 * S, "time between statsd pushes", 1 * MS, 3600 * S),
    OptionSpec("statsd_mem_stats", "bool", True, "push memory figures to statsd"),
    OptionSpec("statsd_udp_packet_size", "int", 508, "largest statsd UDP packet", 64, 65507),
    OptionSpec("statsd_exclude_ephemeral", "bool", False,
               "skip ephemeral topics and channels in statsd pushes"),
    OptionSpec("e2e_processing_latency_window_time", "duration", 10 * 60 * S,
               "window of the end-to-end latency percentiles", 1 * S, 24 * 3600 * S),
    OptionSpec("e2e_processing_latency_percentiles", "list", [],
               "end-to-end latency percentiles to compute, e.g. [0.99, 0.5]",
               flag="e2e-processing-latency-percentile"),
    OptionSpec("deflate", "bool", True, "enable deflate feature negotiation (client compression)"),
    OptionSpec("max_deflate_level", "int", 6,
               "max deflate compression level a client can negotiate", 1, 9),
    OptionSpec("snappy", "bool", True, "enable snappy feature negotiation (client compression)"),
    OptionSpec("tls_cert", "str", "", "path to certificate file"),
    OptionSpec("tls_key", "str", "", "path to key file"),
    OptionSpec("tls_client_auth_policy", "str", "",
               "client certificate auth policy ('require' or 'require-verify')"),
    OptionSpec("tls_root_ca_file", "str", "", "path to certificate authority file"),
    OptionSpec("tls_required", "tls_required", 0,
               "require TLS for client connections (true, false, tcp-https)"),
    OptionSpec("tls_min_version", "str", "tls1.0",
               "minimum SSL/TLS version acceptable ('tls1.0', 'tls1.1', 'tls1.2' or 'tls1.3')"),
    OptionSpec("auth_http_addresses", "list", [],
               "<addr>:<port> or a full url to query auth server (may be given multiple times)",
               flag="auth-http-address"),
    OptionSpec("auth_http_request_method", "str", "get",
               "HTTP method for auth server requests ('get' or 'post')"),
    OptionSpec("http_client_connect_timeout", "duration", 2 * S, "timeout for HTTP connect",
               1 * MS, 3600 * S),
    OptionSpec("http_client_request_timeout", "duration", 5 * S, "timeout for HTTP request",
               1 * MS, 3600 * S),
    # pybroker's own knobs
    OptionSpec("durability", "str", "memory",
               "\"memory\": nsqd's behaviour (fsync every sync_every writes / sync_timeout); "
               "\"fsync\": PUB/MPUB/DPUB answered OK only once on disk, nothing acknowledged "
               "is lost to a crash"),
    OptionSpec("retention_time", "duration", 0,
               "keep consumed messages of every topic this long for replay (channel "
               "rewind); 0: delete segments once every channel has consumed them",
               0, 100 * 365 * 24 * 3600 * S),
    OptionSpec("retention_bytes", "int", 0,
               "keep up to this many bytes of consumed messages per topic for replay; 0: "
               "no byte-based retention", 0, 2**62),
    OptionSpec("max_attempts", "int", 0,
               "deliveries of a message on a channel before it goes to the dead-letter "
               "topic instead (0: unlimited, as nsqd); per channel: POST /channel/config",
               0, 65535),
    OptionSpec("dead_letter_topic", "str", "",
               "topic that receives the messages out of attempts (empty: <topic>.dead)"),
    OptionSpec("loop_threads", "int", 1,
               "event loop threads serving clients; channels are hash-partitioned across "
               "them (0: one per CPU). Under the GIL one loop is fastest and keeps publishers "
               "and consumers in balance", 0, 256),
    OptionSpec("loop_spin", "duration", 50_000,
               "after a turn that had work, an event loop looks for more for this long "
               "before it sleeps in epoll (a client answering at once is read without a "
               "wake-up), and its sender thread waits 200us for the next pass's writes; "
               "0: both sleep at once", 0, 10 * MS),
    OptionSpec("loop_sender", "str", "auto",
               "who writes a dispatch pass's messages to 8 or more consumers at RDY 1 or "
               "2: \"on\" the loop's sender thread (the sends' kernel time on another "
               "core), \"off\" the loop itself, \"auto\" both measured and the faster "
               "kept (which wins depends on the machine)"),
    OptionSpec("max_connections", "int", 0,
               "most TCP clients at once; more are answered E_INVALID and closed (redis's "
               "maxclients; 0: no limit). A reserve of file descriptors is always kept",
               0, 2**31 - 1),
    # replication (docs/replication.md): only with cluster_etcd set; the node's name in
    # the cluster is its id (--node-id)
    OptionSpec("cluster_etcd", "str", "",
               "etcd endpoint (http://host:port) of the cluster this node joins; empty: "
               "a single node. The node is named by --node-id in the cluster"),
    OptionSpec("cluster_address", "str", "127.0.0.1:4153",
               "address of the internal replication listener (followers fetch here)"),
    OptionSpec("replication_factor", "int", 3,
               "nodes that hold a copy of each topic (the topic's first node and the "
               "next ones by id)", 1, 64),
    OptionSpec("min_insync_replicas", "int", 2,
               "the fewest in-sync replicas (the leader included) a publish is answered "
               "with: every in-sync replica holds it before OK; fewer in sync: "
               "publishes fail", 1, 64),
    OptionSpec("max_insync_replicas", "int", 0,
               "the most in-sync replicas (the leader included) a topic keeps; 0: every "
               "replica that is caught up. The others follow lazily (a fetch every 2 ms) "
               "and one joins when a member leaves: an OK waits for fewer copies, and an "
               "acknowledged message survives fewer lost machines", 0, 64),
    OptionSpec("cluster_lease_ttl", "duration", 5 * S,
               "etcd lease of a node's membership and leaderships: a dead leader is "
               "replaced after about this long", 1 * S, 300 * S),
)

SPEC_BY_KEY = {s.key: s for s in SPECS}
# log_level's words (pybroker.logfmt maps them to logging's levels)
LOG_LEVEL_NAMES = frozenset(("debug", "info", "warn", "warning", "error", "fatal"))


class Options(OptionFields):
    """Resolved settings, one attribute per key (hot paths read them per command); their
    types are declared by pybroker.optiontypes.OptionFields.

    Durations are integers in nanoseconds.
    """

    def __init__(self, values: Mapping[str, OptionValue | None]) -> None:
        self.__dict__.update(values)

    @property
    def values(self) -> dict[str, OptionValue]:
        return {s.key: getattr(self, s.key) for s in SPECS}

    def with_overrides(self, **kw: OptionValue) -> "Options":
        merged = self.values
        merged.update(kw)
        return Options(merged)


def _coerce(spec: OptionSpec, value: object, where: str) -> OptionValue:
    """Turn a TOML or command-line value into the option's type, or raise ConfigError."""
    name = where or f"config key {spec.key}"
    kind = spec.kind
    try:
        if kind == "duration":
            if isinstance(value, bool):
                raise ValueError("expected a duration")
            if isinstance(value, int):
                out: OptionValue = value * MS  # a bare number is milliseconds
            elif isinstance(value, str):
                out = parse_duration(value)
            else:
                raise ValueError("expected a duration string like \"60s\"")
        elif kind == "int":
            if isinstance(value, bool) or not isinstance(value, (int, str)) or (
                    isinstance(value, str) and not re.fullmatch(r"\s*[+-]?\d+\s*", value)):
                raise ValueError("expected an integer")
            out = int(value)
        elif kind == "float":
            if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                raise ValueError("expected a number")
            try:
                out = float(value)
            except ValueError:
                raise ValueError("expected a number") from None
        elif kind == "bool":
            if isinstance(value, bool):
                out = value
            elif isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
                out = value.lower() in ("true", "1", "yes")
            else:
                raise ValueError("expected true or false")
        elif kind == "tls_required":
            out = parse_tls_required(value)
        elif kind == "list":
            if isinstance(value, str):
                out = [v for v in (p.strip() for p in value.split(",")) if v]
            elif isinstance(value, list):
                out = list(value)
            else:
                raise ValueError("expected a list")
        else:
            if not isinstance(value, str):
                raise ValueError("expected a string")
            out = value
    except ValueError as e:
        raise ConfigError(f"{name}: {e} (got {value!r})") from None
    if spec.low is not None and isinstance(out, (int, float)) and not spec.low <= out <= (spec.high or out):
        shown = format_duration(int(out)) if kind == "duration" else out
        lo = format_duration(int(spec.low)) if kind == "duration" else spec.low
        hi = format_duration(int(spec.high or 0)) if kind == "duration" else spec.high
        raise ConfigError(f"{name}: {shown} is out of range {lo}..{hi}")
    return out


def load_toml(path: str) -> dict[str, object]:
    """Read a TOML config file into a dict of raw values."""
    import tomllib

    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r} not found") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path!r} is not valid TOML: {e}") from None
    except OSError as e:
        raise ConfigError(f"config file {path!r} cannot be read: {e.strerror}") from None


def resolve(file_values: Mapping[str, object], flag_values: Mapping[str, object],
            validators: tuple[Callable[[Options], None], ...] = ()) -> Options:
    """Merge defaults < config file < flags, validate, and return Options."""
    values: dict[str, OptionValue | None] = {s.key: s.default for s in SPECS}
    for key, raw in file_values.items():
        spec = SPEC_BY_KEY.get(key)
        if spec is None:
            raise ConfigError(f"unknown config key {key!r}")
        values[key] = _coerce(spec, raw, "")
    for key, raw in flag_values.items():
        if raw is None:
            continue
        spec = SPEC_BY_KEY[key]
        values[key] = _coerce(spec, raw, f"flag {spec.flag_name}")
    if values["id"] is None:
        values["id"] = _default_node_id()
    if not values["broadcast_address"]:
        values["broadcast_address"] = socket.gethostname()
    if values["loop_threads"] == 0:
        values["loop_threads"] = os.cpu_count() or 1
    options = Options(values)
    _check(options)
    for v in validators:
        v(options)
    return options


def _check(v: Options) -> None:
    """Cross-field checks (nsqd's, in nsqd.New, plus pybroker's own)."""
    _check_tls(v)
    if v.loop_sender not in LOOP_SENDER_MODES:
        raise ConfigError(f"loop_sender: {v.loop_sender!r} is not \"auto\", \"on\" or \"off\"")
    if v.durability not in ("memory", "fsync"):
        raise ConfigError(f"durability: {v.durability!r} is not \"memory\" or \"fsync\"")
    dlt = v.dead_letter_topic
    if dlt and (not _TOPIC_RE.fullmatch(dlt) or len(dlt) > 64):
        raise ConfigError(f"dead_letter_topic: {dlt!r} is not a valid topic name "
                          "(1-64 characters of [.a-zA-Z0-9_-], not #ephemeral)")
    if v.cluster_etcd:
        if v.min_insync_replicas > v.replication_factor:
            raise ConfigError("min_insync_replicas: must not exceed replication_factor")
        if 0 < v.max_insync_replicas < max(2, v.min_insync_replicas):
            raise ConfigError("max_insync_replicas: must be 0 (every caught-up replica) "
                              "or at least min_insync_replicas and 2 (with 1 no follower "
                              "could be elected when the leader is lost)")
        try:
            split_hostport(v.cluster_address)
        except ValueError as e:
            raise ConfigError(f"cluster_address: {e}") from None
        url = str(v.cluster_etcd)
        if not re.fullmatch(r"(http://)?[^/:\s]+(:\d+)?/?", url):
            raise ConfigError(f"cluster_etcd: {url!r} is not http://host:port")
    if v.msg_timeout > v.max_msg_timeout:
        raise ConfigError("msg_timeout: must not exceed max_msg_timeout")
    if v.max_msg_size > v.max_body_size:
        raise ConfigError("max_msg_size: must not exceed max_body_size")
    if v.min_output_buffer_timeout > v.max_output_buffer_timeout:
        raise ConfigError("min_output_buffer_timeout: must not exceed max_output_buffer_timeout")
    for key, addr in (("tcp_address", v.tcp_address), ("http_address", v.http_address)):
        if addr or key == "tcp_address":
            try:
                split_hostport(addr)
            except ValueError as e:
                raise ConfigError(f"{key}: {e}{_unix_hint(addr)}") from None
    # matches nsqd: the flag may repeat and each value may be a comma-separated list (the
    # values are still as given here: strings or numbers; floats from here on)
    percentiles: list[float] = []
    for raw in v.e2e_processing_latency_percentiles:
        parts = raw.split(",") if isinstance(raw, str) else [raw]
        for p in parts:
            try:
                if isinstance(p, bool):
                    raise ValueError
                f = float(p)
            except (TypeError, ValueError):
                f = -1.0
            if not 0 < f <= 1:
                raise ConfigError(f"e2e_processing_latency_percentiles: {p!r} is not in (0, 1]")
            percentiles.append(f)
    v.e2e_processing_latency_percentiles = percentiles


# tls_required: nsqd's TLSNotRequired, TLSRequiredExceptHTTP, TLSRequired
TLS_NOT_REQUIRED, TLS_REQUIRED_EXCEPT_HTTP, TLS_REQUIRED = 0, 1, 2
_GO_BOOLS = {"1": True, "t": True, "true": True, "0": False, "f": False, "false": False}
TLS_MIN_VERSIONS = ("tls1.0", "tls1.1", "tls1.2", "tls1.3")


def parse_tls_required(value: object) -> int:
    """nsqd's tlsRequiredOption: "tcp-https", or a Go bool ("true", "1", "f", ...)."""
    if isinstance(value, bool):
        return TLS_REQUIRED if value else TLS_NOT_REQUIRED
    if isinstance(value, int) and value in (0, 1, 2):
        return value  # the resolved form (Options.with_overrides)
    text = str(value).lower()
    if text == "tcp-https":
        return TLS_REQUIRED_EXCEPT_HTTP
    if text not in _GO_BOOLS:
        raise ValueError("expected true, false or tcp-https")
    return TLS_REQUIRED if _GO_BOOLS[text] else TLS_NOT_REQUIRED


def _check_tls(v: Options) -> None:
    """nsqd's TLS and auth start-up rules (apps/nsqd options and nsqd.New)."""
    version = str(v.tls_min_version).lower()
    if version and version not in TLS_MIN_VERSIONS:
        # matches nsqd: "ssl3.0" is named in its help text but refused when parsed
        raise ConfigError(f"tls_min_version: unknown version {v.tls_min_version!r} "
                          f"(use {', '.join(TLS_MIN_VERSIONS)})")
    v.tls_min_version = version or "tls1.0"
    policy = v.tls_client_auth_policy
    if policy not in ("", "require", "require-verify"):
        raise ConfigError(f"tls_client_auth_policy: {policy!r} is not 'require' or "
                          "'require-verify'")
    if policy and v.tls_required == TLS_NOT_REQUIRED:
        v.tls_required = TLS_REQUIRED  # matches nsqd: a client policy implies TLS
    if bool(v.tls_cert) != bool(v.tls_key):
        raise ConfigError("tls_cert: tls_cert and tls_key must be given together")
    if not v.tls_cert and v.tls_required != TLS_NOT_REQUIRED:
        raise ConfigError("tls_required: cannot require TLS client connections without "
                          "TLS key and cert")
    if v.tls_cert and v.https_address:
        try:
            split_hostport(v.https_address)
        except ValueError as e:
            raise ConfigError(f"https_address: {e}{_unix_hint(v.https_address)}") from None
    method = str(v.auth_http_request_method).lower()
    if method not in ("get", "post"):
        raise ConfigError("auth_http_request_method: must be post or get")
    v.auth_http_request_method = method


def _unix_hint(addr: str) -> str:
    """nsqd takes a path without a colon as a unix socket; pybroker listens on TCP only."""
    return " (a unix socket path: pybroker listens on TCP only)" if ":" not in addr else ""


def split_hostport(addr: str) -> tuple[str, int]:
    """Split "host:port", "[::1]:port" or ":port" (all interfaces) into (host, port)."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"{addr!r} is not <host>:<port>")
    if int(port) > 65535:
        raise ValueError(f"port {int(port)} in {addr!r} is out of range 0..65535")
    host = host.strip("[]")
    return (host or "0.0.0.0"), int(port)
