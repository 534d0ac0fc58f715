#!/usr/bin/env python3
"""The topic log's hot paths, without a network: where the C codec pays.

    python loadtest/bench_log.py [--runs 3] [--records 1000000] [--size 200]

1. Appending: ``records`` bodies of ``size`` bytes appended and written in batches of 1,
   100 and 2,500 (records/s).
2. Reading and framing: the same records read back in batches of 2,500 and turned into
   NSQ message frames, from the memory tail and from the segment files (records/s).
3. Framing alone, C (``nsqf_log_frames``) against Python (struct + ``b"".join``) for
   batches of 1, 10, 100 and 2,500 records: where the C call pays for its boundary.

Prints medians over ``--runs`` (min-max).
"""
from __future__ import annotations

import argparse
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pybroker import _native  # noqa: E402
from pybroker._native import _pure  # noqa: E402
from pybroker.storage.topiclog import TopicLog  # noqa: E402

TS = 1_700_000_000 * 10**9


def timed(fn: Callable[[], int]) -> float:
    t0 = time.perf_counter()
    n = fn()
    return n / (time.perf_counter() - t0)


def append(records: int, size: int, batch: int, mem: int) -> tuple[TopicLog, float]:
    d = tempfile.mkdtemp(prefix="bench-log-")
    log = TopicLog(d, max_bytes_per_file=100 << 20, mem_records=mem, max_record_bytes=size + 64)
    body = b"x" * size
    bodies = [body] * batch

    def run() -> int:
        for _ in range(records // batch):
            with log.lock:
                log.append(bodies, TS)
                log.write_pending()
        return records // batch * batch

    return log, timed(run)


def read_frames(log: TopicLog) -> float:
    def run() -> int:
        off, n = log.oldest, 0
        while off < log.written:
            b = log.read(off, 2500, 4 << 20)
            b.frames(0, b.n)
            off = b.first + b.n
            n += b.n
        return n

    return timed(run)


def py_frames(buf: bytes, pos: list[int]) -> bytes:
    """What framing costs in Python: a struct pack and a slice per record, one join."""
    head = struct.Struct(">ii")
    out = []
    for p in pos:
        plen = int.from_bytes(buf[p + 4:p + 8], "big")
        msg = buf[p + 24:p + 16 + plen]
        out.append(head.pack(len(msg) + 4, 2))
        out.append(msg[:8] + (1).to_bytes(2, "big") + msg[10:])
    return b"".join(out)


def frames_only(n: int, size: int, impl: str) -> float:
    recs, pos = _pure.log_build(0, TS, 0, b"x" * size * n, [i * size for i in range(n)],
                                [size] * n)
    reps = max(1, 200_000 // n)
    if impl == "c":
        return timed(lambda: sum(len(_native.log_frames(recs, pos, -1)) > 0 for _ in range(reps))
                     * n)
    return timed(lambda: sum(len(py_frames(recs, list(pos))) > 0 for _ in range(reps)) * n)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--records", type=int, default=1_000_000)
    p.add_argument("--size", type=int, default=200)
    a = p.parse_args()
    rows: dict[str, list[float]] = {}
    for _ in range(a.runs):
        for batch in (1, 100, 2500):
            n = a.records if batch > 1 else a.records // 10
            log, rate = append(n, a.size, batch, a.records)
            rows.setdefault(f"append, batches of {batch}", []).append(rate)
            if batch == 100:
                rows.setdefault("read + frames, memory tail", []).append(read_frames(log))
                log.close()
                cold = TopicLog(log.directory, max_bytes_per_file=100 << 20, mem_records=0,
                                max_record_bytes=a.size + 64)
                rows.setdefault("read + frames, segment files", []).append(read_frames(cold))
                cold.delete()
            else:
                log.delete()
        if _native.BACKEND == "c":
            for n in (1, 10, 100, 2500):
                rows.setdefault(f"frames of {n}: C", []).append(frames_only(n, a.size, "c"))
                rows.setdefault(f"frames of {n}: Python", []).append(
                    frames_only(n, a.size, "py"))
    print(f"records/s, median of {a.runs} (min-max), {a.size}-byte bodies, "
          f"codec: {_native.BACKEND}")
    for name, vals in rows.items():
        print(f"  {name:32s} {statistics.median(vals):>12,.0f}  "
              f"({min(vals):,.0f}-{max(vals):,.0f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
