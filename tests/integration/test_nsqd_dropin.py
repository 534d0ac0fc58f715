"""``pybroker-nsqd`` stands where an ``nsqd`` binary stands: nsqd 1.3.0's command line.

The flag list comes from the real nsqd's own ``-help`` when nsqd is on PATH (the drop-in's
table must name exactly those flags), else from the drop-in's table. Every flag is given
a value that differs from its default, in each of Go's spellings in turn (``-f=v``,
``--f=v``, ``-f v``, ``--f v``; booleans bare or ``=value``); nsqd and pybroker-nsqd are
started with the same argv and must answer ``GET /config/<name>`` alike for every flag
(where nsqd is absent, with the values Go's rules give). Then ``-version``, a config
file, and the command lines both refuse, with the same first line.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pybroker import DROPIN_VERSION, __version__
from pybroker.nsqd_cli import NSQD_FLAGS
from tests.support.broker import BrokerProcess, find_nsqd
from tests.support.certs import CertSet, make_certs


def dropin_command() -> list[str]:
    exe = Path(sys.executable).with_name("pybroker-nsqd")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("pybroker-nsqd")
    return [found] if found else [sys.executable, "-m", "pybroker.nsqd_cli"]


class Started(BrokerProcess):
    """A broker started with exactly the argv given (no flags added)."""

    def __init__(self, cmd: list[str], argv: list[str], **kw: Any) -> None:
        super().__init__("nsqd", **kw)
        self.cmd = cmd + argv

    def command(self) -> list[str]:
        return self.cmd


@pytest.fixture
def start() -> Iterator[Callable[..., Started]]:
    started: list[Started] = []

    def run(cmd: list[str], argv: list[str], **kw: Any) -> Started:
        b = Started(cmd, argv, **kw)
        started.append(b)
        return b.start()

    yield run
    for b in started:
        code = b.stop()
        b.cleanup()
        assert code == 0, b.stderr_text()
        assert "Traceback" not in b.stderr_text(), b.stderr_text()


# -- nsqd's flag table ---------------------------------------------------------------------
def nsqd_help_flags(nsqd: str) -> dict[str, str]:
    """Flag name -> Go type word ("" for booleans), parsed from ``nsqd -help``."""
    r = subprocess.run([nsqd, "-help"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    flags = dict(re.findall(r"^  -([a-z0-9-]+)(?: (\w+))?$", r.stderr, re.M))
    assert len(flags) > 40, r.stderr
    return flags


def flag_types() -> dict[str, str]:
    nsqd = find_nsqd()
    if nsqd is not None:
        return nsqd_help_flags(nsqd)
    from pybroker.goflags import BOOL, BOOLVALUE
    from pybroker.nsqd_cli import flag_table

    table, _ = flag_table()
    return {n: ("" if table[n].kind in (BOOL, BOOLVALUE) else table[n].kind) for n in NSQD_FLAGS}


def test_the_table_is_nsqds() -> None:
    nsqd = find_nsqd()
    if nsqd is None:
        pytest.skip("no nsqd binary on PATH (or $NSQD) to read the flag list from")
    assert sorted(nsqd_help_flags(nsqd)) == sorted(NSQD_FLAGS)


# a value for every flag, unlike its default, written as Go reads it (0x, octal, _, 1m30s)
def values(tmp: Path, certs: CertSet) -> dict[str, list[str] | str | None]:
    return {
        "auth-http-address": ["127.0.0.1:1", "127.0.0.1:2"],
        "broadcast-address": "127.0.0.1", "broadcast-http-port": "4999",
        "broadcast-tcp-port": "4998", "config": None, "version": None,
        "data-path": "DATA", "deflate": "false",
        "e2e-processing-latency-percentile": ["0.99,0.5", "0.75"],
        "e2e-processing-latency-window-time": "5m", "http-address": "127.0.0.1:0",
        "http-client-connect-timeout": "3s", "http-client-request-timeout": "7.5s",
        "https-address": "127.0.0.1:0", "log-level": "DEBUG", "log-prefix": "[test] ",
        "lookupd-tcp-address": ["127.0.0.1:1"], "max-body-size": "0x600000",
        "max-bytes-per-file": "1_000_000", "max-channel-consumers": "7",
        "max-deflate-level": "9", "max-heartbeat-interval": "2m",
        "max-msg-size": "0b1000000000000000000000", "max-msg-timeout": "20m",
        "max-output-buffer-size": "131072", "max-output-buffer-timeout": "10s",
        "max-rdy-count": "0100", "max-req-timeout": "2h", "mem-queue-size": "5000",
        "min-output-buffer-timeout": "30ms", "msg-timeout": "1m30s", "node-id": "0x1f",
        "output-buffer-timeout": "200ms", "queue-scan-selection-count": "30",
        "queue-scan-worker-pool-max": "8", "snappy": "false",
        "statsd-address": "127.0.0.1:1", "statsd-exclude-ephemeral": "true",
        "statsd-interval": "30s", "statsd-mem-stats": "false", "statsd-prefix": "test.%s",
        "statsd-udp-packet-size": "1024", "sync-every": "100", "sync-timeout": "1s",
        "tcp-address": "127.0.0.1:0", "tls-cert": certs.server_cert,
        "tls-client-auth-policy": "require", "tls-key": certs.server_key,
        "tls-min-version": "TLS1.2", "tls-required": "tcp-https",
        "tls-root-ca-file": certs.ca, "verbose": "true", "worker-id": "true",
    }


# what /config answers for those values (Go's parse of each), for a run without nsqd
EXPECTED = {
    "auth_http_addresses": ["127.0.0.1:1", "127.0.0.1:2"], "broadcast_http_port": 4999,
    "broadcast_tcp_port": 4998, "deflate": False,
    "e2e_processing_latency_percentiles": [0.99, 0.75, 0.5],
    "e2e_processing_latency_window_time": 300 * 10**9,
    "http_client_request_timeout": 7_500_000_000, "log_level": 1, "log_prefix": "[test] ",
    "max_body_size": 6291456, "max_bytes_per_file": 1_000_000, "max_msg_size": 2097152,
    "max_rdy_count": 64, "msg_timeout": 90 * 10**9, "id": 31, "snappy": False,
    "statsd_exclude_ephemeral": True, "statsd_prefix": "test.127_0_0_1_4999.",
    "tls_min_version": 0x0303, "tls_required": 1, "nsqlookupd_tcp_addresses": ["127.0.0.1:1"],
}
_CFG = {"node-id": "id", "lookupd-tcp-address": "nsqlookupd_tcp_addresses",
        "auth-http-address": "auth_http_addresses",
        "e2e-processing-latency-percentile": "e2e_processing_latency_percentiles"}
FORMS = ["-f=v", "--f=v", "-f v", "--f v"]


def argv_for(form: str, types: dict[str, str], vals: dict[str, Any], data: str) -> list[str]:
    """Every flag once (list flags once per value) in one of Go's spellings; booleans
    bare when true (they take no separate value), else ``=value``."""
    out: list[str] = []
    dash = "--" if form.startswith("--") else "-"
    for name, kind in sorted(types.items()):
        raw = vals[name]
        if raw is None:
            continue
        for v in (raw if isinstance(raw, list) else [raw]):
            v = data if v == "DATA" else v
            if kind == "":  # a boolean takes no separate value in Go: bare when true
                out.append(f"{dash}{name}" if v == "true" and " " in form
                           else f"{dash}{name}={v}")
            elif " " in form:
                out += [f"{dash}{name}", v]
            else:
                out.append(f"{dash}{name}={v}")
    return out


def config_values(b: BrokerProcess, names: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in names:
        key = _CFG.get(name, name.replace("-", "_"))
        with urllib.request.urlopen(f"http://{b.http_hostport}/config/{key}", timeout=10) as r:
            body = r.read().decode()
        try:
            out[key] = json.loads(body)
        except ValueError:
            out[key] = body  # nsqd answers a string option as plain text
    return out


@pytest.mark.parametrize("form", FORMS)
def test_every_nsqd_flag_in_each_go_spelling(form: str, tmp_path: Path,
                                             start: Callable[..., Started]) -> None:
    types = flag_types()
    certs = make_certs(tmp_path / "certs")
    vals = values(tmp_path, certs)
    assert set(types) <= set(vals), set(types) - set(vals)
    names = sorted(n for n in types if vals[n] is not None and n not in ("verbose",
                                                                         "worker-id"))
    (tmp_path / "mine").mkdir()
    mine = start(dropin_command(), argv_for(form, types, vals, str(tmp_path / "mine")))
    assert "HTTPS: listening on" in mine.stderr_text()
    assert mine.stderr_text().startswith("[test] ") and DROPIN_VERSION in mine.stderr_text()
    got = config_values(mine, names)
    assert got.pop("data_path") == str(tmp_path / "mine")
    nsqd = find_nsqd()
    if nsqd is not None:
        (tmp_path / "theirs").mkdir()
        theirs = start([nsqd], argv_for(form, types, vals, str(tmp_path / "theirs")))
        want = config_values(theirs, names)
        want.pop("data_path")
        assert got == want
    for key, value in EXPECTED.items():
        assert got[key] == value, key


def test_version() -> None:
    for flag in ("--version", "-version", "-version=true"):
        r = subprocess.run([*dropin_command(), flag], capture_output=True, text=True,
                           timeout=30)
        assert (r.returncode, r.stdout) == (0, f"nsqd v1.3.0-compat (built w/pybroker-"
                                                f"{__version__})\n"), r.stderr
    # the regex client libraries' harnesses parse nsqd's version with (gnsq's)
    m = re.match(r"(?P<name>[a-z]+) v(?P<version>[0-9]+\.[0-9]+\.[0-9]+)(?:-[a-z]+)? "
                 r"\(built w\/(?P<go_version>[a-z0-9.-]+)\)", DROPIN_VERSION)
    assert m is not None and m.group("name") == "nsqd" and m.group("version") == "1.3.0"


def test_config_file_as_nsqd_reads_it(tmp_path: Path, start: Callable[..., Started]) -> None:
    cfg = tmp_path / "nsqd.cfg"
    cfg.write_text(
        'mem_queue_size = 123\n'
        'msg_timeout = "45s"\n'
        'max_req_timeout = 7200000\n'               # a bare number: milliseconds
        'nsqlookupd_tcp_addresses = ["127.0.0.1:1"]\n'
        'e2e_processing_latency_percentiles = [0.9]\n'
        'tls_required = false\n'
        'log_level = "debug"\n'
        'id = 12\n'
        'max_rdy_count = 300\n'                     # overridden by the flag below
        'no_such_option = 1\n')                     # nsqd ignores unknown keys
    argv = ["-tcp-address=127.0.0.1:0", "-http-address=127.0.0.1:0", "-max-rdy-count=400"]
    names = ["mem-queue-size", "msg-timeout", "max-req-timeout", "lookupd-tcp-address",
             "e2e-processing-latency-percentile", "tls-required", "log-level", "node-id",
             "max-rdy-count"]
    (tmp_path / "mine").mkdir()
    mine = start(dropin_command(), [f"-config={cfg}", f"-data-path={tmp_path / 'mine'}",
                                    *argv])
    got = config_values(mine, names)
    assert got == {"mem_queue_size": 123, "msg_timeout": 45 * 10**9,
                   "max_req_timeout": 7200 * 10**9, "nsqlookupd_tcp_addresses": ["127.0.0.1:1"],
                   "e2e_processing_latency_percentiles": [0.9], "tls_required": 0,
                   "log_level": 1, "id": 12, "max_rdy_count": 400}
    assert "no_such_option" in mine.stderr_text()  # said, and ignored
    nsqd = find_nsqd()
    if nsqd is not None:
        (tmp_path / "theirs").mkdir()
        theirs = start([nsqd], [f"-config={cfg}", f"-data-path={tmp_path / 'theirs'}", *argv])
        assert config_values(theirs, names) == got


def _first_line(cmd: list[str], argv: list[str]) -> tuple[int, str]:
    r = subprocess.run([*cmd, *argv], capture_output=True, text=True, timeout=30)
    return r.returncode, (r.stderr.strip().splitlines() or [""])[0]


@pytest.mark.parametrize("argv", [
    ["-no-such-flag"], ["--no-such-flag=1"], ["-tcp-address"], ["-mem-queue-size=x"],
    ["-mem-queue-size", "1.5"], ["-msg-timeout=10"], ["-snappy=maybe"], ["---tcp-address=x"],
    ["-log-level=loud"], ["-tls-min-version=ssl3.0"], ["-node-id=08"],
])
def test_refused_like_nsqd(argv: list[str]) -> None:
    code, line = _first_line(dropin_command(), argv)
    assert code == 2 and line, line
    assert "Traceback" not in line
    nsqd = find_nsqd()
    if nsqd is not None:
        their_code, their_line = _first_line([nsqd], argv)
        assert their_code != 0
        assert line == their_line


def test_an_unknown_flag_is_named_in_one_line() -> None:
    r = subprocess.run([*dropin_command(), "-tcp-address=127.0.0.1:0", "-durable-ish"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
    assert r.stderr == "flag provided but not defined: -durable-ish\n"


def test_help_exits_0_with_nsqds_usage_layout() -> None:
    for flag in ("-h", "-help", "--help"):
        r = subprocess.run([*dropin_command(), flag], capture_output=True, text=True,
                           timeout=30)
        assert r.returncode == 0
        assert r.stderr.startswith("Usage of nsqd:\n  -auth-http-address value\n")
        for name in NSQD_FLAGS:
            assert f"\n  -{name}" in r.stderr


def test_parsing_stops_at_the_first_argument_as_go_does(
        tmp_path: Path, start: Callable[..., Started]) -> None:
    """``-snappy false`` is -snappy=true then the argument "false": Go stops there, and
    nsqd ignores the rest (pybroker-nsqd says so in its log)."""
    b = start(dropin_command(), ["-tcp-address=127.0.0.1:0", "-http-address=127.0.0.1:0",
                                 f"-data-path={tmp_path}", "-snappy", "false",
                                 "-mem-queue-size=7"])
    got = config_values(b, ["snappy", "mem-queue-size"])
    assert got == {"snappy": True, "mem_queue_size": 10000}
    assert "ignoring the arguments after the flags" in b.stderr_text()
    b2 = start(dropin_command(), ["-tcp-address=127.0.0.1:0", "-http-address=127.0.0.1:0",
                                  f"-data-path={tmp_path / 'b2'}", "--", "-mem-queue-size=7"])
    assert config_values(b2, ["mem-queue-size"]) == {"mem_queue_size": 10000}


def test_nsqds_defaults_listen_on_every_interface(tmp_path: Path) -> None:
    """No address flags: nsqd's 0.0.0.0:4150 and :4151, in a private network namespace
    (fixed ports collide with nothing there)."""
    if not shutil.which("unshare") or subprocess.run(
            ["unshare", "-n", "true"], capture_output=True, check=False).returncode != 0:
        pytest.skip("cannot create a private network namespace (unshare -n)")
    script = ('ip link set lo up; "$@" 2>"$LOG" & pid=$!; '
              'for i in $(seq 200); do grep -q "HTTP: listening" "$LOG" && break; '
              'sleep 0.05; done; kill $pid; wait $pid')
    log = tmp_path / "log"
    r = subprocess.run(["unshare", "-n", "sh", "-c", script, "sh",
                        *dropin_command(), f"-data-path={tmp_path}"],
                       env={"LOG": str(log), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
                       capture_output=True, text=True, timeout=60)
    text = log.read_text()
    assert r.returncode == 0, (r.stderr, text)
    assert "TCP: listening on 0.0.0.0:4150" in text, text
    assert "HTTP: listening on 0.0.0.0:4151" in text, text


def test_serve_takes_gos_spellings(tmp_path: Path, start: Callable[..., Started]) -> None:
    b = start([sys.executable, "-m", "pybroker", "serve"],
              ["-tcp-address=127.0.0.1:0", "--http-address", "127.0.0.1:0",
               f"-data-path={tmp_path}", "--snappy", "-deflate=false", "--verbose",
               "-worker-id", "-statsd-exclude-ephemeral", "--mem-queue-size", "77",
               "-lookupd-tcp-address=127.0.0.1:1", "--lookupd-tcp-address", "127.0.0.1:2"])
    got = config_values(b, ["snappy", "deflate", "statsd-exclude-ephemeral",
                            "mem-queue-size", "lookupd-tcp-address"])
    assert got == {"snappy": True, "deflate": False, "statsd_exclude_ephemeral": True,
                   "mem_queue_size": 77,
                   "nsqlookupd_tcp_addresses": ["127.0.0.1:1", "127.0.0.1:2"]}
    assert "[pybroker] " in b.stderr_text()  # serve keeps its own log prefix
