"""Hostile peers: issue 21's attacks against pybroker and nsqd, side by side.

For each attack and each broker (a fresh process each time, pybroker with one loop so
the attacker shares it with the others), a Probe on its own connection PUBs and waits
for its OK in a loop while the attack runs; the report gives the others' median, p99
and worst round trip, the broker's RSS growth and its CPU seconds (/proc/PID/stat)
over the attack, and what the attacker saw. Medians over ``--runs`` runs.

Attacks (tests.support.hostile, the same code the tests run):
  bomb         16 KB of deflate that inflate to 16 MiB of NOP, then a PUB
  snappy16m    a snappy chunk header announcing 16 MiB on 20 connections
  plainflood   a plaintext client PUBbing without reading its replies (the bound)
  nopflood     a client sending NOPs for 5 s, 64 KB at a time (16,384 commands)
  tlsflood     the same over TLS
  stalled      500 TLS handshakes started and never finished
  authslow     40 AUTHs held 1.5 s by the auth server, then one answered at once
  backtrack    a grant ``^([a-z0-9]+_?)*$``, then PUB to a 27-character topic

    python loadtest/bench_hostile.py --nsqd "$(command -v nsqd)" --runs 3
    python loadtest/bench_hostile.py --attacks bomb,tlsflood --runs 1   # a sanity run
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pybroker.testing import BrokerProcess, find_nsqd  # noqa: E402
from tests.support import wire  # noqa: E402
from tests.support.broker import rss_kb  # noqa: E402
from tests.support.certs import make_certs  # noqa: E402
from tests.support.hostile import (SNAPPY_STREAM_ID, AuthServer, TlsFlood, deflate_bomb,  # noqa: E402
                                   probing, snappy_attack, stalled_tls_handshakes)
from tests.support.layers import client_context  # noqa: E402
from tests.support.wire import WireClient  # noqa: E402

ATTACKS = ["bomb", "snappy16m", "plainflood", "nopflood", "tlsflood", "stalled", "authslow",
           "backtrack"]


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _flood(addr: tuple[str, int], tls: Any, seconds: float) -> str:
    if tls is not None:
        f = TlsFlood(addr, tls, "flood").start()
        time.sleep(seconds)
        f.stop()
        return f"{f.sent} PUBs sent"
    import socket

    s = socket.create_connection(addr)
    s.sendall(wire.MAGIC_V2)
    s.settimeout(0.5)
    batch = wire.pub("flood", b"x" * 64) * 512
    sent, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            s.sendall(batch)
            sent += 512
        except TimeoutError:
            pass
    s.close()
    return f"{sent} PUBs sent"


_NOPS = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
s.sendall(b"  V2")
batch = b"NOP\\n" * 16384      # whole batches (a timeout could cut a command)
sent, end = 0, time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    s.sendall(batch)
    sent += 16384
print(sent)
"""


def _nops(addr: tuple[str, int], seconds: float) -> str:
    # in a process of its own: a thread of this one looping on sendall would hold the
    # GIL the probe's thread needs (its round trips then wait out the switch interval)
    import subprocess

    out = subprocess.run([sys.executable, "-c", _NOPS, addr[0], str(addr[1]), str(seconds)],
                         capture_output=True, text=True, timeout=seconds + 60)
    return f"{out.stdout.strip() or out.stderr.strip()[-80:]} NOPs sent"


def _auth(addr: tuple[str, int], secret: str) -> WireClient:
    c = WireClient.connect(addr)
    c.identify(feature_negotiation=True)
    c.send(wire.command("AUTH", body=secret.encode()))
    return c


def attack(name: str, addr: tuple[str, int], ctx: Any, auth: AuthServer) -> str:
    if name == "bomb":
        return f"PUB answered after {deflate_bomb(addr, 'bomb'):.2f}s"
    if name == "snappy16m":
        closed = sum(snappy_attack(addr, SNAPPY_STREAM_ID + b"\0\xff\xff\xff" + b"\0" * (4 << 20))[0]
                     for _ in range(20))
        return f"{closed}/20 closed"
    if name == "nopflood":
        return _nops(addr, 5.0)
    if name in ("plainflood", "tlsflood"):
        return _flood(addr, ctx if name == "tlsflood" else None, 5.0)
    if name == "stalled":
        socks = stalled_tls_handshakes(addr, 500)
        time.sleep(7)
        open_ = 0
        for s in socks:  # closed: the broker's error frame (if any), then EOF
            s.settimeout(0.05)
            try:
                while s.recv(65536):
                    pass
            except TimeoutError:
                open_ += 1
            except OSError:
                pass
            s.close()
        return f"{open_} of 500 still open after 7 s"
    if name == "authslow":
        slow = [_auth(addr, "slow") for _ in range(40)]
        auth.wait_slow(40, 10)
        t0 = time.monotonic()
        fast = _auth(addr, "fast")
        fast.expect_response(None, timeout=30)
        waited = time.monotonic() - t0
        for c in [fast, *slow]:
            c.close()
        return f"fast AUTH answered in {waited * 1000:.0f} ms"
    if name == "backtrack":
        c = _auth(addr, "backtrack")
        c.expect_response(None)
        t0 = time.monotonic()
        c.send(wire.pub("a" * 26 + "-", b"x"))
        _, data = c.read_frame(timeout=60)
        c.close()
        return f"{data.decode()[:16]} after {(time.monotonic() - t0) * 1000:.1f} ms"
    raise ValueError(name)


def run_one(kind: str, nsqd: str | None, name: str, certs: Any, auth: AuthServer) -> dict[str, Any]:
    args = [f"--tls-cert={certs.server_cert}", f"--tls-key={certs.server_key}"]
    if name in ("authslow", "backtrack"):
        args = [f"--auth-http-address=127.0.0.1:{auth.port}"]
    if kind == "pybroker":
        args.append("--loop-threads=1")
    b = BrokerProcess(kind, args, nsqd_path=nsqd).start()
    try:
        assert b.tcp_address is not None
        secret = "fast" if name in ("authslow", "backtrack") else None
        rss0, cpu0 = rss_kb(b.pid), cpu_s(b.pid)
        with probing(b.tcp_address, "probe", auth_secret=secret) as p:
            time.sleep(0.2)
            seen = attack(name, b.tcp_address, client_context(certs), auth)
        return {"p50": p.percentile_ms(0.5), "p99": p.percentile_ms(0.99), "worst": p.worst_ms,
                "rss_kb": rss_kb(b.pid) - rss0, "cpu_s": cpu_s(b.pid) - cpu0, "seen": seen,
                "errors": p.errors}
    finally:
        b.stop()
        b.cleanup()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nsqd", default=find_nsqd(), help="nsqd binary (default: on PATH)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--attacks", default=",".join(ATTACKS))
    a = ap.parse_args()
    kinds = ["pybroker"] + (["nsqd"] if a.nsqd else [])
    certs = make_certs(Path(tempfile.mkdtemp(prefix="bench-hostile-")))
    auth = AuthServer().start()
    med: Callable[[list[float]], float] = statistics.median
    try:
        print(f"{'attack':<11} {'broker':<9} {'p50 ms':>7} {'p99 ms':>7} {'worst':>7} "
              f"{'RSS +kB':>8} {'CPU s':>6}  attacker saw (last run)")
        for name in a.attacks.split(","):
            for kind in kinds:
                rows = [run_one(kind, a.nsqd, name, certs, auth) for _ in range(a.runs)]
                last = rows[-1]
                print(f"{name:<11} {kind:<9} {med([r['p50'] for r in rows]):7.1f} "
                      f"{med([r['p99'] for r in rows]):7.1f} {med([r['worst'] for r in rows]):7.1f} "
                      f"{med([r['rss_kb'] for r in rows]):8.0f} {med([r['cpu_s'] for r in rows]):6.2f}  "
                      f"{last['seen']}{' probe errors: ' + str(last['errors']) if last['errors'] else ''}",
                      flush=True)
    finally:
        auth.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
