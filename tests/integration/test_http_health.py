"""/ping and health: a broker whose runtime reports a failure (as storage does after a
failed disk write) answers /ping with 500 "NOK - <why>" like nsqd, and says so in
/stats and /metrics; when the failure clears it is OK again.

The broker runs in this process (a real Runtime with real sockets and threads) so the
test can set ``runtime.health`` directly; it is shut down at the end of the test.
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pybroker.config import resolve
from pybroker.runtime import Runtime


@pytest.fixture
def runtime(tmp_path: Path) -> Iterator[Runtime]:
    options = resolve({}, {"tcp_address": "127.0.0.1:0", "http_address": "127.0.0.1:0",
                           "data_path": str(tmp_path), "loop_threads": "2"})
    rt = Runtime(options)
    rt.start()
    try:
        yield rt
    finally:
        rt.shutdown(5)


def get(rt: Runtime, path: str) -> tuple[int, str, bytes]:
    url = f"http://{rt.http.address}{path}"
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read()


def health_metric(rt: Runtime) -> str:
    text = get(rt, "/metrics")[2].decode()
    (line,) = [ln for ln in text.splitlines() if ln.startswith("nsq_healthy ")]
    return line.split()[1]


def stats_health(rt: Runtime) -> Any:
    return json.loads(get(rt, "/stats?format=json&include_mem=false")[2])["health"]


def test_ping_reports_an_unhealthy_broker(runtime: Runtime) -> None:
    assert get(runtime, "/ping")[::2] == (200, b"OK")
    runtime.health = "failed to write messages to disk: No space left on device"
    status, ctype, body = get(runtime, "/ping")
    why = b"NOK - failed to write messages to disk: No space left on device"
    assert (status, body) == (500, why)
    assert ctype == "text/plain; charset=utf-8"
    assert stats_health(runtime).startswith("NOK - failed to write")
    assert health_metric(runtime) == "0"
    runtime.health = None
    assert get(runtime, "/ping")[::2] == (200, b"OK")
    assert stats_health(runtime) == "OK" and health_metric(runtime) == "1"
