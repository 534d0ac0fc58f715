"""Load processes: publishers and consumers, one connection each, on raw sockets.

Owns the hot loops, modelled on nsq's bench_writer and bench_reader: a publisher sends a
prebuilt PUB/MPUB and waits for its OK (``depth`` of them in flight); a consumer sets RDY
once and answers every read's messages with one buffer of FINs. The paced publisher and
the latency consumer stamp each body with CLOCK_MONOTONIC (shared by all processes on
Linux) to measure publish-to-receipt time. Each worker connects, reports ready, waits for
the common start instant, runs until the common end instant and puts one result dict.
"""
from __future__ import annotations

import time
from array import array
from collections.abc import Callable

from pybroker.bench.results import Go, Ready, Results, StartAt, WorkerResult
from pybroker.bench.stats import percentiles
from pybroker.bench.wire import (
    NsqConn,
    body_stamp,
    fin_cmds,
    publish_cmd,
    rdy_cmd,
    stamped_body,
)

monotonic = time.monotonic
monotonic_ns = time.monotonic_ns


def _wait_start(ready: Ready, go: Go, start_at: StartAt, idx: int) -> float:
    ready.put(idx)
    if not go.wait(120):
        raise TimeoutError("no start signal")
    start = float(start_at.value)
    delay = start - monotonic()
    if delay > 0:
        time.sleep(delay)
    return start


def _guard(fn: Callable[..., WorkerResult], results: Results, idx: int,
           kw: dict[str, object]) -> None:
    try:
        out = fn(idx=idx, **kw)
    except BaseException as e:  # noqa: BLE001 - any failure is reported to the parent
        out = {"error": f"{type(e).__name__}: {e}"}
    out["idx"] = idx
    results.put(out)


def publisher(idx: int, address: str, topic: str, size: int, batch: int, duration_s: float,
              depth: int, ready: Ready, go: Go, start_at: StartAt) -> WorkerResult:
    """Publish one prebuilt batch again and again until the end instant (bench_writer)."""
    conn = NsqConn(address, client_id=f"writer{idx}")
    cmd = publish_cmd(topic, [b"x" * size] * batch)
    start = _wait_start(ready, go, start_at, idx)
    end = start + duration_s
    count = 0
    sent_at: list[float] = []
    req_ms = array("d")
    while True:
        while len(sent_at) < depth:
            sent_at.append(monotonic())
            conn.send(cmd)
        conn.expect_ok("PUB" if batch == 1 else "MPUB")
        now = monotonic()
        req_ms.append((now - sent_at.pop(0)) * 1000.0)
        count += batch
        if now >= end:
            break
    stop = monotonic()
    while sent_at:          # messages already sent count when acknowledged
        conn.expect_ok("MPUB")
        sent_at.pop(0)
        count += batch
    conn.close()
    return {"count": count, "elapsed_s": stop - start, "requests": len(req_ms),
            "req_ms": percentiles(req_ms, (50, 99))}


def consumer(idx: int, address: str, topic: str, channel: str, rdy: int, duration_s: float,
             idle_s: float, ready: Ready, go: Go, start_at: StartAt, latency: bool = False,
             warmup_s: float = 0.0, identify: dict[str, str | int | bool] | None = None,
             samples: int = 0) -> WorkerResult:
    """Receive and FIN until the end instant, or until ``idle_s`` passes with nothing.

    With ``latency``, also collect each body's publish-to-receipt time (bodies published
    at least ``warmup_s`` after the start) and stop only once the stream dries up.
    """
    conn = NsqConn(address, 10.0, f"reader{idx}", **(identify or {}))
    conn.subscribe(topic, channel)
    start = _wait_start(ready, go, start_at, idx)
    conn.send(rdy_cmd(rdy))
    end = start + duration_s
    warm_ns = int((start + warmup_s) * 1e9)
    count = 0
    first = last = 0.0
    lat_ns = array("q")
    stamps = array("q")
    now_ns = 0

    def on_message(buf: bytes, pos: int) -> None:
        sent = body_stamp(buf, pos)
        if sent >= warm_ns:
            lat_ns.append(now_ns - sent)
            stamps.append(sent)

    hook = on_message if latency else None
    while True:
        now = monotonic()
        if now >= end and not latency:
            break
        wait = idle_s if latency and now >= end else min(idle_s, max(end - now, 0.001))
        if not conn.recv_some(wait):
            if monotonic() - (last or start) >= idle_s:
                break           # drained (or the stream has stopped)
            continue
        now_ns = monotonic_ns()
        ids, _ = conn.scan(hook)
        if ids:
            last = now_ns / 1e9
            if not count:
                first = last
            count += len(ids)
            conn.send(fin_cmds(ids))
    conn.close()
    out: WorkerResult = {"count": count, "start": start, "first": first, "last": last,
                           "elapsed_s": min(monotonic(), end) - start}
    if latency:
        out["latency_ms"] = {k: v / 1e6 for k, v in
                             percentiles(lat_ns, (50, 99, 99.9, 100)).items()}
        out["measured"] = len(lat_ns)
        if samples and len(lat_ns):
            step = max(1, len(lat_ns) // samples)
            out["samples"] = [((stamps[i] / 1e9) - start, lat_ns[i] / 1e6)
                              for i in range(0, len(lat_ns), step)]
    return out


def paced_publisher(idx: int, address: str, topic: str, size: int, rate: float, batch: int,
                    duration_s: float, ready: Ready, go: Go, start_at: StartAt) -> WorkerResult:
    """Publish ``rate`` stamped messages a second, ``batch`` per command, pipelined."""
    conn = NsqConn(address, client_id=f"paced{idx}")
    start = _wait_start(ready, go, start_at, idx)
    end = start + duration_s
    sent = oks = commands = 0
    while True:
        now = monotonic()
        if now >= end:
            break
        due = (int((now - start) * rate) - sent) // batch
        if due > 0:
            body = stamped_body(size, monotonic_ns())
            cmd = publish_cmd(topic, [body] * batch)
            conn.send(cmd * due)
            sent += due * batch
            commands += due
        while conn.recv_nowait():
            pass
        oks += conn.scan()[1]
        pause = start + (sent + batch) / rate - monotonic()
        if pause > 0:
            time.sleep(pause)
    deadline = monotonic() + 10
    while oks < commands and monotonic() < deadline:
        conn.recv_some(1.0)
        oks += conn.scan()[1]
    conn.close()
    return {"count": sent, "acked": oks * batch, "elapsed_s": duration_s}
