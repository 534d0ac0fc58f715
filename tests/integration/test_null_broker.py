"""loadtest/null_broker.c, the ceiling of loadtest/bench_io.py (``--ceiling``): it must
speak enough of the V2 protocol for nsq's bench programs and rdy_reader, or its figures
mean nothing. Real sockets against the compiled program; no timing assertions."""
from __future__ import annotations

import shutil
import socket
import struct
import subprocess
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest

from tests.support.broker import loadtest_module

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (cc)")]


def bench_io() -> ModuleType:
    return loadtest_module("bench_io")


def read_frame(sock: socket.socket) -> tuple[int, bytes]:
    def exactly(n: int) -> bytes:
        got = b""
        while len(got) < n:
            chunk = sock.recv(n - len(got))
            assert chunk, "null_broker closed the connection"
            got += chunk
        return got
    size, kind = struct.unpack(">II", exactly(8))
    return kind, exactly(size - 4)


def connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=10)
    s.sendall(b"  V2")
    return s


@pytest.fixture
def null_broker() -> Iterator[Any]:
    b = bench_io().NullBroker(200).start()
    try:
        yield b
    finally:
        b.stop()       # by PID (its Popen)


def test_publishes_answered_ok(null_broker: Any) -> None:
    s = connect(null_broker.tcp_address)
    body = b"x" * 200
    s.sendall(b"PUB t\n" + struct.pack(">I", len(body)) + body
              + b"MPUB t\n" + struct.pack(">II", 4 + 2 * (4 + 3), 2)
              + struct.pack(">I", 3) + b"abc" + struct.pack(">I", 3) + b"def"
              + b"NOP\n"
              + b"DPUB t 100\n" + struct.pack(">I", 1) + b"z")
    assert [read_frame(s) for _ in range(3)] == [(0, b"OK")] * 3
    s.close()


def test_subscribed_connection_kept_at_its_rdy(null_broker: Any) -> None:
    s = connect(null_broker.tcp_address)
    s.sendall(b"SUB t ch\n")
    assert read_frame(s) == (0, b"OK")
    s.sendall(b"RDY 2\n")
    msgs = [read_frame(s) for _ in range(2)]
    assert [k for k, _ in msgs] == [2, 2]
    ids = [m[10:26] for _, m in msgs]
    assert len(set(ids)) == 2 and all(len(m) == 26 + 200 for _, m in msgs)
    assert all(struct.unpack(">H", m[8:10])[0] == 1 for _, m in msgs)   # attempts 1
    # nothing more while both are in flight
    s.settimeout(0.3)
    with pytest.raises(socket.timeout):
        s.recv(1)
    s.settimeout(10)
    s.sendall(b"FIN " + ids[0] + b"\n")
    kind, third = read_frame(s)
    assert kind == 2 and third[10:26] not in ids
    s.close()


def test_rdy_reader_reads_from_it(null_broker: Any) -> None:
    mod = bench_io()
    out = subprocess.run([mod.rdy_reader_binary(), null_broker.tcp_address,
                          "t", "ch", "4", "1", "0.5"], capture_output=True, text=True,
                         timeout=30, check=True)
    m = mod.RESULT_RE.search(out.stdout)
    assert m is not None and float(m.group(3)) > 0, out.stdout + out.stderr
