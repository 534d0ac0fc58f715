"""Options: nsqd names and defaults, durations, TOML + flags, and clear errors."""
from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pybroker.config import MS, S, SPECS, format_duration, parse_duration, resolve
from pybroker.errors import ConfigError


@pytest.mark.parametrize("text,ns", [("60s", 60 * S), ("250ms", 250 * MS), ("1h30m", 5400 * S),
                                     ("1.5s", 1500 * MS), ("0", 0), ("15m", 900 * S),
                                     ("10us", 10_000), ("7ns", 7)])
def test_parse_duration(text: str, ns: int) -> None:
    assert parse_duration(text) == ns


@pytest.mark.parametrize("text", ["", "60", "1x", "s", "-1s", "1h junk"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)


def test_format_duration_round_trips() -> None:
    for ns in (60 * S, 250 * MS, 3600 * S, 90 * S, 7):
        assert parse_duration(format_duration(ns)) == ns


def test_defaults_are_nsqds() -> None:
    o = resolve({}, {})
    assert (o.mem_queue_size, o.msg_timeout, o.max_msg_timeout) == (10000, 60 * S, 900 * S)
    assert (o.max_msg_size, o.max_body_size, o.max_rdy_count) == (1048576, 5242880, 2500)
    assert (o.max_req_timeout, o.max_heartbeat_interval) == (3600 * S, 60 * S)
    assert (o.queue_scan_interval, o.queue_scan_selection_count) == (100 * MS, 20)
    assert (o.queue_scan_worker_pool_max, o.queue_scan_dirty_percent) == (4, 0.25)
    assert o.tcp_address == "127.0.0.1:4150"
    assert o.loop_threads == 1 and 0 <= o.id < 1024
    assert resolve({"loop_threads": 0}, {}).loop_threads >= 1  # 0: one per CPU


def test_flags_override_file() -> None:
    o = resolve({"mem_queue_size": 5, "msg_timeout": "30s"}, {"mem_queue_size": "7"})
    assert (o.mem_queue_size, o.msg_timeout) == (7, 30 * S)


def test_every_key_has_a_flag_named_like_nsqd() -> None:
    flags = {s.flag_name for s in SPECS}
    for f in ("--tcp-address", "--mem-queue-size", "--msg-timeout", "--max-rdy-count",
              "--queue-scan-interval", "--data-path", "--node-id", "--lookupd-tcp-address"):
        assert f in flags


@pytest.mark.parametrize("raw,expected", [
    (True, 2), (False, 0), ("true", 2), ("1", 2), ("t", 2), ("FALSE", 0), ("0", 0),
    ("tcp-https", 1), ("TCP-HTTPS", 1),
])
def test_tls_required_takes_nsqds_spellings(raw: object, expected: int) -> None:
    o = resolve({"tls_required": raw, "tls_cert": "c.pem", "tls_key": "k.pem"}, {})
    assert o.tls_required == expected


def test_a_client_auth_policy_implies_tls_required() -> None:
    o = resolve({"tls_cert": "c.pem", "tls_key": "k.pem",
                 "tls_client_auth_policy": "require"}, {})
    assert o.tls_required == 2  # matches nsqd.New


@pytest.mark.parametrize("raw", ["tls1.0", "TLS1.1", "tls1.2", "tls1.3"])
def test_tls_min_version_spellings(raw: str) -> None:
    assert resolve({"tls_min_version": raw}, {}).tls_min_version == raw.lower()


@pytest.mark.parametrize("file,flags,needle", [
    ({"no_such_key": 1}, {}, "unknown config key 'no_such_key'"),
    ({"mem_queue_size": "lots"}, {}, "mem_queue_size: expected an integer"),
    ({"msg_timeout": "soon"}, {}, "msg_timeout: invalid duration"),
    ({"max_rdy_count": 0}, {}, "max_rdy_count: 0 is out of range"),
    ({}, {"queue_scan_dirty_percent": "2"}, "--queue-scan-dirty-percent: 2.0 is out of range"),
    ({"msg_timeout": "20m"}, {}, "msg_timeout: must not exceed max_msg_timeout"),
    ({"tcp_address": "nowhere"}, {}, "tcp_address: 'nowhere' is not <host>:<port>"),
    ({"tls_cert": "/x.pem"}, {}, "tls_cert: tls_cert and tls_key must be given together"),
    ({"tls_required": True}, {}, "cannot require TLS client connections without TLS key"),
    ({}, {"tls_required": "sometimes"}, "--tls-required: expected true, false or tcp-https"),
    ({"tls_min_version": "ssl3.0"}, {}, "tls_min_version: unknown version 'ssl3.0'"),
    ({"tls_client_auth_policy": "maybe"}, {}, "tls_client_auth_policy: 'maybe' is not"),
    ({"auth_http_request_method": "put"}, {}, "auth_http_request_method: must be post or get"),
    ({"snappy": "maybe"}, {}, "snappy: expected true or false"),
    ({}, {"loop_sender": "sometimes"}, "loop_sender: 'sometimes' is not \"auto\""),
    ({"cluster_etcd": "http://127.0.0.1:2379", "min_insync_replicas": 3,
      "max_insync_replicas": 2}, {}, "max_insync_replicas: must be 0"),
    ({}, {"max_insync_replicas": "65"}, "--max-insync-replicas: 65 is out of range"),
    ({"cluster_etcd": "http://127.0.0.1:2379", "min_insync_replicas": 1,
      "max_insync_replicas": 1}, {}, "with 1 no follower could be elected"),
])
def test_bad_values_name_the_key(file: dict, flags: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        resolve(file, flags)
    assert needle in str(e.value)


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pybroker", "serve", *args],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("content,needle", [
    ("bogus = 1\n", "unknown config key 'bogus'"),
    ("mem_queue_size = \"x\"\n", "mem_queue_size"),
    ("max_rdy_count = -5\n", "max_rdy_count"),
    ("this is not toml", "not valid TOML"),
])
def test_cli_bad_config_exits_2_with_one_line(tmp_path: Path, content: str, needle: str) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text(content)
    r = _serve("-c", str(cfg))
    assert r.returncode == 2
    assert needle in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_cli_port_in_use_exits_2(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
        r = _serve(f"--tcp-address=127.0.0.1:{port}", "--http-address=",
                   f"--data-path={tmp_path}")
    assert r.returncode == 2
    assert "tcp_address" in r.stderr and "in use" in r.stderr
    assert "Traceback" not in r.stderr


def test_shipped_configs_load(tmp_path: Path) -> None:
    from pybroker.config import load_toml
    root = Path(__file__).resolve().parents[2]
    for name in ("prod.toml", "dev.toml"):
        resolve(load_toml(str(root / "conf" / name)), {})


def test_python_m_and_help() -> None:
    r = subprocess.run([sys.executable, "-m", "pybroker", "serve", "--help"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--mem-queue-size" in r.stdout
