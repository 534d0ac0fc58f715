#!/usr/bin/env python3
"""The floor under a replicated publish in Python on this machine: what a relay that
does nothing else costs, beside what it costs with no followers (docs/replication.md,
"The floor").

    python loadtest/bench_relay_floor.py [--seconds 4] [--runs 3] [--connections 4]
                                         [--depth 1] [--size 200]

Two settings, interleaved run by run, each in processes of its own on loopback:

- ``single``: one process reads PUB frames (NSQ's V2 protocol) from the publishers on
  an epoll loop, appends each turn's bodies to a file (one ``pwrite``: the page cache,
  as a memory-mode log) and answers OK.
- ``relay``: the same process also sends each turn's bodies to two follower processes
  in one frame each; a follower appends the frame to its own file and answers with the
  frame's number (8 bytes); a publish is answered once both followers have answered
  its frame. The same shape as a replicated round (a parked fetch answered by a
  write, the next fetch its acknowledgement), without offsets, epochs, leases,
  checksums, an index or a log read.

The load is ``bench_durability.publish_for``'s (``bench_replication.py``'s): raw
sockets, ``--depth`` PUBs in flight each. Printed: the median rate of ``--runs`` runs,
the CPU microseconds a message of each process (``/proc/PID/stat``) and of the load
generator, and the ratio of the relay to the single setting. Compare with
``bench_replication.py``'s figures for the same flow: the difference is the weight of
the broker's replication path over a bare relay of its shape.
"""
from __future__ import annotations

import argparse
import os
import resource
import select
import signal
import socket
import statistics
import struct
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_durability import build_command, publish_for  # noqa: E402

OK = struct.pack(">ii", 6, 0) + b"OK"
_U32, _U64 = struct.Struct(">I"), struct.Struct(">Q")


def _nodelay(s: socket.socket) -> socket.socket:
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def follower(ready_fd: int, path: str) -> None:
    """Append each frame ([u32 size][u64 number][bodies]) to a file; answer the last
    whole frame's number after each read."""
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(1)
    os.write(ready_fd, struct.pack(">H", ls.getsockname()[1]))
    c = _nodelay(ls.accept()[0])
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    at = 0
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    have = 0
    ep = select.epoll()
    ep.register(c.fileno(), select.EPOLLIN)
    while True:
        ep.poll()
        n = c.recv_into(view[have:])
        if not n:
            return
        have += n
        pos, last = 0, -1
        while have - pos >= 4:
            size = _U32.unpack_from(buf, pos)[0]
            if have - pos < 4 + size:
                break
            last = _U64.unpack_from(buf, pos + 4)[0]
            pos += 4 + size
        if last >= 0:
            at += os.pwrite(fd, view[:pos], at)
            buf[:have - pos] = buf[pos:have]
            have -= pos
            c.send(_U64.pack(last))


def leader(ready_fd: int, path: str, follower_ports: list[int]) -> None:
    """Read PUBs; per turn: append the bodies, send them to the followers, answer each
    publish once every follower answered its frame (at once with no followers)."""
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(64)
    ls.setblocking(False)
    fs = [_nodelay(socket.create_connection(("127.0.0.1", p))) for p in follower_ports]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    at = 0
    ep = select.epoll()
    ep.register(ls.fileno(), select.EPOLLIN)
    of_follower = {s.fileno(): i for i, s in enumerate(fs)}
    for s in fs:
        ep.register(s.fileno(), select.EPOLLIN)
    conns: dict[int, tuple[socket.socket, bytearray]] = {}
    acked = [0] * len(fs)
    number = 0
    waiting: list[tuple[int, socket.socket, int]] = []     # (frame, conn, publishes)
    os.write(ready_fd, struct.pack(">H", ls.getsockname()[1]))
    while True:
        bodies: list[bytes] = []
        read: list[tuple[socket.socket, int]] = []
        for fileno, _ in ep.poll():
            if fileno == ls.fileno():
                c = _nodelay(ls.accept()[0])
                c.setblocking(False)
                conns[c.fileno()] = (c, bytearray())
                ep.register(c.fileno(), select.EPOLLIN)
            elif fileno in of_follower:
                got = fs[of_follower[fileno]].recv(4096)
                acked[of_follower[fileno]] = _U64.unpack_from(got, len(got) - 8)[0]
            else:
                c, b = conns[fileno]
                data = c.recv(65536)
                if not data:
                    ep.unregister(fileno)
                    c.close()
                    del conns[fileno]
                    continue
                b += data
                if b.startswith(b"  V2"):
                    del b[:4]
                n = pos = 0
                while True:                    # PUB <topic>\n[u32 size][body]
                    nl = b.find(b"\n", pos)
                    if nl < 0 or len(b) - nl - 1 < 4:
                        break
                    size = _U32.unpack_from(b, nl + 1)[0]
                    if len(b) - nl - 5 < size:
                        break
                    bodies.append(bytes(b[nl + 5:nl + 5 + size]))
                    n += 1
                    pos = nl + 5 + size
                del b[:pos]
                if n:
                    read.append((c, n))
        if bodies:
            number += 1
            blob = b"".join(bodies)
            at += os.pwrite(fd, blob, at)
            frame = _U32.pack(8 + len(blob)) + _U64.pack(number) + blob
            for s in fs:
                s.send(frame)
            waiting += [(number, c, n) for c, n in read]
        done = min(acked) if fs else number
        if waiting and waiting[0][0] <= done:
            for i, (k, c, n) in enumerate(waiting):
                if k > done:
                    del waiting[:i]
                    break
                c.send(OK * n)
            else:
                waiting.clear()


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _spawn(fn: object, *args: object) -> tuple[int, int]:
    """(pid, port) of fn(ready_fd, *args) run in a forked child."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            fn(w, *args)  # type: ignore[operator]
        finally:
            os._exit(0)
    os.close(w)
    port = struct.unpack(">H", os.read(r, 2))[0]
    os.close(r)
    return pid, port


def one_run(setting: str, args: argparse.Namespace, tmp: str) -> dict[str, float]:
    pids: list[int] = []
    try:
        ports = []
        for i in range(2 if setting == "relay" else 0):
            pid, port = _spawn(follower, os.path.join(tmp, f"f{i}"))
            pids.append(pid)
            ports.append(port)
        lpid, lport = _spawn(leader, os.path.join(tmp, "leader"), ports)
        pids.insert(0, lpid)
        cmd, per = build_command("PUB", "floor", args.size, 1)
        addr = ("127.0.0.1", lport)
        publish_for(addr, cmd, per, args.connections, args.depth, 1.0)     # warm up
        c0 = [_cpu_s(p) for p in pids]
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        n, elapsed = publish_for(addr, cmd, per, args.connections, args.depth, args.seconds)
        c1 = [_cpu_s(p) for p in pids]
        r1 = resource.getrusage(resource.RUSAGE_SELF)
    finally:
        for p in pids:
            os.kill(p, signal.SIGKILL)
            os.waitpid(p, 0)
    us = [1e6 * (b - a) / n for a, b in zip(c0, c1)]
    client = 1e6 * (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) / n
    return {"rate": n / elapsed, "leader": us[0], "followers": sum(us[1:]),
            "client": client}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--connections", type=int, default=4)
    ap.add_argument("--depth", type=int, default=1)
    ap.add_argument("--size", type=int, default=200)
    args = ap.parse_args()
    got: dict[str, list[dict[str, float]]] = {"single": [], "relay": []}
    with tempfile.TemporaryDirectory(prefix="relay-floor-") as tmp:
        for run in range(args.runs):
            for setting in got:
                r = one_run(setting, args, tmp)
                got[setting].append(r)
                print(f"  run {run + 1} {setting:6s} {r['rate']:10,.0f} msg/s", flush=True)
    print(f"\nPUB {args.connections} x {args.depth}, {args.size} B; median of {args.runs}; "
          "CPU us a message")
    print(f"{'setting':8s} {'msg/s':>10s} {'vs single':>9s} {'leader':>7s} "
          f"{'followers':>9s} {'client':>7s}")
    base = statistics.median(r["rate"] for r in got["single"])
    for setting, rows in got.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        print(f"{setting:8s} {med['rate']:10,.0f} {med['rate'] / base:8.2f}x "
              f"{med['leader']:7.1f} {med['followers']:9.1f} {med['client']:7.1f}")


if __name__ == "__main__":
    main()
