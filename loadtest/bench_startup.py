#!/usr/bin/env python3
"""How soon a freshly started broker serves: nsqd, pybroker-nsqd and pybroker serve.

    python loadtest/bench_startup.py [--runs 20] [--nsqd PATH] [--only KIND ...]

What client libraries' test harnesses do before every test: exec the broker with a new
data path and poll until it answers. Each run execs one broker (ephemeral loopback ports,
a new temporary data path, stopped by PID with SIGTERM afterwards) and measures, from
just before the exec:

- **to /ping**: until ``GET /ping`` answers ``200 OK`` (the HTTP port is polled every
  0.5 ms, a refused connection tried again);
- **to PUB OK**: in a second start, until a raw V2 client's first ``PUB`` gets ``OK``;
- **CPU**: the broker's user+system CPU time when /ping answered (/proc/PID/stat).

The kinds run interleaved (nsqd, pybroker-nsqd, pybroker serve, nsqd, ...) so machine
noise hits them alike; medians of ``--runs`` with the min and max are printed. The
package is byte-compiled first (an installed package ships its .pyc files; an editable
checkout under PYTHONDONTWRITEBYTECODE would otherwise compile every module each start).
Targets (issue 28): pybroker-nsqd <= 80 ms and pybroker serve <= 150 ms to /ping.
"""
from __future__ import annotations

import argparse
import compileall
import os
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLK_TCK = os.sysconf("SC_CLK_TCK")
DEADLINE_S = 20.0


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port: int = s.getsockname()[1]
    s.close()
    return port


def commands(nsqd: str) -> dict[str, list[str]]:
    """The three brokers; each takes Go-style "-flag=value" arguments."""
    bindir = Path(sys.executable).parent
    dropin = bindir / "pybroker-nsqd"
    serve = bindir / "pybroker"
    kinds = {
        "nsqd": [nsqd] if nsqd else [],
        "pybroker-nsqd": [str(dropin)] if dropin.exists() else
        [sys.executable, "-m", "pybroker.nsqd_cli"],
        "pybroker serve": [str(serve), "serve"] if serve.exists() else
        [sys.executable, "-m", "pybroker", "serve"],
    }
    return {k: v for k, v in kinds.items() if v}


def cpu_ms(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) * 1000 / CLK_TCK
    except OSError:
        return float("nan")


def ping_once(http: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", http), timeout=2) as s:
            s.sendall(b"GET /ping HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")
            data = b""
            while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"OK"):
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
            return data.startswith(b"HTTP/1.1 200") and data.rstrip().endswith(b"OK")
    except OSError:
        return False


def pub_once(tcp: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", tcp), timeout=2) as s:
            body = b"hello"
            s.sendall(b"  V2" + b"PUB bench_startup\n" + struct.pack(">i", len(body)) + body)
            data = b""
            while len(data) < 10:
                chunk = s.recv(64)
                if not chunk:
                    return False
                data += chunk
            size, ftype = struct.unpack(">ii", data[:8])
            return ftype == 0 and data[8:4 + size] == b"OK"
    except OSError:
        return False


def one_start(cmd: list[str], what: str) -> tuple[float, float]:
    """Exec the broker; (ms until ``what`` answered, broker CPU ms at that moment)."""
    tcp, http = free_port(), free_port()
    data = tempfile.mkdtemp(prefix="bench-startup-")
    argv = [*cmd, f"-tcp-address=127.0.0.1:{tcp}", f"-http-address=127.0.0.1:{http}",
            f"-data-path={data}"]
    probe = ping_once if what == "ping" else pub_once
    port = http if what == "ping" else tcp
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        while not probe(port):
            if proc.poll() is not None:
                raise RuntimeError(f"{' '.join(argv)} exited with {proc.returncode}")
            if time.perf_counter() - t0 > DEADLINE_S:
                raise RuntimeError(f"{' '.join(argv)} did not answer in {DEADLINE_S}s")
            time.sleep(0.0005)
        elapsed = (time.perf_counter() - t0) * 1000
        cpu = cpu_ms(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        shutil.rmtree(data, ignore_errors=True)
    return elapsed, cpu


def fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):7.1f} ({min(xs):6.1f}-{max(xs):6.1f})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--nsqd", default=shutil.which("nsqd") or "",
                   help="nsqd binary to compare with ('' to skip)")
    p.add_argument("--only", action="append", default=[],
                   help="run only this kind (nsqd, pybroker-nsqd, 'pybroker serve')")
    a = p.parse_args()
    compileall.compile_dir(str(ROOT / "pybroker"), quiet=1)
    kinds = commands(a.nsqd)
    if a.only:
        kinds = {k: v for k, v in kinds.items() if k in a.only}
    results: dict[str, dict[str, list[float]]] = {
        k: {"ping": [], "pub": [], "cpu": []} for k in kinds}
    for _ in range(a.runs):
        for kind, cmd in kinds.items():
            ms, cpu = one_start(cmd, "ping")
            results[kind]["ping"].append(ms)
            results[kind]["cpu"].append(cpu)
            results[kind]["pub"].append(one_start(cmd, "pub")[0])
    print(f"start-up, medians of {a.runs} (min-max), ms; {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.2f}")
    print(f"{'broker':16s} {'exec to /ping OK':>24s} {'exec to PUB OK':>24s} "
          f"{'CPU at /ping':>24s}")
    for kind, r in results.items():
        print(f"{kind:16s} {fmt(r['ping']):>24s} {fmt(r['pub']):>24s} {fmt(r['cpu']):>24s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
