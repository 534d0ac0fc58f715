"""NSQ's own tools read the broker's /stats without errors: nsq_stat prints the channel's
figures and nsqadmin's /api/nodes and /api/topics/<t> show the topic and channel.

Against pybroker and a real nsqd. Skipped when the NSQ binaries are absent (a failure in
strict mode: tests/support/programs.py). Each tool is a subprocess stopped by its PID.
"""
from __future__ import annotations

import re
import subprocess
import urllib.request
from collections.abc import Iterator

import pytest

from tests.support.broker import BrokerProcess, unique_name
from tests.support.http import get_json
from tests.support.nsqtools import start_nsqadmin
from tests.support.programs import require_program


def post(b: BrokerProcess, path: str, body: bytes = b"") -> None:
    req = urllib.request.Request(f"http://{b.http_hostport}{path}", body, method="POST")
    with urllib.request.urlopen(req, timeout=5) as r:
        assert r.status == 200


def seed(b: BrokerProcess) -> tuple[str, str]:
    topic, channel = unique_name("tools"), "c"
    post(b, f"/topic/create?topic={topic}")
    post(b, f"/channel/create?topic={topic}&channel={channel}")
    post(b, f"/mpub?topic={topic}", b"one\ntwo\nthree")
    return topic, channel


def test_nsq_stat(any_broker: BrokerProcess) -> None:
    tool = require_program("nsq_stat")
    topic, channel = seed(any_broker)
    r = subprocess.run([tool, f"--nsqd-http-address={any_broker.http_hostport}",
                        f"--topic={topic}", f"--channel={channel}", "--count=2",
                        "--interval=200ms"], capture_output=True, timeout=30, check=False)
    out = r.stdout.decode()
    assert r.returncode == 0, r.stderr.decode() + out
    assert "depth" in out and "metadata" in out
    rows = [ln.split() for ln in out.splitlines() if re.match(r"\s*\d+\s+\d+\s+\|", ln)]
    assert len(rows) == 2, out
    for row in rows:
        # ingress egress | total mem disk inflt def | req t-o msgs clients
        nums = [int(x) for x in row if x != "|"]
        assert nums[2:] == [3, 3, 0, 0, 0, 0, 0, 3, 0], out


@pytest.fixture
def nsqadmin(any_broker: BrokerProcess) -> Iterator[str]:
    admin = start_nsqadmin(f"--nsqd-http-address={any_broker.http_hostport}")
    try:
        yield f"http://{admin.hostport()}"
    finally:
        admin.stop()
    errors = [ln for ln in admin.lines if "ERROR" in ln]
    assert not errors, "".join(errors)


def test_nsqadmin_nodes_and_topic(any_broker: BrokerProcess, nsqadmin: str) -> None:
    topic, channel = seed(any_broker)
    nodes = get_json(f"{nsqadmin}/api/nodes")
    assert nodes["message"] == ""
    (node,) = nodes["nodes"]
    assert node["tcp_port"] == any_broker.tcp_address[1]  # type: ignore[index]
    assert node["http_port"] == any_broker.http_address[1]  # type: ignore[index]
    assert node["version"] == "1.3.0"
    assert {"topic": topic, "tombstoned": False} in node["topics"]

    t = get_json(f"{nsqadmin}/api/topics/{topic}")
    assert t["message"] == ""
    assert (t["topic_name"], t["message_count"], t["depth"]) == (topic, 3, 0)
    (ch,) = t["channels"]
    assert (ch["channel_name"], ch["depth"], ch["message_count"]) == (channel, 3, 3)
    c = get_json(f"{nsqadmin}/api/topics/{topic}/{channel}")
    assert c["message"] == "" and c["depth"] == 3
    n = get_json(f"{nsqadmin}/api/nodes/{node['broadcast_address']}:{node['http_port']}")
    assert n["message"] == "" and topic in [x["topic_name"] for x in n["topics"]]
