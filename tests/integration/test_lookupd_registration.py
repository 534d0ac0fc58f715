"""pybroker registers its topics and channels with nsqlookupd, as nsqd does.

A small nsqlookupd stand-in (TCP protocol V1) records what the broker sends; when a real
nsqlookupd binary is on PATH, the same flow is checked through its HTTP /lookup too.
"""
from __future__ import annotations

import json
import shutil
import socket
import struct
import subprocess
import threading
import urllib.request
from typing import Callable

import pytest

from tests.support import wire
from tests.support.broker import BrokerProcess, unique_name, wait_until


class FakeLookupd:
    """Accepts V1 connections, answers OK, and records every command in order."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = "127.0.0.1:%d" % self.sock.getsockname()[1]
        self.commands: list[str] = []
        self.identities: list[dict[str, object]] = []
        self.connections = 0
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        f = conn.makefile("rb")
        try:
            assert f.read(4) == b"  V1"
            while True:
                line = f.readline()
                if not line:
                    return
                cmd = line.rstrip(b"\n").decode()
                if cmd == "IDENTIFY":
                    size = struct.unpack(">i", f.read(4))[0]
                    self.identities.append(json.loads(f.read(size)))
                    reply = json.dumps({"tcp_port": 4160, "http_port": 4161,
                                        "version": "1.3.0"}).encode()
                else:
                    self.commands.append(cmd)
                    reply = b"OK"
                conn.sendall(struct.pack(">i", len(reply)) + reply)
        except (OSError, AssertionError, ValueError):
            return

    def drop_connections(self) -> None:
        for c in self._conns:
            c.shutdown(socket.SHUT_RDWR)
            c.close()
        self._conns.clear()

    def close(self) -> None:
        self.sock.close()
        self.drop_connections()


def test_registers_topics_and_channels_and_unregisters(
        make_broker: Callable[..., BrokerProcess]) -> None:
    lk = FakeLookupd()
    try:
        b = make_broker(f"--lookupd-tcp-address={lk.address}")
        wait_until(lambda: lk.identities, what="IDENTIFY from the broker")
        ident = lk.identities[0]
        assert ident["tcp_port"] == b.tcp_address[1]
        assert {"version", "tcp_port", "http_port", "hostname", "broadcast_address"} <= set(ident)
        topic = unique_name()
        with wire.WireClient.connect(b.tcp_address) as c:
            c.pub(topic, b"x")
            wait_until(lambda: f"REGISTER {topic}" in lk.commands, what="topic REGISTER")
            s = wire.WireClient.connect(b.tcp_address)
            s.sub(topic, "c1#ephemeral")
            wait_until(lambda: f"REGISTER {topic} c1#ephemeral" in lk.commands,
                       what="channel REGISTER")
            s.close()
            # an ephemeral channel goes with its last consumer, and is unregistered
            wait_until(lambda: f"UNREGISTER {topic} c1#ephemeral" in lk.commands,
                       what="channel UNREGISTER")
        # a dropped lookupd connection is re-established and everything registered again
        before = lk.connections
        lk.drop_connections()
        wait_until(lambda: lk.connections > before and
                   lk.commands.count(f"REGISTER {topic}") >= 2, timeout_s=10,
                   what="re-registration after reconnect")
    finally:
        lk.close()


@pytest.mark.skipif(shutil.which("nsqlookupd") is None,
                    reason="no nsqlookupd binary on PATH to register with")
def test_real_nsqlookupd_lookup_finds_pybroker(make_broker: Callable[..., BrokerProcess],
                                               tmp_path: object) -> None:
    proc = subprocess.Popen(["nsqlookupd", "--tcp-address=127.0.0.1:0",
                             "--http-address=127.0.0.1:0"], stderr=subprocess.PIPE)
    try:
        addrs: dict[str, str] = {}
        assert proc.stderr is not None
        while len(addrs) < 2:
            line = proc.stderr.readline().decode()
            assert line, "nsqlookupd exited"
            for kind in ("TCP", "HTTP"):
                if f"{kind}: listening on " in line:
                    addrs[kind] = line.split("listening on ")[1].split()[0]
        b = make_broker(f"--lookupd-tcp-address={addrs['TCP']}")
        if b.http_address is None:
            pytest.skip("nsqlookupd needs the broker's HTTP port, and HTTP is not enabled")
        topic = unique_name()
        with wire.WireClient.connect(b.tcp_address) as c:
            c.pub(topic, b"x")

        def lookup() -> dict[str, object] | None:
            try:
                with urllib.request.urlopen(f"http://{addrs['HTTP']}/lookup?topic={topic}",
                                            timeout=2) as r:
                    return json.loads(r.read())
            except OSError:
                return None

        data = wait_until(lookup, timeout_s=10, what="/lookup to list the broker")
        producers = data["producers"]  # type: ignore[index]
        assert [p["tcp_port"] for p in producers] == [b.tcp_address[1]]
    finally:
        proc.terminate()
        proc.wait(10)
