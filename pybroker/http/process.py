"""Process figures: nsqd's ``memory`` block of /stats (Go runtime names, filled with the
nearest CPython figures) and the standard Prometheus ``process_*`` values.

Reads /proc (Linux); on other systems the figures that need it are 0. GC pauses are
timed by a ``gc.callbacks`` hook installed once per process (``GcPauses.install``),
keeping the last 256 like Go's MemStats.PauseNs.
"""
from __future__ import annotations

import gc
import math
import os
import sys
import threading
import time
from collections import deque
from typing import ClassVar

try:
    import resource
except ImportError:  # pragma: no cover - not on Linux
    resource = None  # type: ignore[assignment]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class GcPauses:
    """Durations of the last 256 garbage collections, in nanoseconds."""

    _installed = False
    # between the thread a collection runs on (gc callbacks) and http reading the ring
    _lock = threading.Lock()
    pauses: ClassVar[deque[int]] = deque(maxlen=256)
    _start = 0

    @classmethod
    def install(cls) -> None:
        with cls._lock:
            if not cls._installed:
                gc.callbacks.append(cls._callback)
                cls._installed = True

    @classmethod
    def _callback(cls, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            cls._start = time.perf_counter_ns()
        elif cls._start:
            cls.pauses.append(time.perf_counter_ns() - cls._start)
            cls._start = 0


def _percentile(perc: float, ordered: list[int]) -> int:
    """nsqd's percentile(): index floor(perc/100 * n + 0.5), clamped."""
    n = len(ordered)
    if n == 0:
        return 0
    i = math.floor(perc / 100.0 * n + 0.5)
    return ordered[min(i, n - 1)]


def _statm() -> tuple[int, int]:
    """(virtual, resident) bytes."""
    try:
        with open("/proc/self/statm", "rb") as f:
            fields = f.read().split()
        return int(fields[0]) * _PAGE, int(fields[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0, 0


def gc_runs() -> int:
    return sum(s.get("collections", 0) for s in gc.get_stats())


def memory_stats() -> dict[str, int]:
    """nsqd's memStats, with the same names and integer types."""
    pauses = sorted(GcPauses.pauses)
    _, rss = _statm()
    return {
        "heap_objects": sys.getallocatedblocks(),
        "heap_idle_bytes": 0,
        "heap_in_use_bytes": rss,
        "heap_released_bytes": 0,
        "gc_pause_usec_100": _percentile(100.0, pauses) // 1000,
        "gc_pause_usec_99": _percentile(99.0, pauses) // 1000,
        "gc_pause_usec_95": _percentile(95.0, pauses) // 1000,
        "next_gc_bytes": 0,
        "gc_total_runs": gc_runs(),
    }


def _boot_time() -> float:
    try:
        with open("/proc/stat", "rb") as f:
            for line in f:
                if line.startswith(b"btime "):
                    return float(line.split()[1])
    except OSError:
        pass
    return 0.0


def process_figures() -> dict[str, float]:
    """The Prometheus client's standard process metrics (without the ``process_`` prefix)."""
    vms, rss = _statm()
    out: dict[str, float] = {"virtual_memory_bytes": vms, "resident_memory_bytes": rss}
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        fields = stat[stat.rindex(b")") + 2:].split()
        # fields[0] is field 3 (state) of proc(5)
        out["cpu_seconds_total"] = (int(fields[11]) + int(fields[12])) / _TICKS
        out["threads"] = int(fields[17])
        out["start_time_seconds"] = _boot_time() + int(fields[19]) / _TICKS
    except (OSError, ValueError, IndexError):
        t = os.times()
        out["cpu_seconds_total"] = t.user + t.system
        out["threads"] = threading.active_count()
    try:
        out["open_fds"] = len(os.listdir("/proc/self/fd"))
    except OSError:
        pass
    if resource is not None:
        out["max_fds"] = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return out
