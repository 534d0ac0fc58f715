"""``pybroker-nsqd``: ``pybroker serve`` under nsqd 1.3.0's command line (a drop-in nsqd).

What it owns: nsqd's flag table and its rules, so a script, systemd unit or client
library test harness that starts ``nsqd`` starts pybroker unchanged:

- every flag of nsqd 1.3.0's ``-help`` list, in Go's flag syntax (pybroker/goflags.py);
  the deprecated no-ops ``-verbose`` and ``-worker-id`` are accepted and do nothing, as
  in nsqd; pybroker's own options are flags too (``-durability``, ``-loop-threads``...);
  any other flag is refused with Go's one line (``flag provided but not defined: -foo``);
- nsqd's defaults: every interface (``0.0.0.0:4150``, ``:4151``, ``:4152``), the
  ``[nsqd] `` log prefix; the rest are pybroker's, which are nsqd's;
- ``-config FILE``: nsqd's TOML config (its cfg names, which are pybroker's keys);
  precedence flag > file > default, as nsqd's options.Resolve; keys neither nsqd nor
  pybroker knows are ignored as nsqd ignores them, with a warning;
- ``-version``: ``nsqd v1.3.0-compat (built w/pybroker-X.Y.Z)``, nsqd's format.

Start-up order and cost: parse (no CLI framework), resolve, bind every listener
(server/sockets.py), then import the server and serve; the garbage collector stays off
until start-up is done. A bad command line exits 2 with one line, as Go's flag package.
"""
from __future__ import annotations

import gc
import sys
from typing import Callable

from pybroker import DROPIN_VERSION
from pybroker.goflags import (BOOL, BOOLVALUE, DURATION, FLOATS, INT, LIST, STRING, VALUE,
                              Flag, FlagError, FlagValue, HelpRequested, parse, parse_bool, parse_float,
                              usage)

PROG = "pybroker-nsqd"

# nsqd 1.3.0's flags (``nsqd -help``); the tests check this list against the binary's
NSQD_FLAGS = (
    "auth-http-address", "broadcast-address", "broadcast-http-port", "broadcast-tcp-port",
    "config", "data-path", "deflate", "e2e-processing-latency-percentile",
    "e2e-processing-latency-window-time", "http-address", "http-client-connect-timeout",
    "http-client-request-timeout", "https-address", "log-level", "log-prefix",
    "lookupd-tcp-address", "max-body-size", "max-bytes-per-file", "max-channel-consumers",
    "max-deflate-level", "max-heartbeat-interval", "max-msg-size", "max-msg-timeout",
    "max-output-buffer-size", "max-output-buffer-timeout", "max-rdy-count",
    "max-req-timeout", "mem-queue-size", "min-output-buffer-timeout", "msg-timeout",
    "node-id", "output-buffer-timeout", "queue-scan-selection-count",
    "queue-scan-worker-pool-max", "snappy", "statsd-address", "statsd-exclude-ephemeral",
    "statsd-interval", "statsd-mem-stats", "statsd-prefix", "statsd-udp-packet-size",
    "sync-every", "sync-timeout", "tcp-address", "tls-cert", "tls-client-auth-policy",
    "tls-key", "tls-min-version", "tls-required", "tls-root-ca-file", "verbose", "version",
    "worker-id",
)
# nsqd's defaults where pybroker serve's differ (serve listens on loopback)
NSQD_DEFAULTS = {"tcp_address": "0.0.0.0:4150", "http_address": "0.0.0.0:4151",
                 "https_address": "0.0.0.0:4152", "log_prefix": "[nsqd] "}
_NO_OPS = {"verbose": "[deprecated] has no effect, use -log-level",
           "worker-id": "[deprecated] use -node-id"}
_LOG_LEVELS = ("debug", "info", "warn", "error", "fatal")
_TLS_VERSIONS = ("tls1.0", "tls1.1", "tls1.2", "tls1.3")


def _log_level(s: str) -> str:
    if s.lower() not in _LOG_LEVELS:
        raise ValueError(f"invalid log level '{s}' (debug, info, warn, error, fatal)")
    return s.lower()


def _tls_required(s: str) -> str:
    s = s.lower()
    if s == "tcp-https":
        return s
    try:
        return "true" if parse_bool(s) else "false"
    except ValueError:
        raise ValueError(f'strconv.ParseBool: parsing "{s}": invalid syntax') from None


def _tls_min_version(s: str) -> str:
    s = s.lower()
    if s and s not in _TLS_VERSIONS:  # matches nsqd 1.3.0: "ssl3.0" is refused
        raise ValueError(f'unknown tlsVersionOption "{s}"')
    return s


_VALUE_PARSERS: dict[str, Callable[[str], FlagValue]] = {"log_level": _log_level, "tls_required": _tls_required,
                  "tls_min_version": _tls_min_version, "queue_scan_dirty_percent": parse_float}
_KINDS = {"str": STRING, "int": INT, "duration": DURATION, "bool": BOOL, "list": LIST,
          "float": VALUE, "tls_required": BOOLVALUE}


def flag_table() -> tuple[dict[str, Flag], dict[str, str]]:
    """Every flag (nsqd's, then pybroker's own) and the option key each one sets."""
    from pybroker.config import SPECS, format_duration

    flags = {"version": Flag("version", BOOL, False, "print version string"),
             "config": Flag("config", STRING, "", "path to config file (nsqd's TOML)")}
    for name, text in _NO_OPS.items():
        flags[name] = Flag(name, BOOL, False, text)
    keys: dict[str, str] = {}
    for spec in SPECS:
        name = spec.flag_name[2:]
        kind = _KINDS[spec.kind]
        if spec.key == "e2e_processing_latency_percentiles":
            kind = FLOATS
        elif spec.key in _VALUE_PARSERS:
            kind = BOOLVALUE if spec.kind == "tls_required" else VALUE
        default = NSQD_DEFAULTS.get(spec.key, spec.default)
        if spec.kind == "duration" and isinstance(default, int):
            default = format_duration(default)
        if spec.key == "id":
            default = None  # a hash of the hostname
        text = spec.help if name in NSQD_FLAGS else f"[pybroker] {spec.help}"
        flags[name] = Flag(name, kind, default, text, _VALUE_PARSERS.get(spec.key))
        keys[name] = spec.key
    return flags, keys


def flag_values(actual: dict[str, FlagValue], keys: dict[str, str]) -> dict[str, FlagValue]:
    """Parsed flags -> raw option values for config.resolve (which checks ranges)."""
    from pybroker.config import SPEC_BY_KEY
    from pybroker.errors import ConfigError

    out: dict[str, FlagValue] = {}
    for name, value in actual.items():
        key = keys.get(name)
        if key is None:
            continue  # -version, -config, and nsqd's deprecated no-ops
        kind = SPEC_BY_KEY[key].kind
        if kind == "duration" and isinstance(value, int):
            if value < 0:
                raise ConfigError(f"flag -{name}: a negative duration is not allowed "
                                  f"({value}ns)")
            value = f"{value}ns"
        elif kind == "int":
            value = str(value)
        elif key == "tls_min_version" and not value:
            continue  # matches nsqd: an empty value leaves the default
        out[key] = value
    return out


def file_values(path: str) -> tuple[dict[str, object], list[str]]:
    """nsqd's config file: (values of known keys, keys ignored as nsqd ignores them)."""
    from pybroker.config import SPEC_BY_KEY, load_toml

    raw = load_toml(path)
    known = {k: v for k, v in raw.items() if k in SPEC_BY_KEY}
    return known, sorted(k for k in raw if k not in SPEC_BY_KEY)


def main(argv: list[str] | None = None) -> int:
    """The console script: returns the exit status."""
    gc.disable()  # start-up allocates and frees little; runtime.run enables it again
    args = sys.argv[1:] if argv is None else argv
    flags, keys = flag_table()
    try:
        actual, rest = parse(flags, args)
    except HelpRequested:
        sys.stderr.write(usage("nsqd", flags))
        return 0
    except FlagError as e:
        print(e, file=sys.stderr)
        return 2
    if actual.get("version"):
        print(DROPIN_VERSION)
        return 0
    from pybroker.config import resolve
    from pybroker.errors import ConfigError

    ignored: list[str] = []
    try:
        from_file: dict[str, object] = dict(NSQD_DEFAULTS)
        config = actual.get("config")
        if config:
            known, ignored = file_values(str(config))
            from_file.update(known)
        options = resolve(from_file, flag_values(actual, keys))
        _log_level(options.log_level)  # the config file's, as nsqd's cfg.Validate
    except ValueError as e:
        print(f"{PROG}: bad configuration: log_level: {e}", file=sys.stderr)
        return 2
    except ConfigError as e:
        print(f"{PROG}: bad configuration: {e}", file=sys.stderr)
        return 2
    from pybroker.server.sockets import StartupError, bind_listeners

    try:
        bound = bind_listeners(options)  # first, as nsqd.New: nothing slow before
    except StartupError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    from pybroker.logfmt import setup_logging

    log = setup_logging(options.log_level, options.log_prefix)
    for key in ignored:
        log.warning("config key %r is not an nsqd option: ignored (as nsqd does)", key)
    if rest:
        # matches nsqd: Go's flag parsing stops at the first non-flag argument and nsqd
        # never reads the rest; said here rather than silently
        log.warning("ignoring the arguments after the flags, as nsqd does: %s",
                    " ".join(rest))
    from pybroker.runtime import run

    return run(options, bound, banner=DROPIN_VERSION, prog=PROG)


if __name__ == "__main__":
    sys.exit(main())
