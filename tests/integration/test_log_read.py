"""The log read by offset over HTTP (GET /topic/offsets, GET /topic/read, POST
/channel/commit) and its client, against a real broker process; no Spark needed.

Ranges come back complete and in order from the memory tail and from segment files,
bounded per response; bad arguments get clear 4xx answers; a commit moves a channel's
cursor forward only, and retention deletes what is below it and no more.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pybroker import _native
from pybroker.spark.log_client import LogClient, OffsetsLost
from tests.integration.test_spark_core import publish
from tests.support.broker import BrokerProcess, unique_name, wait_until

MakeBroker = Callable[..., BrokerProcess]
pytestmark = pytest.mark.timeout(120)


def _get(b: BrokerProcess, path: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(f"http://{b.http_hostport}{path}", method=method,
                                 data=b"" if method == "POST" else None)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def _records(data: bytes, first: int) -> list[tuple[int, bytes]]:
    pos, used, (status, _, _) = _native.log_scan(data, first, True, 1 << 31, 1 << 30)
    assert used == len(data) and status >= 0
    out = []
    for i, p in enumerate(pos):
        end = pos[i + 1] if i + 1 < len(pos) else len(data)
        out.append((first + i, data[p + 50:end]))
    return out


def test_ranges_are_complete_ordered_and_bounded(make_broker: MakeBroker) -> None:
    # a small memory tail, so most of the range is read back from the segment files
    b = make_broker("--mem-queue-size=1000", "--max-bytes-per-file=1048576")
    topic = unique_name("lr")
    sent = [b"m-%06d-" % i + b"x" * (i % 300) for i in range(30_000)]
    publish(b, topic, sent)
    status, _, body = _get(b, f"/topic/offsets?topic={topic}")
    assert status == 200
    assert json.loads(body) == {"topic": topic, "oldest_offset": 0, "end_offset": 30_000,
                                "newest_offset": 29_999}
    got: list[tuple[int, bytes]] = []
    off = 17
    while off < 30_000:
        status, h, data = _get(b, f"/topic/read?topic={topic}&offset={off}"
                                  "&max_bytes=200000&max_messages=5000")
        assert status == 200 and h["Content-Type"] == "application/octet-stream"
        assert len(data) <= 200_000 and int(h["X-Pybroker-Count"]) <= 5000
        assert int(h["X-Pybroker-First-Offset"]) == off
        assert int(h["X-Pybroker-End-Offset"]) == 30_000
        got += _records(data, off)
        off = int(h["X-Pybroker-Next-Offset"])
    assert got == list(enumerate(sent))[17:]
    # one record larger than max_bytes still comes, alone
    status, h, data = _get(b, f"/topic/read?topic={topic}&offset=299&max_bytes=10")
    assert status == 200 and _records(data, 299) == [(299, sent[299])]
    # the client pages through a range and stops at its end
    with LogClient(b.http_hostport) as c:
        chunks = list(c.read(topic, 100, 20_100, 65536))
        assert chunks[-1].next == 20_100
        assert [r for ch in chunks for r in _records(ch.data, ch.first)] == \
            list(enumerate(sent))[100:20_100]


def test_bad_arguments_get_clear_answers(broker: BrokerProcess) -> None:
    topic = unique_name("lr_bad")
    publish(broker, topic, [b"a", b"b", b"c"])
    cases = {
        "/topic/read?offset=0": (400, "MISSING_ARG_TOPIC"),
        "/topic/read?topic=a*b&offset=0": (400, "INVALID_ARG_TOPIC"),
        f"/topic/read?topic={topic}x&offset=0": (404, "TOPIC_NOT_FOUND"),
        f"/topic/read?topic={topic}": (400, "MISSING_ARG_OFFSET"),
        f"/topic/read?topic={topic}&offset=-1": (400, "INVALID_ARG_OFFSET"),
        f"/topic/read?topic={topic}&offset=4": (400, "OFFSET_OUT_OF_RANGE"),
        f"/topic/read?topic={topic}&offset=0&max_messages=0": (400, "INVALID_ARG_MAX_MESSAGES"),
        f"/topic/read?topic={topic}&offset=0&max_bytes=x": (400, "INVALID_ARG_MAX_BYTES"),
        f"/topic/offsets?topic={topic}&ts=soon": (400, "INVALID_ARG_TS"),
    }
    for path, (code, message) in cases.items():
        status, h, body = _get(broker, path)
        assert (status, json.loads(body)) == (code, {"message": message}), path
    status, h, _ = _get(broker, f"/topic/read?topic={topic}&offset=9")
    assert (h["X-Pybroker-Oldest-Offset"], h["X-Pybroker-End-Offset"]) == ("0", "3")
    status, _, body = _get(broker, f"/topic/read?topic={topic}&offset=3")
    assert status == 200 and body == b""        # at the end: nothing yet
    status, _, body = _get(broker, f"/channel/commit?topic={topic}&channel=c&offset=7",
                           "POST")
    assert (status, json.loads(body)) == (400, {"message": "OFFSET_OUT_OF_RANGE"})
    status, _, _ = _get(broker, f"/topic/read?topic={topic}&offset=0", "POST")
    assert status == 405


def test_offset_for_a_time(broker: BrokerProcess) -> None:
    topic = unique_name("lr_ts")
    publish(broker, topic, [b"old"] * 10)
    time.sleep(0.05)
    mark = int(time.time() * 1000)
    time.sleep(0.05)
    publish(broker, topic, [b"new"] * 5)
    with LogClient(broker.http_hostport) as c:
        assert c.offsets(topic, mark).at == 10
        assert c.offsets(topic, 0).at == 0
        assert c.offsets(topic, mark + 3_600_000).at == 15


def test_commit_moves_forward_only_and_lets_retention_delete(make_broker: MakeBroker) -> None:
    b = make_broker("--max-bytes-per-file=4096", "--sync-timeout=100ms")
    topic = unique_name("lr_commit")
    for i in range(0, 400, 20):
        publish(b, topic, [b"%04d" % j + b"y" * 100 for j in range(i, i + 20)])
    seg_dir = Path(b.data_path) / "topics" / topic
    assert len(list(seg_dir.glob("*.log"))) > 5

    def segments() -> int:
        return len(list(seg_dir.glob("*.log")))

    with LogClient(b.http_hostport) as c:
        assert c.commit(topic, "spark", 0) == 0        # a new channel, pinned at 0
        before = segments()
        assert c.commit(topic, "spark", 200) == 200
        assert c.commit(topic, "spark", 150) == 200    # never backwards
        wait_until(lambda: segments() < before, 10, what="segments below 200 deleted")
        oldest = c.offsets(topic).oldest
        assert 0 < oldest <= 200                       # nothing at or above the cursor
        with pytest.raises(OffsetsLost, match=r"no longer in the log"):
            list(c.read(topic, 0, 10, 65536))
        first = next(iter(c.read(topic, oldest, 400, 1 << 20)))
        assert first.first == oldest
    stats = _stats(b, topic)
    assert stats["cursor"] == 200 and stats["client_count"] == 0


def _stats(b: BrokerProcess, topic: str) -> Any:
    _, _, body = _get(b, f"/stats?format=json&topic={topic}&channel=spark")
    return json.loads(body)["topics"][0]["channels"][0]
