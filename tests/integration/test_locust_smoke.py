"""Smoke run of loadtest/locustfile.py: a few seconds headless against a pybroker, every
user kind at once; each request type must be reported with a non-zero count and no
failures (no timing assertions)."""
from __future__ import annotations

import csv
import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.broker import BrokerProcess, project_root, unique_name
from tests.support.programs import missing

# Only look locust up: importing it here would monkey-patch this pytest process with gevent.
if importlib.util.find_spec("locust") is None:
    missing("locust is not installed (pip install locust; it is in the test extra)")

pytestmark = pytest.mark.timeout(60)

LOCUSTFILE = str(project_root() / "loadtest" / "locustfile.py")


def test_headless_run_reports_every_request_type(
        make_broker: Callable[..., BrokerProcess], tmp_path: Path) -> None:
    b = make_broker(wait_http=True)
    topic = unique_name("locust")
    env = dict(os.environ, NSQ_TCP_ADDRESS=b.tcp_hostport, NSQ_HTTP_ADDRESS=b.http_hostport,
               NSQ_TOPIC=topic, NSQ_SIZE="100", NSQ_BATCH="5", NSQ_PUB_WAIT="0.005")
    proc = subprocess.run(
        [sys.executable, "-m", "locust", "-f", LOCUSTFILE, "--headless", "-u", "5", "-r", "5",
         "-t", "8s", "--csv", str(tmp_path / "nsq"), "--only-summary", "--exit-code-on-error",
         "1"], env=env, capture_output=True, text=True, timeout=50, cwd=tmp_path,
        check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(tmp_path / "nsq_stats.csv", newline="") as f:
        rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(f)}
    for key in [("PUB", topic), ("MPUB", topic), ("E2E", topic),
                ("POST", f"/pub {topic}"), ("POST", f"/mpub {topic}")]:
        assert key in rows, (key, list(rows))
        assert int(rows[key]["Request Count"]) > 0, rows[key]
        assert int(rows[key]["Failure Count"]) == 0, rows[key]
    # deliveries carry the publish stamp: an end-to-end time was measured
    assert float(rows[("E2E", topic)]["Max Response Time"]) > 0
