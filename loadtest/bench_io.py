#!/usr/bin/env python3
"""CPU per message in the small-batch flows (receiving, reading a backlog from disk),
pybroker beside nsqd in one invocation, with nsq's own bench programs.

    . /work/shared/nsq/env.sh
    python loadtest/bench_io.py [--runs 3] [--seconds 5] [--only SCENARIO ...]
                                [--baseline-src DIR] [--nsqd PATH] [--ceiling]

Every broker is started fresh with its defaults (ephemeral loopback ports, its own
temporary data directory) and stopped by PID; each run alternates the brokers. Beside
each rate: the broker's CPU per message (utime + stime from /proc/PID/stat over the
measured part, divided by the messages of that part). ``--baseline-src DIR`` adds a
second pybroker run from another source tree (a checkout of main, with its C codec
built) to show "no worse than before". ``--ceiling`` adds ``loadtest/null_broker.c``
(kind ``ceiling``, compiled on first use): a one-thread epoll server that answers every
publish OK and keeps subscribed connections at their RDY with one prebuilt message,
storing nothing, with one recv and at most one send per readable connection. No broker
can do less per message, so its rate is what the load generator and this machine allow
for the flow (not for e2e, which needs real messages).

Scenarios:

- ``pub1``: ``GOMAXPROCS=32 bench_writer --batch-size 1``: single-message PUB over 32
  connections.
- ``sync1``: one producer (a raw socket in a thread of this process:
  ``bench_durability.publish_for``) sending a PUB and waiting for its OK before the next, as a web handler publishing per request does: every message is a
  turn of the broker of its own, so this measures a turn's fixed cost.
- ``rdy8`` / ``rdy1``: ``--backlog`` (``--backlog-rdy1``) messages MPUBlished first (a
  backlog far beyond the memory queue: on disk), then 32 consumers read it:
  ``GOMAXPROCS=32 bench_reader --rdy 8``; at RDY 1 ``loadtest/rdy_reader.c`` (compiled
  on first use with ``cc -O2``), because bench_reader flushes its FINs only when
  ``msgCount % rdy > 0.75 * rdy``, never at RDY 1 (it then reads ~10 msg/s from nsqd
  or pybroker alike). A run is marked ``drained`` if the reader emptied the backlog
  early (its rate then counts idle time: give a larger backlog).
- ``bulk``: ``bench_writer`` (MPUB 200, 2 connections) then ``bench_reader`` (RDY
  2500) on what it wrote: the bulk flows of loadtest/bench_topic_log.py.
- ``pubsub``: ``bench_writer`` (MPUB 200) and ``bench_reader`` (RDY 2500) at the same
  time, on a fresh topic: both rates.
- ``e2e``: ``loadtest/e2e_latency.c`` publishes single-message PUBs over 32 connections
  at half of nsqd's single-message maximum (nsqd's ``pub1`` median of this invocation,
  measured first when ``pub1`` is not run; ``--e2e-rate`` sets it) and 4 consumers at
  RDY 1000 (default output buffering, as users get it) FIN each message as read:
  percentiles of publish-to-delivery latency, the first second left out.
- ``client1``: the client library against nsqd at ``max_in_flight`` 1 beside gnsq's
  Consumer (gevent) at 1, on a backlog in nsqd (``--client-backlog``): the consumer
  process's CPU per message. ``pybroker.client`` runs its handler on a handler thread
  (the default), ``pybroker.client inline`` on the loop's thread (``inline=True``), as
  gnsq runs its handler in the reading greenlet. With ``--baseline-src`` the same
  consumer program also runs importing that tree (``baseline.client``).

Prints a table per scenario: medians over ``--runs`` (min-max) and ratios to nsqd
(client1: pybroker.client to gnsq). Figures from a shared machine are indicative only.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "loadtest"))

from bench_durability import build_command, publish_for  # noqa: E402
from bench_topic_log import create_channel, fill  # noqa: E402

from pybroker.bench.brokers import BrokerProcess, proc_cpu_s  # noqa: E402
from pybroker.config import split_hostport  # noqa: E402

RESULT_RE = re.compile(r"duration: ([0-9.]+)(m?s).*?([0-9.]+)ops/s")
TOPIC = "bench_io"
Row = dict[str, float]


def _tool(args: list[str], seconds: float, procs: int | None = None) -> tuple[float, float]:
    """Run one of nsq's bench programs; (messages per second, seconds measured)."""
    env = dict(os.environ)
    if procs:
        env["GOMAXPROCS"] = str(procs)
    out = subprocess.run(args, capture_output=True, text=True, timeout=seconds + 180, env=env)
    m = RESULT_RE.search(out.stderr + out.stdout)
    if out.returncode != 0 or m is None:
        raise RuntimeError(f"{args[0]} failed ({out.returncode}): {out.stderr[-2000:]}")
    dur = float(m.group(1)) / (1000 if m.group(2) == "ms" else 1)
    return float(m.group(3)), dur


def _measured(b: BrokerProcess, run: Callable[[], tuple[float, float]]) -> Row:
    cpu0 = b.cpu_s()
    rate, dur = run()
    cpu = b.cpu_s() - cpu0
    msgs = rate * dur
    return {"msg/s": rate, "us/msg": cpu / msgs * 1e6 if msgs else 0.0}


def _depth(b: BrokerProcess) -> int:
    if not b.http_address:      # the ceiling's null broker: an endless backlog
        return 1
    with urllib.request.urlopen(f"http://{b.http_address}/stats?format=json&topic={TOPIC}",
                                timeout=30) as r:
        doc = json.load(r)
    doc = doc.get("data", doc)
    for t in doc.get("topics", []):
        if t["topic_name"] == TOPIC:
            chans = t.get("channels") or []
            return int(chans[0]["depth"]) if chans else int(t["depth"])
    return 0


def writer(b: BrokerProcess, a: argparse.Namespace, batch: int, procs: int | None) -> Row:
    args = ["bench_writer", f"--nsqd-tcp-address={b.tcp_address}", f"--topic={TOPIC}",
            f"--runfor={a.seconds}s", f"--size={a.size}", f"--batch-size={batch}"]
    return _measured(b, lambda: _tool(args, a.seconds, procs))


def reader(b: BrokerProcess, a: argparse.Namespace, rdy: int, procs: int | None) -> Row:
    args = ["bench_reader", f"--nsqd-tcp-address={b.tcp_address}", f"--topic={TOPIC}",
            "--channel=ch", f"--runfor={a.seconds}s", f"--size={a.size}", f"--rdy={rdy}"]
    row = _measured(b, lambda: _tool(args, a.seconds, procs))
    row["drained"] = float(_depth(b) == 0)
    return row


def scenario_pub1(b: BrokerProcess, a: argparse.Namespace) -> Row:
    return writer(b, a, 1, 32)


def scenario_sync1(b: BrokerProcess, a: argparse.Namespace) -> Row:
    """One producer publishing one message at a time, each after the last one's OK
    (a web handler's publish): every PUB is a turn of the broker's loop of its own."""
    cmd, per = build_command("PUB", TOPIC, a.size, 1)

    def run() -> tuple[float, float]:
        n, dur = publish_for(split_hostport(b.tcp_address), cmd, per, 1, 1, a.seconds)
        return n / dur, dur
    return _measured(b, run)


def rdy_reader_binary(name: str = "rdy_reader") -> str:
    """loadtest/<name>.c compiled (once per source version) with the C compiler."""
    src = ROOT / "loadtest" / f"{name}.c"
    header = ROOT / "loadtest" / "hostport.h"        # included by each program
    digest = hashlib.sha1(src.read_bytes() + header.read_bytes()).hexdigest()[:12]
    out = Path(tempfile.gettempdir()) / f"pybroker-{name}-{digest}"
    if not out.exists():
        cc = os.environ.get("CC", "cc")
        tmp = out.with_suffix(f".{os.getpid()}")
        subprocess.run([cc, "-O2", "-o", str(tmp), str(src)], check=True)
        os.replace(tmp, out)
    return str(out)


class NullBroker:
    """loadtest/null_broker.c as a broker of this benchmark (kind ``ceiling``): the rate a
    flow reaches when the broker costs almost nothing, i.e. what the load generator and
    this machine allow. It has no HTTP API (no depth) and stores nothing."""

    http_address = ""

    def __init__(self, size: int) -> None:
        self.size = size
        self.proc: subprocess.Popen[str] | None = None
        self.tcp_address = ""

    def start(self) -> "NullBroker":
        self.proc = subprocess.Popen([rdy_reader_binary("null_broker"), "127.0.0.1:0",
                                      str(self.size)], stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        m = re.search(r"listening on (\S+)", line)
        if m is None:
            self.stop()
            raise RuntimeError(f"null_broker did not start: {line!r}")
        self.tcp_address = m.group(1)
        return self

    def cpu_s(self) -> float:
        return proc_cpu_s(self.proc.pid) if self.proc is not None else 0.0

    def stop(self) -> int:
        if self.proc is None:
            return 0
        self.proc.kill()
        rc = self.proc.wait(10)
        self.proc = None
        return rc


def fin_reader(b: BrokerProcess, a: argparse.Namespace, rdy: int, conns: int) -> Row:
    """``conns`` consumers at ``rdy`` that FIN each message as it is read."""
    args = [rdy_reader_binary(), b.tcp_address, TOPIC, "ch", str(conns), str(rdy),
            str(a.seconds)]
    row = _measured(b, lambda: _tool(args, a.seconds))
    row["drained"] = float(_depth(b) == 0)
    return row


def _backlog_reader(rdy: int) -> Callable[[BrokerProcess, argparse.Namespace], Row]:
    def run(b: BrokerProcess, a: argparse.Namespace) -> Row:
        if b.http_address:
            # the channel first, so the backlog is the channel's when the reader comes:
            # nsqd would otherwise copy the topic's backlog into the new channel while
            # the reader reads (a deeper backlog, a longer copy in the measured time)
            create_channel(b, TOPIC, "ch")
        n = a.backlog if rdy > 1 else a.backlog_rdy1
        fill(b, TOPIC, n, a.size)
        # until the channel holds it all (nsqd copies from its topic's queue into the
        # channel's after the OKs), at most a minute
        deadline = time.monotonic() + 60
        while _depth(b) < n // 400 * 400 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)    # let the broker settle (nsqd: its disk queue's sync)
        if rdy == 1:
            # bench_reader never flushes its FINs at RDY 1 (msgCount % 1 > 0.75 is
            # never true): rdy_reader sends each FIN at once
            return fin_reader(b, a, 1, 32)
        return reader(b, a, rdy, 32)
    return run


def scenario_bulk(b: BrokerProcess, a: argparse.Namespace) -> Row:
    w = writer(b, a, 200, None)
    r = reader(b, a, 2500, None)
    return {"pub msg/s": w["msg/s"], "pub us/msg": w["us/msg"],
            "sub msg/s": r["msg/s"], "sub us/msg": r["us/msg"], "drained": r["drained"]}


def scenario_pubsub(b: BrokerProcess, a: argparse.Namespace) -> Row:
    """bench_writer and bench_reader at once; the broker's CPU per message counts both
    directions (a message published and delivered)."""
    wargs = ["bench_writer", f"--nsqd-tcp-address={b.tcp_address}", f"--topic={TOPIC}",
             f"--runfor={a.seconds}s", f"--size={a.size}", "--batch-size=200"]
    rargs = ["bench_reader", f"--nsqd-tcp-address={b.tcp_address}", f"--topic={TOPIC}",
             "--channel=ch", f"--runfor={a.seconds}s", f"--size={a.size}", "--rdy=2500"]
    cpu0 = b.cpu_s()
    with ThreadPoolExecutor(2) as pool:
        rf = pool.submit(_tool, rargs, a.seconds)
        time.sleep(0.2)     # the reader's channel exists before the first publish
        wf = pool.submit(_tool, wargs, a.seconds)
        (pub, pdur), (sub, sdur) = wf.result(), rf.result()
    cpu = b.cpu_s() - cpu0
    msgs = max(pub * pdur, sub * sdur)
    return {"pub msg/s": pub, "sub msg/s": sub, "us/msg": cpu / msgs * 1e6 if msgs else 0.0}


E2E_RE = re.compile(r"rate ([0-9.]+)/s p50 ([0-9.]+) p99 ([0-9.]+) p999 ([0-9.]+) "
                    r"max ([0-9.]+)")


def scenario_e2e(b: BrokerProcess, a: argparse.Namespace) -> Row:
    args = [rdy_reader_binary("e2e_latency"), b.tcp_address, "e2e", str(a.e2e_rate), "32",
            "4", str(a.size), str(a.seconds)]
    cpu0 = b.cpu_s()
    out = subprocess.run(args, capture_output=True, text=True, timeout=a.seconds + 120)
    cpu = b.cpu_s() - cpu0
    m = E2E_RE.search(out.stdout)
    if out.returncode != 0 or m is None:
        raise RuntimeError(f"e2e_latency failed ({out.returncode}): {out.stderr[-2000:]}")
    rate = float(m.group(1))
    return {"sent msg/s": rate, "p50 us": float(m.group(2)), "p99 us": float(m.group(3)),
            "p999 us": float(m.group(4)), "max us": float(m.group(5)),
            "us/msg": cpu / (rate * a.seconds) * 1e6 if rate else 0.0}


CLIENT_PROGRAMS = {
    "pybroker.client": """
        import resource, sys, threading, time
        from pybroker.client import Consumer
        addr, topic, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
        inline = sys.argv[4:] == ["inline"]
        count = [0]
        started = threading.Event()
        def handler(m):
            count[0] += 1
            started.set()
        c = Consumer(topic, "ch", handler, max_in_flight=1, **({"inline": True} if inline else {}))
        c.connect_to_nsqd(addr)
        started.wait(30)
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        n0, t0 = count[0], time.monotonic()
        time.sleep(seconds)
        n1, t1 = count[0], time.monotonic()
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        c.stop()
        cpu = cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime
        print(n1 - n0, t1 - t0, cpu)
    """,
    "gnsq": """
        import gevent.monkey; gevent.monkey.patch_all()
        import resource, sys, time, gevent, gnsq
        addr, topic, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
        count = [0]
        c = gnsq.Consumer(topic, "ch", nsqd_tcp_addresses=[addr], max_in_flight=1)
        @c.on_message.connect
        def handler(consumer, message):
            count[0] += 1
        c.start(block=False)
        while not count[0]:
            gevent.sleep(0.01)
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        n0, t0 = count[0], time.monotonic()
        gevent.sleep(seconds)
        n1, t1 = count[0], time.monotonic()
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        c.close()
        cpu = cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime
        print(n1 - n0, t1 - t0, cpu)
    """,
}


def run_client(kind: str, b: BrokerProcess, a: argparse.Namespace) -> Row:
    fill(b, TOPIC, a.client_backlog, a.size)
    env = dict(os.environ)
    extra = []
    if kind == "pybroker.client inline":     # the handler on the loop's thread, as gnsq's
        kind, extra = "pybroker.client", ["inline"]
    if kind == "baseline.client":   # the same program, importing the baseline tree
        env.update(PYTHONPATH=str(Path(a.baseline_src).resolve()), PYTHONSAFEPATH="1")
        kind = "pybroker.client"
    prog = textwrap.dedent(CLIENT_PROGRAMS[kind])
    out = subprocess.run([sys.executable, "-c", prog, b.tcp_address, TOPIC, str(a.seconds),
                          *extra],
                         capture_output=True, text=True, timeout=a.seconds + 120,
                         cwd=str(ROOT), env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{kind} consumer failed: {out.stderr[-2000:]}")
    n, dur, cpu = (float(x) for x in out.stdout.split()[-3:])
    return {"msg/s": n / dur, "client us/msg": cpu / n * 1e6 if n else 0.0,
            "drained": float(_depth(b) == 0)}


SCENARIOS: dict[str, Callable[[BrokerProcess, argparse.Namespace], Row]] = {
    "pub1": scenario_pub1,
    "sync1": scenario_sync1,
    "rdy8": _backlog_reader(8),
    "rdy1": _backlog_reader(1),
    "bulk": scenario_bulk,
    "pubsub": scenario_pubsub,
    "e2e": scenario_e2e,
}


def table(name: str, runs: int, results: dict[str, dict[str, list[float]]], ref: str) -> None:
    print(f"\n== {name} (median of {runs}, min-max)")
    kinds = [k for k in results if results[k]]
    for key in next(iter(results[k] for k in kinds)):
        if key == "drained":
            continue
        cells = []
        for kind in kinds:
            vals = results[kind].get(key, [])
            if vals:
                cells.append(f"{kind} {statistics.median(vals):,.1f} "
                             f"({min(vals):,.1f}-{max(vals):,.1f})")
        line = f"  {key:16s} " + " | ".join(cells)
        refv = results.get(ref, {}).get(key)
        if refv and statistics.median(refv):
            for kind in kinds:
                if kind != ref and results[kind].get(key):
                    line += (f"  {kind}/{ref} "
                             f"{statistics.median(results[kind][key]) / statistics.median(refv):.2f}x")
        print(line)
    for kind in kinds:
        drained = sum(results[kind].get("drained", []))
        if drained:
            print(f"  ({kind}: {drained:.0f} run(s) drained the backlog early)")
    print(flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--size", type=int, default=200)
    p.add_argument("--backlog", type=int, default=3_000_000,
                   help="messages published before rdy8 reads (1.5M drained in 5 s on a 2-core AMD EPYC VM)")
    p.add_argument("--backlog-rdy1", type=int, default=1_000_000,
                   help="messages published before rdy1 reads")
    p.add_argument("--client-backlog", type=int, default=300_000,
                   help="messages published before each client1 run (more than it drains)")
    p.add_argument("--e2e-rate", type=float, default=0.0,
                   help="e2e: messages per second (default: half of nsqd's pub1 median)")
    p.add_argument("--only", nargs="*", default=[*SCENARIOS, "client1"],
                   choices=[*SCENARIOS, "client1"])
    p.add_argument("--nsqd", default=shutil.which("nsqd"))
    p.add_argument("--baseline-src", default="",
                   help="also run a pybroker from this source tree (C codec built)")
    p.add_argument("--ceiling", action="store_true",
                   help="also run loadtest/null_broker.c (kind ceiling): what the load "
                        "generator allows on this machine when the broker costs ~nothing")
    a = p.parse_args()
    for tool in ("bench_writer", "bench_reader"):
        if shutil.which(tool) is None:
            print(f"{tool} not found on PATH (. /work/shared/nsq/env.sh)", file=sys.stderr)
            return 2
    if not a.nsqd:
        print("nsqd not found on PATH", file=sys.stderr)
        return 2
    kinds: dict[str, tuple[str, dict[str, str]]] = {"pybroker": ("pybroker", {})}
    if a.baseline_src:
        # PYTHONSAFEPATH: the working directory (this tree) must not come first
        kinds["baseline"] = ("pybroker", {"PYTHONPATH": str(Path(a.baseline_src).resolve()),
                                          "PYTHONSAFEPATH": "1"})
    kinds["nsqd"] = ("nsqd", {})
    if a.ceiling:
        kinds["ceiling"] = ("null", {})
    nsqd_pub1: list[float] = []
    for name in a.only:
        if name == "e2e" and not a.e2e_rate:
            if not nsqd_pub1:
                b = BrokerProcess("nsqd", nsqd_path=a.nsqd).start()
                try:
                    nsqd_pub1.append(scenario_pub1(b, a)["msg/s"])
                finally:
                    b.stop()
            a.e2e_rate = round(statistics.median(nsqd_pub1) / 2)
            print(f"  e2e at {a.e2e_rate:,} msg/s: half of nsqd's single-message "
                  f"maximum ({statistics.median(nsqd_pub1):,.0f} msg/s)", flush=True)
        if name == "client1":
            order = ["pybroker.client", "pybroker.client inline",
                     *(["baseline.client"] if a.baseline_src else []), "gnsq"]
            results: dict[str, dict[str, list[float]]] = {k: {} for k in order}
            for run in range(a.runs):
                for kind in order if run % 2 == 0 else order[::-1]:
                    b = BrokerProcess("nsqd", nsqd_path=a.nsqd).start()
                    try:
                        got = run_client(kind, b, a)
                    finally:
                        b.stop()
                    for k, v in got.items():
                        results[kind].setdefault(k, []).append(v)
                    print(f"  client1 run {run + 1} {kind}: "
                          + ", ".join(f"{k} {v:,.1f}" for k, v in got.items()), flush=True)
            table("client1 (consumers against nsqd, max_in_flight 1)", a.runs, results, "gnsq")
            continue
        names = [k for k in kinds if not (kinds[k][0] == "null" and name == "e2e")]
        results = {k: {} for k in names}
        for run in range(a.runs):
            for kind in names if run % 2 == 0 else names[::-1]:
                prog, env = kinds[kind]
                b = (NullBroker(a.size) if prog == "null" else
                     BrokerProcess(prog, nsqd_path=a.nsqd, env=env)).start()
                try:
                    got = SCENARIOS[name](b, a)
                except RuntimeError as e:
                    # say which broker it was, with the end of its log
                    tail = b.log_text()[-3000:] if isinstance(b, BrokerProcess) else ""
                    raise RuntimeError(f"{name} run {run + 1} {kind}: {e}\n"
                                       f"--- its log ends:\n{tail}") from e
                finally:
                    b.stop()
                for k, v in got.items():
                    results[kind].setdefault(k, []).append(v)
                if name == "pub1" and kind == "nsqd":
                    nsqd_pub1.append(got["msg/s"])
                print(f"  {name} run {run + 1} {kind}: "
                      + ", ".join(f"{k} {v:,.1f}" for k, v in got.items()), flush=True)
        table(name, a.runs, results, "nsqd")
    return 0


if __name__ == "__main__":
    sys.exit(main())
