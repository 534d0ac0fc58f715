"""Lookups by time on a real broker: a 100 MiB segment, 8 clients looking up times near
its end (``GET /topic/offsets?ts=``, ``POST /channel/rewind?ts=``) without pause, and
``/ping`` answering meanwhile as fast as on an idle broker (each lookup used to scan the
segment on the HTTP thread for 230-550 ms). The bound here is generous (a loaded test
machine); loadtest/bench_time_lookup.py measures the figure. Answers are checked against
the records' own timestamps read back with /topic/read.
"""
from __future__ import annotations

import http.client
import json
import statistics
import struct
import threading
import time
import urllib.parse
from collections.abc import Callable

import pytest

from tests.support.broker import BrokerProcess, unique_name

pytestmark = pytest.mark.timeout(300)
MS = 1_000_000
SEGMENT = 100 * 1024 * 1024


def request(conn: http.client.HTTPConnection, method: str, path: str,
            **query: object) -> tuple[int, bytes, http.client.HTTPResponse]:
    conn.request(method, f"{path}?{urllib.parse.urlencode(query)}")
    r = conn.getresponse()
    return r.status, r.read(), r


def ts_at(conn: http.client.HTTPConnection, topic: str, offset: int) -> int:
    status, body, _ = request(conn, "GET", "/topic/read", topic=topic, offset=offset,
                              max_messages=1)
    assert status == 200 and body
    return int(struct.unpack_from(">q", body, 16 + 8)[0])   # [hdr 16][deliver_at][ts]


def test_ping_stays_fast_while_8_clients_look_up_times(
        make_broker: Callable[..., BrokerProcess]) -> None:
    b = make_broker(f"--max-bytes-per-file={SEGMENT + (8 << 20)}")
    host, port = b.http_hostport.rsplit(":", 1)
    topic = unique_name()
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = b"\n".join(b"%07d" % i + b"y" * 1017 for i in range(4000))   # ~4 MiB
    for _ in range(25):                     # 25 x 4,000 records of 1 KiB: ~100 MiB
        conn.request("POST", f"/mpub?topic={topic}", body=body)
        r = conn.getresponse()
        assert (r.status, r.read()) == (200, b"OK")
        time.sleep(0.002)                   # each MPUB its own millisecond
    status, raw, _ = request(conn, "GET", "/topic/offsets", topic=topic)
    info = json.loads(raw)
    assert info["end_offset"] == 100_000
    first_ts, last_ts = ts_at(conn, topic, 0), ts_at(conn, topic, 99_999)
    assert last_ts - first_ts > 0
    # times near the end of the segment (the worst case of a scan)
    queries = [last_ts - (last_ts - first_ts) * k // 40 for k in range(1, 9)]

    stop = threading.Event()
    errors: list[str] = []
    done = [0]

    def looker(i: int) -> None:
        c = http.client.HTTPConnection(host, int(port), timeout=30)
        ms = queries[i] // MS
        while not stop.is_set():
            if i % 2:
                status, raw, _ = request(c, "POST", "/channel/rewind", topic=topic,
                                         channel=f"c{i}", ts=ms)
            else:
                status, raw, _ = request(c, "GET", "/topic/offsets", topic=topic, ts=ms)
            if status != 200:
                errors.append(f"{status} {raw!r}")
                return
            done[0] += 1
        c.close()

    for i in range(1, 8, 2):                # the rewinds need their channels
        assert request(conn, "POST", "/channel/create", topic=topic, channel=f"c{i}")[0] == 200
    threads = [threading.Thread(target=looker, args=(i,), daemon=True) for i in range(8)]
    for t in threads:
        t.start()
    ping = http.client.HTTPConnection(host, int(port), timeout=30)
    lat = []
    try:
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            status, text, _ = request(ping, "GET", "/ping")
            lat.append(time.perf_counter() - t0)
            assert (status, text) == (200, b"OK")
            time.sleep(0.005)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not errors, errors[:3]
    lat.sort()
    p50, p99 = statistics.median(lat), lat[int(len(lat) * 0.99) - 1]
    assert p50 <= 0.020 and p99 <= 0.100, (p50, p99, lat[-1])
    assert done[0] >= 80, done[0]           # the lookups did run meanwhile
    # and the answers are exact: the first record at or after the time
    for q in queries:
        status, raw, _ = request(conn, "GET", "/topic/offsets", topic=topic, ts=q // MS)
        off = json.loads(raw)["offset"]
        t_ms = q // MS * MS
        assert ts_at(conn, topic, off) >= t_ms
        assert off == 0 or ts_at(conn, topic, off - 1) < t_ms
