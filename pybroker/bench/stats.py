"""Small statistics for the bench: percentiles, medians, ratios, durations, sizes."""
from __future__ import annotations

import math
import re
import statistics
from collections.abc import Iterable, Sequence

_DURATION_RE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """Go-style duration ("10s", "1m30s", "500ms") or plain seconds, in seconds."""
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    pos, total = 0, 0.0
    for m in _DURATION_RE.finditer(text):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNIT_S[m.group(2)]
        pos = m.end()
    if pos != len(text) or not text:
        raise ValueError(f"bad duration {text!r} (use e.g. 10s, 500ms, 1m)")
    return total


def percentiles(values: Sequence[float] | Iterable[float],
                ps: Iterable[float]) -> dict[str, float]:
    """Nearest-rank percentiles keyed "p50", "p99", "p99.9", "p100"; {} when empty."""
    data = sorted(values)
    if not data:
        return {}
    out = {}
    for p in ps:
        rank = max(1, math.ceil(round(p * len(data) / 100.0, 9)))  # 99.9% of 1000 is 999
        out[f"p{p:g}"] = float(data[min(rank, len(data)) - 1])
    return out


def median(values: Iterable[float | None]) -> float | None:
    data = [v for v in values if v is not None]
    return float(statistics.median(data)) if data else None


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
