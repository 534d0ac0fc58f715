#!/usr/bin/env python3
"""What replication costs and how fast it fails over (docs/replication.md), side by side
in one run: a single pybroker node, a three-node cluster with replication factor 3 and
min-insync 2 (a real etcd, ``$ETCD`` or ``etcd`` on PATH), and nsqd as a reference.

    python loadtest/bench_replication.py [--seconds 3] [--runs 3] [--connections 4]
                                         [--depth 1] [--size 200] [--batch 100]
                                         [--writer python|c|bench_writer]
                                         [--durability memory|fsync] [--failovers 3]
                                         [--max-insync 0]
                                         [--handovers 0]
                                         [--lease-ttl 3s] [--nsqd PATH | --no-nsqd]

``--max-insync 2`` runs the cluster with ``--max-insync-replicas=2`` (docs/replication.md,
"At most N in sync"): an OK waits for two copies, the third replica follows lazily.

Throughput: every run publishes to a fresh topic with one channel and no consumer, over
``--connections`` raw sockets (``--depth`` commands in flight each), PUB then MPUB
(``--batch`` messages), to the topic's leader (the cluster) or the node, and deletes the
topic afterwards (waiting until no node lists it). Every run so starts from the same page
cache: on this machine a write that grows the page cache past about 3 GB costs the
kernel about ten times as much (a plain ``pwrite`` loop of 256 KiB writes: 3.3 GB/s for
its first GB, 0.3 GB/s after), and runs that inherited earlier runs' gigabytes measured
that, not the broker. Settings are interleaved run by run; the table shows the median of
``--runs`` runs (min-max), the ratio to the single node, and CPU ms per 1000 messages from /proc/PID/stat: of the
node, of the leader, and of the whole cluster (the three nodes together), and of the
load generator (``client``: this process's threads, or the writer program it ran).
``--writer c`` publishes with ``loadtest/pub_writer.c`` instead of this process's
threads: the same commands, connections and depth, one C thread a connection (the
producers do not take turns under one interpreter lock, and cost less CPU). ``cpu cap`` is the rate this
machine's cores allow at that CPU per message (brokers and load generator, all on the
same cores): cores / (all nodes + client); where the measured rate is near it, only less
CPU per message moves the rate.

Failover: a publisher (one PUB at a time, to any node that answers) and a consumer
(SUB'd to whichever node accepts) run; the leader is killed with SIGKILL; the time from
the kill to the first message the consumer gets from another node is the failover time.
The killed node is started again (empty) and allowed to rejoin before the next round.

Handover (``--handovers``): the same publisher and consumer, but the leader's disk
fills instead (every node runs with a test fault plan, ``PYBROKER_FAULTS``, that fails
its log writes with ENOSPC while a flag file exists; the flag is made for the leader):
it hands the topic to an in-sync follower (docs/replication.md, "A leader that cannot
write its log"); the time from the flag to the first message the consumer gets from
another node is the handover time. The flag is removed and the old leader allowed to
rejoin the in-sync set before the next round.
Every process is started here on ephemeral loopback ports and stopped by its PID.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_durability import build_command, publish_for  # noqa: E402
from bench_io import _tool, rdy_reader_binary  # noqa: E402

from pybroker.bench.brokers import BrokerProcess  # noqa: E402
from pybroker.config import split_hostport  # noqa: E402



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, timeout_s: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return json.loads(r.read())


def _post(b: BrokerProcess, path: str) -> None:
    req = urllib.request.Request(f"http://{b.http_address}{path}", data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=15) as r:
        r.read()


def drop(b: BrokerProcess, nodes: list[BrokerProcess], topic: str) -> None:
    """Delete a run's topic through ``b`` and wait until none of ``nodes`` lists it."""
    _post(b, "/topic/delete?" + urllib.parse.urlencode({"topic": topic}))

    def gone() -> bool:
        for n in nodes:
            if n.proc is None:
                continue
            doc = _get(f"http://{n.http_address}/stats?format=json&topic="
                       + urllib.parse.quote(topic), 5)
            if any(t.get("topic_name") == topic for t in doc.get("topics") or []):
                return False
        return True
    wait(gone, 30, f"topic {topic} deleted")


def wait(pred: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.02)


class Etcd:
    def __init__(self, path: str) -> None:
        self.dir = tempfile.mkdtemp(prefix="bench-etcd-")
        client, peer = _free_port(), _free_port()
        self.url = f"http://127.0.0.1:{client}"
        purl = f"http://127.0.0.1:{peer}"
        self.proc = subprocess.Popen(
            [path, "--name", "bench", "--data-dir", os.path.join(self.dir, "d"),
             "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
             "--listen-peer-urls", purl, "--initial-advertise-peer-urls", purl,
             "--initial-cluster", f"bench={purl}", "--log-level", "error"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def up() -> bool:
            try:
                req = urllib.request.Request(self.url + "/v3/kv/range", b'{"key":"AA=="}')
                with urllib.request.urlopen(req, timeout=1):
                    return True
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError("etcd exited") from None
                return False
        wait(up, 20, "etcd")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        shutil.rmtree(self.dir, ignore_errors=True)


class ClusterSetting:
    """Three nodes, RF 3, min-insync 2 (and max-insync ``args.max_insync``, 0: none)."""

    def __init__(self, etcd: Etcd, args: argparse.Namespace,
                 env: dict[int, dict[str, str]] | None = None) -> None:
        cap = getattr(args, "max_insync", 0)    # (bench_takeover's args have none)
        self.members = cap or 3
        self.nodes = {i: BrokerProcess("pybroker", [
            f"--node-id={i}", f"--cluster-etcd={etcd.url}", "--cluster-address=127.0.0.1:0",
            "--replication-factor=3", "--min-insync-replicas=2",
            f"--max-insync-replicas={cap}",
            f"--cluster-lease-ttl={args.lease_ttl}", f"--durability={args.durability}",
            ], env=(env or {}).get(i)) for i in (1, 2, 3)}
        for b in self.nodes.values():
            b.start()
        for i in self.nodes:
            self.wait_joined(i)

    def wait_joined(self, i: int) -> None:
        wait(lambda: len(self.summary(i).get("live_nodes", [])) == 3, 30, f"node {i} joined")

    def summary(self, i: int) -> dict[str, Any]:
        try:
            return dict(_get(f"http://{self.nodes[i].http_address}/stats?format=json"
                             "&topic=-").get("cluster", {}))
        except OSError:
            return {}

    def replication(self, i: int, topic: str) -> dict[str, Any] | None:
        b = self.nodes[i]
        if b.proc is None:
            return None
        try:
            doc = _get(f"http://{b.http_address}/stats?format=json&topic={topic}", 2)
        except OSError:
            return None
        for t in doc.get("topics") or []:
            if t["topic_name"] == topic:
                return t.get("replication")
        return None

    def leader(self, topic: str, members: int | None = None) -> int | None:
        """The node leading ``topic`` with a full in-sync set (``members``; default:
        three, or the cap of ``--max-insync``)."""
        want = self.members if members is None else members
        for i in self.nodes:
            r = self.replication(i, topic)
            if r and r["role"] == "leader" and len(r["isr"]) >= want:
                return i
        return None

    def new_topic(self, topic: str) -> BrokerProcess:
        _post(self.nodes[1], "/topic/create?" + urllib.parse.urlencode({"topic": topic}))
        lead = wait(lambda: self.leader(topic), 30, f"a leader of {topic}")
        b = self.nodes[lead]
        _post(b, "/channel/create?" + urllib.parse.urlencode({"topic": topic,
                                                             "channel": "ch"}))
        return b

    def cpu_s(self) -> float:
        return sum(b.cpu_s() for b in self.nodes.values() if b.proc is not None)

    def stop(self) -> None:
        for b in self.nodes.values():
            b.stop()


def publish(args: argparse.Namespace, scenario: str, b: BrokerProcess, topic: str,
            seconds: float) -> tuple[int, float]:
    """Publish to ``topic`` on b for ``seconds`` (``--writer``): messages, seconds."""
    if args.writer == "bench_writer":
        batch = 1 if scenario == "PUB" else args.batch
        rate, dur = _tool(["bench_writer", f"--nsqd-tcp-address={b.tcp_address}",
                           f"--topic={topic}", f"--runfor={seconds}s", f"--size={args.size}",
                           f"--batch-size={batch}"], seconds, args.connections)
        return round(rate * dur), dur
    cmd, per = build_command(scenario, topic, args.size, args.batch)
    if args.writer == "c":
        return publish_c(b, cmd, per, args.connections, args.depth, seconds)
    return publish_for(split_hostport(b.tcp_address), cmd, per, args.connections,
                       args.depth, seconds)


def publish_c(b: BrokerProcess, cmd: bytes, per_cmd: int, connections: int, depth: int,
              seconds: float) -> tuple[int, float]:
    """``loadtest/pub_writer.c``: the same command, connections and depth as the Python
    threads, one C thread a connection (no interpreter lock between the producers)."""
    with tempfile.NamedTemporaryFile(prefix="bench-cmd-") as f:
        f.write(cmd)
        f.flush()
        out = subprocess.run([rdy_reader_binary("pub_writer"), b.tcp_address, f.name,
                              str(per_cmd), str(connections), str(depth), str(seconds)],
                             capture_output=True, text=True, timeout=seconds + 60)
    if out.returncode != 0:
        raise RuntimeError(f"pub_writer failed ({out.returncode}): {out.stderr[-2000:]}")
    words = out.stdout.split()
    return int(words[2]), float(words[4])


def throughput(args: argparse.Namespace, settings: dict[str, Any]) -> None:
    results: dict[tuple[str, str], list[tuple[float, float, float, float]]] = {}
    for run in range(args.runs):
        for scenario in ("PUB", "MPUB"):
            for name, s in settings.items():
                topic = f"rep_{scenario.lower()}_{run}_{time.monotonic_ns() % 10**9}"
                if isinstance(s, ClusterSetting):
                    b = s.new_topic(topic)
                else:
                    b = s
                    _post(b, "/topic/create?" + urllib.parse.urlencode({"topic": topic}))
                    _post(b, "/channel/create?" + urllib.parse.urlencode(
                        {"topic": topic, "channel": "ch"}))
                publish(args, scenario, b, topic, args.warmup)
                all0 = s.cpu_s() if isinstance(s, ClusterSetting) else b.cpu_s()
                cpu0 = b.cpu_s()
                me0 = os.times()
                n, elapsed = publish(args, scenario, b, topic, args.seconds)
                me1 = os.times()
                cpu = b.cpu_s() - cpu0
                # this process's threads, or the bench_writer or pub_writer it ran (a child)
                client = sum(me1[k] - me0[k] for k in range(4))
                allc = (s.cpu_s() if isinstance(s, ClusterSetting) else b.cpu_s()) - all0
                results.setdefault((scenario, name), []).append(
                    (n / elapsed, 1e6 * cpu / max(n, 1), 1e6 * allc / max(n, 1),
                     1e6 * client / max(n, 1)))
                drop(b, list(s.nodes.values()) if isinstance(s, ClusterSetting) else [b],
                     topic)
                print(f"  run {run + 1} {scenario:4} {name:22} {n / elapsed:10.0f} msg/s",
                      flush=True)
    print(f"\nthroughput ({args.writer}, {args.connections} connections, depth {args.depth}, "
          f"{args.size} B, MPUB of {args.batch}, durability {args.durability}; "
          f"median of {args.runs})")
    cores = os.cpu_count() or 1
    print(f"{'scenario':8} {'setting':22} {'msg/s':>10} {'min-max':>19} {'vs single':>9} "
          f"{'cpu ms/1k':>9} {'all nodes':>9} {'client':>7} {'cpu cap':>9} {'vs single':>9}")
    for scenario in ("PUB", "MPUB"):
        base = statistics.median(r[0] for r in results[(scenario, "pybroker single node")])
        for name in settings:
            rs = results[(scenario, name)]
            rate = statistics.median(r[0] for r in rs)
            lo, hi = min(r[0] for r in rs), max(r[0] for r in rs)
            allc = statistics.median(r[2] for r in rs)
            client = statistics.median(r[3] for r in rs)
            # the rate these cores allow at this CPU per message (brokers and client)
            cap = cores * 1e6 / (allc + client) if allc + client else 0.0
            print(f"{scenario:8} {name:22} {rate:10.0f} {lo:9.0f}-{hi:<9.0f} "
                  f"{rate / base:8.2f}x {statistics.median(r[1] for r in rs):9.3f} "
                  f"{allc:9.3f} {client:7.3f} {cap:9.0f} {cap / base:8.2f}x")


def failover(args: argparse.Namespace, etcd: Etcd, disk: bool = False) -> None:
    """Rounds of the leader killed (or, ``disk``, its log's writes failing) under a
    publisher and a consumer; prints the time to the first delivery by another node."""
    flags = Path(tempfile.mkdtemp(prefix="bench-handover-"))
    env = {i: {"PYBROKER_FAULTS": f"op=pwrite kind=ENOSPC count=0 while={flags}/full{i}"}
           for i in (1, 2, 3)} if disk else None
    c = ClusterSetting(etcd, args, env)
    times: list[float] = []
    rounds = args.handovers if disk else args.failovers
    try:
        topic = "failover"
        c.new_topic(topic)
        got: list[tuple[float, int]] = []
        stop = threading.Event()

        def consume() -> None:
            while not stop.is_set():
                for i, b in list(c.nodes.items()):
                    if stop.is_set() or b.proc is None or not b.tcp_address:
                        continue
                    try:
                        s = socket.create_connection(split_hostport(b.tcp_address), timeout=1)
                        s.sendall(b"  V2" + f"SUB {topic} ch\n".encode())
                        buf = b""
                        s.settimeout(1)
                        while len(buf) < 10:
                            chunk = s.recv(4096)
                            if not chunk:
                                raise OSError("closed")
                            buf += chunk
                        if buf[8:10] != b"OK":
                            raise OSError("refused")
                        s.sendall(b"RDY 100\n")
                        buf = buf[10:]
                        while not stop.is_set():
                            while len(buf) >= 8:
                                size, ftype = struct.unpack_from(">ii", buf, 0)
                                if len(buf) < 4 + size:
                                    break
                                body = buf[8:4 + size]
                                buf = buf[4 + size:]
                                if ftype == 2:
                                    got.append((time.monotonic(), i))
                                    s.sendall(b"FIN " + body[10:26] + b"\n")
                                elif body == b"_heartbeat_":
                                    s.sendall(b"NOP\n")
                            try:
                                chunk = s.recv(65536)
                            except TimeoutError:
                                continue
                            if not chunk:
                                raise OSError("closed")
                            buf += chunk
                    except OSError:
                        time.sleep(0.02)

        def publish() -> None:
            cmd, _ = build_command("PUB", topic, args.size, 1)
            while not stop.is_set():
                for b in list(c.nodes.values()):
                    if stop.is_set() or b.proc is None or not b.tcp_address:
                        continue
                    try:
                        s = socket.create_connection(split_hostport(b.tcp_address), timeout=5)
                        s.sendall(b"  V2")
                        while not stop.is_set():
                            s.sendall(cmd)
                            if s.recv(64)[8:10] != b"OK":
                                break
                            time.sleep(0.002)
                    except OSError:
                        time.sleep(0.02)

        threads = [threading.Thread(target=consume, daemon=True),
                   threading.Thread(target=publish, daemon=True)]
        for t in threads:
            t.start()
        for k in range(rounds):
            lead = wait(lambda: c.leader(topic), 60, "a leader with 3 in sync")
            wait(lambda: len(got) > 10, 30, "traffic")
            b = c.nodes[lead]
            assert b.proc is not None
            hit = time.monotonic()
            if disk:
                (flags / f"full{lead}").touch()
            else:
                b.proc.kill()
                b.proc.wait(10)

            def delivered(hit: float = hit, lead: int = lead) -> float | None:
                return next((t for t, n in list(got) if t > hit and n != lead), None)

            first = wait(delivered, 60, "delivery by a new leader")
            times.append(first - hit)
            print(f"  {'handover' if disk else 'failover'} {k + 1}: {first - hit:.2f} s",
                  flush=True)
            if disk:
                (flags / f"full{lead}").unlink()
                # the old leader catches up and rejoins: 3 in sync again
                wait(lambda: c.leader(topic), 60, "the old leader to rejoin")
            else:
                b.stop()
                b.start()
                c.wait_joined(lead)
        stop.set()
        for t in threads:
            t.join(10)
    finally:
        c.stop()
        shutil.rmtree(flags, ignore_errors=True)
    what = ("handover (leader's log writes fail -> first message delivered by the new "
            "leader)" if disk else
            f"failover (leader killed -> first message delivered by the new leader; "
            f"lease ttl {args.lease_ttl})")
    print(f"\n{what}: median {statistics.median(times):.2f} s, "
          f"min {min(times):.2f}, max {max(times):.2f} over {len(times)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--warmup", type=float, default=0.5)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--connections", type=int, default=4)
    p.add_argument("--depth", type=int, default=1)
    p.add_argument("--size", type=int, default=200)
    p.add_argument("--batch", type=int, default=100)
    p.add_argument("--durability", choices=("memory", "fsync"), default="memory")
    p.add_argument("--writer", choices=("python", "c", "bench_writer"), default="python",
                   help="the load generator: this process's threads, "
                        "loadtest/pub_writer.c (a C thread a connection), or nsq's "
                        "bench_writer (GOMAXPROCS=--connections, --depth 1)")
    p.add_argument("--failovers", type=int, default=3)
    p.add_argument("--handovers", type=int, default=0,
                   help="rounds of the leader's log writes failing (a test fault plan)")
    p.add_argument("--lease-ttl", default="3s")
    p.add_argument("--max-insync", type=int, default=0,
                   help="the cluster's --max-insync-replicas (0: every caught-up replica)")
    p.add_argument("--nsqd", default=os.environ.get("NSQD") or shutil.which("nsqd"))
    p.add_argument("--no-nsqd", action="store_true")
    p.add_argument("--etcd", default=os.environ.get("ETCD") or shutil.which("etcd"))
    args = p.parse_args()
    if not args.etcd:
        sys.exit("no etcd (apt install etcd-server, or --etcd PATH)")
    if args.writer == "bench_writer":
        if not shutil.which("bench_writer"):
            sys.exit("no bench_writer on PATH (. ../shared/nsq/env.sh)")
        if args.depth != 1:
            sys.exit("--writer bench_writer has one command in flight a connection: "
                     "--depth 1")
    etcd = Etcd(args.etcd)
    settings: dict[str, Any] = {}
    try:
        try:
            settings["pybroker single node"] = BrokerProcess(
                "pybroker", [f"--durability={args.durability}"]).start()
            name = "pybroker RF3 insync2" + (f" max{args.max_insync}" if args.max_insync
                                             else "")
            settings[name] = ClusterSetting(etcd, args)
            if args.nsqd and not args.no_nsqd:
                settings["nsqd"] = BrokerProcess("nsqd", [],
                                                 nsqd_path=args.nsqd).start()
            throughput(args, settings)
        finally:
            for s in settings.values():
                s.stop()
        if args.failovers > 0:
            failover(args, etcd)
        if args.handovers > 0:
            failover(args, etcd, disk=True)
    finally:
        etcd.stop()


if __name__ == "__main__":
    main()
