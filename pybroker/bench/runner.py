"""The comparison runner: scenarios x brokers x runs, alternating, then medians and ratios.

Owns the order of a bench invocation. For every run and every scenario, each broker is
started fresh (its own temporary data directory, so no backlog or peak RSS carries over),
measured and stopped, before the next broker takes its turn; the order of the brokers
flips on every other run so neither always goes first. The result is one JSON-ready dict.
"""
from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from pybroker.bench.brokers import Broker, BrokerProcess, ExternalBroker, nsqd_version
from pybroker.bench.results import BenchResult, Figure, Figures, MachineInfo, Summary, number
from pybroker.bench.scenarios import RUNNERS, BenchConfig
from pybroker.bench.stats import median, ratio

# figures compared pybroker/nsqd; "lower" ones are better when smaller
HIGHER_BETTER = ("pub_msgs_s", "pub_mb_s", "sub_msgs_s", "sub_mb_s", "rate_achieved")
LOWER_BETTER = ("e2e_p50_ms", "e2e_p99_ms", "e2e_p99.9_ms", "e2e_max_ms", "bytes_per_msg",
                "rss_growth", "rss_after", "peak_rss", "pub_req_p50_ms", "pub_req_p99_ms")


@dataclass
class Target:
    """A broker to measure: started per scenario (``make``) or already running."""

    name: str
    make: Callable[[list[str]], Broker]
    description: str = ""
    extra: dict[str, str] = field(default_factory=dict)


def pybroker_target(args: list[str], env: dict[str, str] | None = None) -> Target:
    return Target("pybroker", lambda more: BrokerProcess("pybroker", args + more, env=env),
                  "pybroker (python -m pybroker serve)")


def nsqd_target(path: str, args: list[str]) -> Target:
    return Target("nsqd", lambda more: BrokerProcess("nsqd", args + more, nsqd_path=path),
                  nsqd_version(path) or path, {"path": path})


def external_target(name: str, tcp: str, http: str = "", pid: int | None = None) -> Target:
    return Target(name, lambda more: ExternalBroker(name, tcp, http, pid), f"{name} at {tcp}")


def scenario_args(scenario: str, cfg: BenchConfig) -> list[str]:
    """Broker flags a scenario needs, the same for pybroker and nsqd."""
    if scenario == "memory":
        # every queued message must stay in memory for the RSS figure to mean anything
        return [f"--mem-queue-size={cfg.memory_messages + 10_000}"]
    return []


def machine_info() -> MachineInfo:
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = 0
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    commit = ""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=5, check=False,
                                cwd=Path(__file__).resolve().parents[2]).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_bytes": mem,
            "kernel": platform.release(), "python": sys.version.split()[0],
            "platform": platform.platform(), "pybroker_commit": commit,
            "loadavg_at_start": os.getloadavg()}


def run_bench(targets: list[Target], scenarios: list[str], cfg: BenchConfig, runs: int,
              log: Callable[[str], None] = print) -> BenchResult:
    """Run every scenario ``runs`` times on every target; figures, medians and ratios."""
    records: list[Figures] = []
    tag = uuid.uuid4().hex[:8]
    for run in range(1, runs + 1):
        order = targets if run % 2 else list(reversed(targets))
        for scenario in scenarios:
            for target in order:
                topic = f"bench_{scenario}_{tag}_{run}_{target.name}"
                rec: Figures = {"broker": target.name, "scenario": scenario, "run": run}
                broker = target.make(scenario_args(scenario, cfg))
                t0 = time.monotonic()
                try:
                    broker.start()
                    rec.update(RUNNERS[scenario](broker, cfg, topic))
                    rec["peak_rss"] = broker.peak_rss()
                except Exception as e:  # noqa: BLE001 - recorded, and the bench goes on
                    rec["error"] = f"{type(e).__name__}: {e}"
                finally:
                    if not broker.drop_topic(topic):
                        log(f"[bench] note: topic {topic} is left on {target.name}"
                            " (give --http-address to delete it)")
                    code = broker.stop()
                    if code not in (0, None) and "error" not in rec:
                        rec["error"] = f"{target.name} exited with status {code}"
                rec["wall_s"] = time.monotonic() - t0
                rec["loadavg_1m"] = os.getloadavg()[0]
                records.append(rec)
                log(format_record(rec, cfg))
    return {"machine": machine_info(), "config": cfg.as_dict(), "runs": runs,
            "scenarios": scenarios,
            "brokers": {t.name: {"description": t.description, **t.extra} for t in targets},
            "records": records, "summary": summarize(records, [t.name for t in targets])}


def summarize(records: list[Figures], names: list[str]) -> Summary:
    """Per scenario: each broker's median of each numeric figure, and pybroker/nsqd."""
    out: Summary = {}
    for scenario in dict.fromkeys(str(r["scenario"]) for r in records):
        entry: dict[str, dict[str, float | None]] = {}
        for name in names:
            recs = [r for r in records if r["scenario"] == scenario and r["broker"] == name
                    and "error" not in r]
            keys = dict.fromkeys(k for r in recs for k, v in r.items()
                                 if isinstance(v, (int, float)) and not isinstance(v, bool)
                                 and k != "run")
            entry[name] = {k: median(number(r.get(k)) for r in recs) for k in keys}
            entry[name]["ok_runs"] = len(recs)
        if "pybroker" in entry and "nsqd" in entry:
            entry["ratio"] = paired_ratios([r for r in records if r["scenario"] == scenario])
        out[scenario] = entry
    return out


def paired_ratios(records: list[Figures]) -> dict[str, float | None]:
    """pybroker/nsqd per figure: the median over runs of each run's ratio.

    The two brokers of one run are measured back to back, so pairing them cancels most
    of the drift in what else the machine is doing between runs.
    """
    by_run: dict[Figure, dict[Figure, Figures]] = {}
    for r in records:
        if "error" not in r:
            by_run.setdefault(r["run"], {})[r["broker"]] = r
    out: dict[str, float | None] = {}
    for k in (*HIGHER_BETTER, *LOWER_BETTER):
        rs = [ratio(number(pair["pybroker"].get(k)), number(pair["nsqd"].get(k)))
              for pair in by_run.values()
              if "pybroker" in pair and "nsqd" in pair]
        m = median(rs)
        if m is not None:
            out[k] = m
    return out


def format_record(rec: Figures, cfg: BenchConfig) -> str:
    """One line per measurement, in the spirit of bench_writer's output."""
    head = f"[bench] run {rec['run']} {rec['scenario']:<7} {rec['broker']:<8}"
    if "error" in rec:
        return f"{head} ERROR {rec['error']}"
    parts = []
    for p in ("pub_", "sub_"):
        if f"{p}msgs_s" in rec:
            parts.append(f"{p[:-1]} {rec[p + 'msgs_s']:,.0f} msgs/s {rec[p + 'mb_s']:.2f} MB/s")
    if "e2e_p99_ms" in rec and rec["e2e_p99_ms"] is not None:
        parts.append(f"at {rec['rate_achieved']:,.0f} msgs/s e2e p50 {rec['e2e_p50_ms']:.3f}"
                     f" p99 {rec['e2e_p99_ms']:.3f} p99.9 {rec['e2e_p99.9_ms']:.3f} ms"
                     f" lost {rec['lost']}")
    if "bytes_per_msg" in rec:
        parts.append(f"{rec['messages']:,} x {rec['body_size']} B queued: RSS +"
                     f"{(number(rec['rss_growth']) or 0) / 2**20:,.1f} MiB = {rec['bytes_per_msg']:.0f} B/msg"
                     + (f", drained {rec['drained']:,}" if "drained" in rec else ""))
    parts.append(f"peak RSS {(number(rec.get('peak_rss')) or 0) / 2**20:,.1f} MiB"
                 f" cpu {rec.get('broker_cpu_pct', 0):.0f}%")
    return f"{head} " + " - ".join(parts)
