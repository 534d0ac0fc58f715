"""Consume throughput over plain TCP, TLS and snappy (and deflate): pybroker against nsqd.

For each run and mode, each broker in turn (the order flips every run) is started fresh
with the same test certificate and ``--mem-queue-size`` above the backlog, a channel is
filled with ``--messages`` messages of ``--size`` bytes (MPUB over plain TCP), then
``--consumers`` processes, each one connection negotiating the mode in IDENTIFY (TLS
1.3 with the broker's choice of cipher; snappy framing through cramjam), RDY ``--rdy``,
FIN every message in one write per read, drain it. Throughput is the messages received
between the 5th and the 95th percentile of arrivals over that time (a short drain would
otherwise be dominated by its start and by the last partial buffer, which waits for an
output-buffer flush timer). Medians of ``--runs`` runs; the ratio is the
median of each run's pybroker/nsqd ratio.

    python loadtest/bench_tls.py --nsqd /usr/local/bin/nsqd --runs 3

Raw sockets and the standard library (plus cramjam) on the load side, so pybroker's own
codec and client are not part of the measurement. Needs the ``cryptography`` package for
the certificate (the test extra).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import ssl
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import cramjam

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pybroker.testing import BrokerProcess, find_nsqd  # noqa: E402
from tests.support.certs import make_certs  # noqa: E402

_head = struct.Struct(">ii")
_u32 = struct.Struct(">I")


def _cmd(line: bytes, body: bytes | None = None) -> bytes:
    return line + b"\n" + (b"" if body is None else _u32.pack(len(body)) + body)


def _mpub(topic: str, bodies: list[bytes]) -> bytes:
    payload = _u32.pack(len(bodies)) + b"".join(_u32.pack(len(b)) + b for b in bodies)
    return _cmd(b"MPUB " + topic.encode(), payload)


class Conn:
    """A blocking V2 connection with the negotiated layer (none, tls, snappy, deflate)."""

    def __init__(self, address: tuple[str, int], mode: str) -> None:
        self.sock: Any = socket.create_connection(address, timeout=30)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""
        self.codec: Any = None
        body = json.dumps({"feature_negotiation": True, "tls_v1": mode == "tls",
                           "snappy": mode == "snappy", "deflate": mode == "deflate",
                           "client_id": "bench"}).encode()
        self.sock.sendall(b"  V2" + _cmd(b"IDENTIFY", body))
        answer = json.loads(self.frame())
        if mode == "tls":
            assert answer["tls_v1"], answer
            ctx = ssl.create_default_context()
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
            self.sock = ctx.wrap_socket(self.sock)
            assert self.frame() == b"OK"
        elif mode in ("snappy", "deflate"):
            assert answer[mode], answer
            if mode == "snappy":
                self.codec = _Snappy()
            else:
                self.codec = _Deflate(answer["deflate_level"])
            rest, self.buf = self.buf, b""
            self.buf = self.codec.decompress(rest)
            assert self.frame() == b"OK"

    def send(self, data: bytes) -> None:
        self.sock.sendall(self.codec.compress(data) if self.codec else data)

    def fill(self) -> None:
        data = self.sock.recv(1 << 18)
        if not data:
            raise ConnectionError("closed by the broker")
        if self.codec:
            data = self.codec.decompress(data)
        self.buf += data

    def frame(self) -> bytes:
        while True:
            if len(self.buf) >= 8:
                size, ftype = _head.unpack_from(self.buf)
                if len(self.buf) >= 4 + size:
                    data, self.buf = self.buf[8:4 + size], self.buf[4 + size:]
                    if ftype == 1:
                        raise RuntimeError(data.decode())
                    if data != b"_heartbeat_":
                        return data
                    self.send(b"NOP\n")
                    continue
            self.fill()


class _Snappy:
    def compress(self, data: bytes) -> bytes:
        return bytes(cramjam.snappy.compress(data))

    def __init__(self) -> None:
        self.rest = b""

    def decompress(self, data: bytes) -> bytes:
        buf, end = self.rest + data, 0
        while end + 4 <= len(buf):
            size = 4 + int.from_bytes(buf[end + 1:end + 4], "little")
            if end + size > len(buf):
                break
            end += size
        self.rest = buf[end:]
        if not end:
            return b""
        chunk = buf[:end]
        if not chunk.startswith(b"\xff\x06\x00\x00sNaPpY"):
            chunk = b"\xff\x06\x00\x00sNaPpY" + chunk
        return bytes(cramjam.snappy.decompress(chunk))


class _Deflate:
    def __init__(self, level: int) -> None:
        import zlib
        self.z = zlib.compressobj(level, zlib.DEFLATED, -15)
        self.d = zlib.decompressobj(-15)
        self.flush_mode = zlib.Z_SYNC_FLUSH

    def compress(self, data: bytes) -> bytes:
        return self.z.compress(data) + self.z.flush(self.flush_mode)

    def decompress(self, data: bytes) -> bytes:
        return self.d.decompress(data)


def consumer(address: tuple[str, int], topic: str, mode: str, rdy: int, total: int,
             go: Any, out: Any) -> None:
    c = Conn(address, mode)
    c.send(_cmd(f"SUB {topic} ch".encode()))
    assert c.frame() == b"OK"
    go.wait()
    c.send(b"RDY %d\n" % rdy)
    got = 0
    samples: list[tuple[float, int]] = []  # (arrival time, messages in that read)
    c.sock.settimeout(2.0)
    try:
        while True:
            try:
                c.fill()
            except TimeoutError:
                break  # the backlog is drained (by this and the other consumers)
            buf, pos, ids = c.buf, 0, []
            while len(buf) - pos >= 8:
                size, ftype = _head.unpack_from(buf, pos)
                end = pos + 4 + size
                if end > len(buf):
                    break
                if ftype == 2:
                    ids.append(buf[pos + 18:pos + 34])
                elif buf[pos + 8:end] == b"_heartbeat_":
                    c.send(b"NOP\n")
                pos = end
            c.buf = buf[pos:]
            if ids:
                samples.append((time.monotonic(), len(ids)))
                got += len(ids)
                c.send(b"FIN " + b"\nFIN ".join(ids) + b"\n")
            if got >= total:
                break
    finally:
        out.put((got, samples))


def fill(address: tuple[str, int], topic: str, messages: int, size: int) -> None:
    c = Conn(address, "plain")
    c.send(_cmd(f"SUB {topic} ch".encode()))  # create the channel, then leave
    assert c.frame() == b"OK"
    c.sock.close()
    p = Conn(address, "plain")
    body = b"x" * size
    sent = 0
    while sent < messages:
        n = min(500, messages - sent)
        p.send(_mpub(topic, [body] * n))
        assert p.frame() == b"OK"
        sent += n
    p.sock.close()


def steady_rate(samples: list[tuple[float, int]], total: int) -> float:
    """Messages per second between the 5th and the 95th percentile of arrivals: the
    first reads and the last partial buffer (which waits for an output-buffer flush
    timer) would otherwise dominate a short drain."""
    lo, hi = 0.05 * total, 0.95 * total
    seen, t_lo, t_hi, n_lo = 0, 0.0, 0.0, 0
    for t, n in samples:
        seen += n
        if not t_lo and seen >= lo:
            t_lo, n_lo = t, seen
        if seen >= hi:
            t_hi = t
            break
    return (seen - n_lo) / (t_hi - t_lo)


def measure(kind: str, nsqd: str | None, certs: Any, mode: str, a: argparse.Namespace) -> float:
    args = [f"--tls-cert={certs.server_cert}", f"--tls-key={certs.server_key}",
            f"--mem-queue-size={a.messages * 2}"]
    if kind == "pybroker":
        args.append("--loop-threads=1")
    b = BrokerProcess(kind, args, nsqd_path=nsqd).start()
    try:
        assert b.tcp_address is not None
        topic = f"bench_{mode}_{os.getpid()}_{int(time.time() * 1000)}"
        fill(b.tcp_address, topic, a.messages, a.size)
        go, out = mp.Event(), mp.Queue()
        procs = [mp.Process(target=consumer, args=(b.tcp_address, topic, mode, a.rdy,
                                                   a.messages, go, out))
                 for _ in range(a.consumers)]
        for p in procs:
            p.start()
        time.sleep(0.5)  # every consumer subscribed and waiting before the start
        go.set()
        results = [out.get(timeout=600) for _ in procs]
        for p in procs:
            p.join(30)
        got = sum(r[0] for r in results)
        assert got >= a.messages, f"{kind} {mode}: {got} of {a.messages} received"
        return steady_rate(sorted(s for r in results for s in r[1]), got)
    finally:
        b.stop()
        b.cleanup()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nsqd", default=find_nsqd())
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--modes", default="plain,tls,snappy,deflate")
    ap.add_argument("--messages", type=int, default=500_000)
    ap.add_argument("--size", type=int, default=200)
    ap.add_argument("--consumers", type=int, default=2)
    ap.add_argument("--rdy", type=int, default=2500)
    a = ap.parse_args()
    if not a.nsqd:
        sys.exit("no nsqd binary (use --nsqd)")
    certs = make_certs(Path(tempfile.mkdtemp(prefix="bench-tls-")))
    modes = a.modes.split(",")
    figures: dict[tuple[str, str], list[float]] = {}
    ratios: dict[str, list[float]] = {m: [] for m in modes}
    for run in range(a.runs):
        for mode in modes:
            order = ["pybroker", "nsqd"] if run % 2 == 0 else ["nsqd", "pybroker"]
            got = {k: measure(k, a.nsqd if k == "nsqd" else None, certs, mode, a)
                   for k in order}
            for k, v in got.items():
                figures.setdefault((k, mode), []).append(v)
            ratios[mode].append(got["pybroker"] / got["nsqd"])
            print(f"run {run + 1} {mode:8s} pybroker {got['pybroker']:>9,.0f}  "
                  f"nsqd {got['nsqd']:>9,.0f} msgs/s", flush=True)
    print(f"\nconsume msgs/s, medians of {a.runs} runs ({a.messages:,} messages of "
          f"{a.size} bytes, {a.consumers} consumers, RDY {a.rdy}):")
    print("| mode | pybroker | nsqd | pybroker/nsqd |\n|---|---|---|---|")
    for mode in modes:
        py = statistics.median(figures[("pybroker", mode)])
        nq = statistics.median(figures[("nsqd", mode)])
        print(f"| {mode} | {py:,.0f} | {nq:,.0f} | {statistics.median(ratios[mode]):.2f}x |")


if __name__ == "__main__":
    main()
