"""Reports of a bench run: the human-readable table (Markdown), the JSON file, the plot."""
from __future__ import annotations

import json
from pathlib import Path
from pybroker.bench.results import BenchResult, Summary, number
from pybroker.bench.stats import human_bytes

# (scenario, figure key, label, format); "bytes" figures are shown as sizes
ROWS: list[tuple[str, str, str, str]] = [
    ("pub", "pub_msgs_s", "publish msgs/s", ",.0f"),
    ("pub", "pub_mb_s", "publish MB/s", ".1f"),
    ("pub", "pub_req_p99_ms", "MPUB round trip p99 ms", ".2f"),
    ("pub", "peak_rss", "peak RSS", "bytes"),
    ("sub", "sub_msgs_s", "consume msgs/s", ",.0f"),
    ("sub", "sub_mb_s", "consume MB/s", ".1f"),
    ("sub", "peak_rss", "peak RSS", "bytes"),
    ("pubsub", "pub_msgs_s", "publish msgs/s", ",.0f"),
    ("pubsub", "sub_msgs_s", "consume msgs/s", ",.0f"),
    ("pubsub", "peak_rss", "peak RSS", "bytes"),
    ("latency", "rate_achieved", "publish rate msgs/s", ",.0f"),
    ("latency", "e2e_p50_ms", "end-to-end p50 ms", ".3f"),
    ("latency", "e2e_p99_ms", "end-to-end p99 ms", ".3f"),
    ("latency", "e2e_p99.9_ms", "end-to-end p99.9 ms", ".3f"),
    ("latency", "lost", "messages lost", ",.0f"),
    ("latency", "peak_rss", "peak RSS", "bytes"),
    ("memory", "messages", "messages queued", ",.0f"),
    ("memory", "rss_after", "RSS with them queued", "bytes"),
    ("memory", "rss_growth", "RSS growth", "bytes"),
    ("memory", "bytes_per_msg", "bytes per message", ",.0f"),
    ("memory", "peak_rss", "peak RSS", "bytes"),
]


def _fmt(value: float | None, fmt: str) -> str:
    if value is None:
        return "-"
    if fmt == "bytes":
        return human_bytes(float(value))
    return format(value, fmt)


def table(result: BenchResult) -> str:
    """Medians per scenario and broker, with pybroker/nsqd when both ran (Markdown)."""
    summary = result["summary"]
    names = list(result["brokers"])
    both = "pybroker" in names and "nsqd" in names
    head = ["scenario", "figure", *names] + (["pybroker/nsqd"] if both else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for scenario, key, label, fmt in ROWS:
        entry = summary.get(scenario)
        if not entry or all(entry.get(n, {}).get(key) is None for n in names):
            continue
        cells = [scenario, label] + [_fmt(entry.get(n, {}).get(key), fmt) for n in names]
        if both:
            r = entry.get("ratio", {}).get(key)
            cells.append("-" if r is None else f"{r:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    runs = result["runs"]
    counts = sorted({int(e[n]["ok_runs"] or 0) for e in summary.values() for n in names
                     if n in e})
    lines.append("")
    lines.append(f"Medians of {runs} run(s) per scenario and broker"
                 + ("" if counts == [runs] else f" (successful runs: {counts})") + "."
                 + (" pybroker/nsqd: the median of the runs' ratios (the two brokers of a"
                    " run are measured back to back)." if both else ""))
    if both:
        checks = [f"{label} {r:.2f}x nsqd ({op} {goal}x: {'met' if ok else 'NOT met'})"
                  for label, r, op, goal, ok in targets(summary)]
        if checks:
            lines.append("Targets: " + "; ".join(checks) + ".")
    return "\n".join(lines)


# the project's targets: (label, scenario, figure, higher is better, goal ratio)
TARGETS = [("publish", "pub", "pub_msgs_s", True, 0.5),
           ("consume", "sub", "sub_msgs_s", True, 0.5),
           ("p99 latency", "latency", "e2e_p99_ms", False, 2.0)]


def targets(summary: Summary) -> list[tuple[str, float, str, float, bool]]:
    """Each target whose ratio was measured: (label, ratio, ">="/"<=", goal, met)."""
    out = []
    for label, scenario, key, higher, goal in TARGETS:
        r = summary.get(scenario, {}).get("ratio", {}).get(key)
        if r is not None:
            out.append((label, r, ">=" if higher else "<=", goal,
                        r >= goal if higher else r <= goal))
    return out


def settings_line(result: BenchResult) -> str:
    c, m = result["config"], result["machine"]
    return (f"{m['cores']} cores ({m['cpu'] or 'unknown CPU'}), "
            f"{m['memory_bytes'] / 2**30:.0f} GiB, Linux {m['kernel']}, Python {m['python']}; "
            f"{c['size']} B messages, MPUB batch {c['batch']}, {c['connections']} connection(s)"
            f" per role, {c['duration_s']:g}s per scenario, latency at {c['rate']:,.0f} msgs/s,"
            f" memory {c['memory_messages']:,} x {c['memory_size']} B")


def write_json(result: BenchResult, path: str | Path) -> None:
    Path(path).write_text(json.dumps(result, indent=2, default=str) + "\n")


def _spread(result: BenchResult, name: str, keys: list[tuple[str, str]],
            medians: list[float], scale: float) -> tuple[list[float], list[float]]:
    """Distances from each median down to the runs' minimum and up to their maximum."""
    lo, hi = [], []
    for (scenario, key), mid in zip(keys, medians):
        vals = [v / scale for r in result["records"] if r["broker"] == name
                and r["scenario"] == scenario and (v := number(r.get(key))) is not None]
        lo.append(mid - min(vals) if vals else 0.0)
        hi.append(max(vals) - mid if vals else 0.0)
    return lo, hi


def write_plot(result: BenchResult, path: str | Path) -> None:
    """Throughput bars, latency percentile bars and latency over time (matplotlib PNG)."""
    try:
        import matplotlib
    except ImportError as e:
        raise RuntimeError("--plot needs matplotlib (pip install matplotlib)") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["brokers"])
    summary = result["summary"]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 5))
    groups = [(s, k, label) for s, k, label in
              (("pub", "pub_msgs_s", "pub"), ("sub", "sub_msgs_s", "sub"),
               ("pubsub", "pub_msgs_s", "pubsub\n(publish)"),
               ("pubsub", "sub_msgs_s", "pubsub\n(consume)")) if s in summary]
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        vals = [(summary[s].get(name, {}).get(k) or 0) / 1000 for s, k, _ in groups]
        lo, hi = _spread(result, name, [(s, k) for s, k, _ in groups], vals, 1000)
        ax1.bar([g + i * width for g in range(len(groups))], vals, width, label=name,
                yerr=[lo, hi], capsize=3)
    ax1.set_xticks([g + width * (len(names) - 1) / 2 for g in range(len(groups))])
    ax1.set_xticklabels([label for _, _, label in groups])
    ax1.set_ylabel("thousand messages / s (median)")
    ax1.set_title("Throughput (bars: median, whiskers: min-max of runs)")
    ax1.legend()
    pcts = ["e2e_p50_ms", "e2e_p99_ms", "e2e_p99.9_ms"]
    lat = summary.get("latency", {})
    for i, name in enumerate(names):
        vals = [lat.get(name, {}).get(k) or 0 for k in pcts]
        lo, hi = _spread(result, name, [("latency", k) for k in pcts], vals, 1)
        ax2.bar([g + i * width for g in range(len(pcts))], vals, width, label=name,
                yerr=[lo, hi], capsize=3)
    ax2.set_yscale("log")
    ax2.set_xticks([g + width * (len(names) - 1) / 2 for g in range(len(pcts))])
    ax2.set_xticklabels(["p50", "p99", "p99.9"])
    ax2.set_ylabel("ms, publish to receipt (median of runs)")
    ax2.set_title(f"Latency at {result['config']['rate']:,.0f} msgs/s")
    ax2.legend()
    for name in names:
        recs = [r for r in result["records"] if r["broker"] == name
                and r["scenario"] == "latency" and r.get("samples")]
        if recs:
            samples = recs[-1]["samples"]
            assert isinstance(samples, list)
            xs, ys = zip(*samples)
            ax3.plot(xs, ys, ".", markersize=2, label=f"{name} (run {recs[-1]['run']})")
    ax3.set_yscale("log")
    ax3.set_xlabel("s since start")
    ax3.set_ylabel("ms, publish to receipt")
    ax3.set_title("Latency over time")
    ax3.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
