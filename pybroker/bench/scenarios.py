"""The bench's scenarios: pub, sub, pubsub, latency and memory, against one broker.

Each scenario starts its load processes (multiprocessing, "spawn": no GIL shared with the
parent), releases them at one common instant and turns their results into flat figures
(``msgs_s``, ``mb_s``, ``e2e_p99_ms``, ...). The broker's CPU time and RSS are read from
/proc around the measured interval. Scenarios never start or stop the broker.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pybroker.bench import workers
from pybroker.bench.brokers import Broker
from pybroker.bench.results import Figures, WorkerResult
from pybroker.bench.wire import NsqConn, publish_cmd

MB = 1024 * 1024
SCENARIOS = ("pub", "sub", "pubsub", "latency", "memory")


@dataclass
class BenchConfig:
    """Every knob of a bench run; defaults follow nsq's bench_writer/bench_reader."""

    size: int = 200
    batch: int = 200
    connections: int = field(default_factory=lambda: os.cpu_count() or 1)
    duration_s: float = 10.0
    depth: int = 1                  # MPUBs in flight per publisher (bench_writer: 1)
    rdy: int = 2500
    idle_s: float = 1.0             # a consumer with nothing for this long is drained
    rate: float = 10_000.0          # latency: messages per second
    latency_batch: int = 1          # latency: messages per command (1 = PUB)
    latency_rdy: int = 2500
    obuf_size: int = -1             # latency consumer's output_buffer_size (-1: unbuffered)
    obuf_timeout_ms: int = 0        # latency consumer's output_buffer_timeout (0: default)
    memory_messages: int = 1_000_000
    memory_size: int = 100
    memory_verify: bool = True      # drain the memory scenario's queue and count it
    samples: int = 2000             # latency samples kept for the plot

    def as_dict(self) -> dict[str, int | float | bool]:
        return asdict(self)


Job = tuple[Callable[..., WorkerResult], dict[str, object]]   # a load process and its keywords


class WorkerError(RuntimeError):
    """A load process failed or did not finish."""


def _run(jobs: list[Job], limit_s: float) -> tuple[list[WorkerResult], float]:
    """Run ``jobs`` as processes from one common start; their results (in job order)."""
    ctx = mp.get_context("spawn")
    ready, results = ctx.Queue(), ctx.Queue()
    go = ctx.Event()
    start_at = ctx.Value("d", 0.0)
    procs = []
    for i, (fn, kw) in enumerate(jobs):
        kw = dict(kw, ready=ready, go=go, start_at=start_at)
        p = ctx.Process(target=workers._guard, args=(fn, results, i, kw),
                        name=f"bench-{fn.__name__}-{i}", daemon=True)
        p.start()
        procs.append(p)
    out: dict[int, WorkerResult] = {}
    try:
        waiting = len(jobs)
        deadline = time.monotonic() + 60
        while waiting:
            if not results.empty():     # a worker failed before it was ready
                r = results.get()
                out[r["idx"]] = r
                raise WorkerError(r.get("error", "worker ended early"))
            try:
                ready.get(timeout=0.2)
                waiting -= 1
            except queue.Empty:
                dead = [p.name for p in procs if p.exitcode is not None]
                if dead:
                    raise WorkerError(f"load process(es) {dead} died before starting") from None
                if time.monotonic() > deadline:
                    raise WorkerError("load processes did not get ready within 60s") from None
        start_at.value = time.monotonic() + 0.05
        go.set()
        start = start_at.value
        deadline = time.monotonic() + limit_s + 60
        while len(out) < len(jobs):
            try:
                r = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise WorkerError(
                    f"load processes did not finish within {limit_s + 60:.0f}s") from None
            out[r["idx"]] = r
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()       # by PID: only processes started here
                p.join(5)
    errors = [r["error"] for r in out.values() if "error" in r]
    if errors:
        raise WorkerError("; ".join(errors))
    return [out[i] for i in range(len(jobs))], start


def ensure_channel(address: str, topic: str, channel: str) -> None:
    """Create ``topic`` and ``channel`` (a SUB with RDY 0), so publishes queue for it."""
    with NsqConn(address, client_id="bench-setup") as conn:
        conn.subscribe(topic, channel)


def _rates(count: int, seconds: float, size: int, prefix: str) -> dict[str, float]:
    seconds = max(seconds, 1e-9)
    return {f"{prefix}msgs_s": count / seconds, f"{prefix}mb_s": count * size / seconds / MB}


def _pub_jobs(broker: Broker, cfg: BenchConfig, topic: str) -> list[Job]:
    kw = {"address": broker.tcp_address, "topic": topic, "size": cfg.size, "batch": cfg.batch,
          "duration_s": cfg.duration_s, "depth": cfg.depth}
    return [(workers.publisher, kw) for _ in range(cfg.connections)]


def _sub_jobs(broker: Broker, cfg: BenchConfig, topic: str, channel: str) -> list[Job]:
    kw = {"address": broker.tcp_address, "topic": topic, "channel": channel, "rdy": cfg.rdy,
          "duration_s": cfg.duration_s, "idle_s": cfg.idle_s}
    return [(workers.consumer, kw) for _ in range(cfg.connections)]


def _pub_figures(results: list[WorkerResult], cfg: BenchConfig) -> Figures:
    count = sum(r["count"] for r in results)
    elapsed = max(r["elapsed_s"] for r in results)
    out: Figures = {"pub_messages": count, "pub_elapsed_s": elapsed}
    out.update(_rates(count, elapsed, cfg.size, "pub_"))
    req = [r["req_ms"] for r in results if r["req_ms"]]
    if req:
        out["pub_req_p50_ms"] = max(q["p50"] for q in req)
        out["pub_req_p99_ms"] = max(q["p99"] for q in req)
    return out


def _sub_figures(results: list[WorkerResult], cfg: BenchConfig, start: float) -> Figures:
    count = sum(r["count"] for r in results)
    last = max((r["last"] for r in results if r["count"]), default=start)
    drained = all(r["elapsed_s"] < cfg.duration_s - 1e-3 for r in results)
    # drained early: the rate is over the time until the last message arrived
    elapsed = (last - start) if drained and count else cfg.duration_s
    out: Figures = {"sub_messages": count, "sub_elapsed_s": elapsed, "sub_drained": drained}
    out.update(_rates(count, elapsed, cfg.size, "sub_"))
    return out


def _measured(broker: Broker, body: Callable[[], Figures]) -> Figures:
    cpu0, t0 = broker.cpu_s(), time.monotonic()
    out = body()
    out["broker_cpu_pct"] = 100.0 * (broker.cpu_s() - cpu0) / max(time.monotonic() - t0, 1e-9)
    return out


def run_pub(broker: Broker, cfg: BenchConfig, topic: str) -> Figures:
    """Publishers only (bench_writer): one channel exists, so every message is queued."""
    ensure_channel(broker.tcp_address, topic, "ch")
    return _measured(broker, lambda: _pub_figures(
        _run(_pub_jobs(broker, cfg, topic), cfg.duration_s)[0], cfg))


def run_sub(broker: Broker, cfg: BenchConfig, topic: str) -> Figures:
    """Consumers only (bench_reader), on a channel filled by a pub phase just before."""
    ensure_channel(broker.tcp_address, topic, "ch")
    fill = _pub_figures(_run(_pub_jobs(broker, cfg, topic), cfg.duration_s)[0], cfg)

    def body() -> Figures:
        results, start = _run(_sub_jobs(broker, cfg, topic, "ch"), cfg.duration_s)
        return _sub_figures(results, cfg, start)

    out = _measured(broker, body)
    out["prefilled"] = fill["pub_messages"]
    return out


def run_pubsub(broker: Broker, cfg: BenchConfig, topic: str) -> Figures:
    """Publishers and consumers at once, ``connections`` of each."""
    ensure_channel(broker.tcp_address, topic, "ch")
    jobs = _pub_jobs(broker, cfg, topic) + _sub_jobs(broker, cfg, topic, "ch")

    def body() -> Figures:
        results, _ = _run(jobs, cfg.duration_s)
        n = cfg.connections
        out = _pub_figures(results[:n], cfg)
        sub = results[n:]
        count = sum(r["count"] for r in sub)
        out.update({"sub_messages": count}, **_rates(count, cfg.duration_s, cfg.size, "sub_"))
        return out

    return _measured(broker, body)


def run_latency(broker: Broker, cfg: BenchConfig, topic: str) -> Figures:
    """One paced publisher at ``rate`` msgs/s and one consumer: publish-to-receipt times."""
    ensure_channel(broker.tcp_address, topic, "ch")
    identify: dict[str, str | int | bool] = {}
    if cfg.obuf_size:
        identify["output_buffer_size"] = cfg.obuf_size
    if cfg.obuf_timeout_ms:
        identify["output_buffer_timeout"] = cfg.obuf_timeout_ms
    warmup = min(1.0, cfg.duration_s / 5)
    jobs: list[Job] = [
        (workers.consumer, {"address": broker.tcp_address, "topic": topic, "channel": "ch",
                            "rdy": cfg.latency_rdy, "duration_s": cfg.duration_s,
                            "idle_s": cfg.idle_s, "latency": True, "warmup_s": warmup,
                            "identify": identify, "samples": cfg.samples}),
        (workers.paced_publisher, {"address": broker.tcp_address, "topic": topic,
                                   "size": max(cfg.size, 8), "rate": cfg.rate,
                                   "batch": cfg.latency_batch, "duration_s": cfg.duration_s}),
    ]

    def body() -> Figures:
        (sub, pub), _ = _run(jobs, cfg.duration_s + 15)
        lat = sub.get("latency_ms", {})
        return {"rate_target": cfg.rate, "rate_achieved": pub["count"] / cfg.duration_s,
                "published": pub["count"], "received": sub["count"],
                "lost": pub["count"] - sub["count"], "measured": sub.get("measured", 0),
                "e2e_p50_ms": lat.get("p50"), "e2e_p99_ms": lat.get("p99"),
                "e2e_p99.9_ms": lat.get("p99.9"), "e2e_max_ms": lat.get("p100"),
                "samples": sub.get("samples", [])}

    return _measured(broker, body)


def _settled_rss(broker: Broker, timeout_s: float = 15.0) -> int:
    """RSS once it stops moving (within 0.5% over half a second), or at the deadline."""
    deadline = time.monotonic() + timeout_s
    prev = broker.rss()
    while time.monotonic() < deadline:
        time.sleep(0.5)
        cur = broker.rss()
        if abs(cur - prev) <= prev * 0.005:
            return cur
        prev = cur
    return prev


def run_memory(broker: Broker, cfg: BenchConfig, topic: str) -> Figures:
    """RSS with ``memory_messages`` bodies of ``memory_size`` bytes queued on one channel.

    The broker must keep them all in memory (``--mem-queue-size`` at least that count;
    the runner starts both brokers so). Bytes per message = RSS growth / messages.
    """
    ensure_channel(broker.tcp_address, topic, "ch")
    before = _settled_rss(broker, 3.0)
    n, batch = cfg.memory_messages, min(cfg.batch, cfg.memory_messages) or 1
    t0 = time.monotonic()
    with NsqConn(broker.tcp_address, client_id="bench-memory") as conn:
        cmd = publish_cmd(topic, [b"m" * cfg.memory_size] * batch)
        sent = 0
        while sent + batch <= n:
            conn.request(cmd, "MPUB")
            sent += batch
        if sent < n:
            conn.request(publish_cmd(topic, [b"m" * cfg.memory_size] * (n - sent)), "MPUB")
            sent = n
    fill_s = time.monotonic() - t0
    after = _settled_rss(broker)
    out: Figures = {
        "messages": n, "body_size": cfg.memory_size, "fill_msgs_s": n / max(fill_s, 1e-9),
        "rss_before": before, "rss_after": after, "rss_growth": after - before,
        "bytes_per_msg": (after - before) / n if n else 0.0,
    }
    if cfg.memory_verify:
        drain = BenchConfig(size=cfg.memory_size, connections=1, duration_s=120.0,
                            rdy=cfg.rdy, idle_s=cfg.idle_s)
        results, _ = _run(_sub_jobs(broker, drain, topic, "ch"), drain.duration_s)
        out["drained"] = sum(r["count"] for r in results)
    return out


RUNNERS: dict[str, Callable[[Broker, BenchConfig, str], Figures]] = {
    "pub": run_pub, "sub": run_sub, "pubsub": run_pubsub,
    "latency": run_latency, "memory": run_memory,
}
