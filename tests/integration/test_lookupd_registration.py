"""pybroker registers its topics and channels with nsqlookupd, as nsqd does.

A small nsqlookupd stand-in (TCP protocol V1) records what the broker sends; when a real
nsqlookupd binary is on PATH, the same flow is checked through its HTTP /lookup too.
"""
from __future__ import annotations

import json
import socket
import struct
import threading
from typing import Callable

from tests.support import wire
from tests.support.broker import BrokerProcess, unique_name, wait_until
from tests.support.http import http_json
from tests.support.nsqtools import start_nsqlookupd


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


def test_real_nsqlookupd_lookup_finds_pybroker(
        make_broker: Callable[..., BrokerProcess]) -> None:
    lookupd = start_nsqlookupd()
    try:
        b = make_broker(f"--lookupd-tcp-address={lookupd.hostport('TCP')}")
        # nsqlookupd lists a producer with its HTTP port: make_broker always enables HTTP
        assert b.http_address is not None and b.tcp_address is not None
        topic = unique_name()
        with wire.WireClient.connect(b.tcp_address) as c:
            c.pub(topic, b"x")

        def lookup() -> dict[str, object] | None:
            status, doc = http_json("GET", f"http://{lookupd.hostport()}/lookup?topic={topic}")
            return doc if status == 200 else None

        data = wait_until(lookup, timeout_s=10, what="/lookup to list the broker")
        producers = data["producers"]  # type: ignore[index]
        assert [p["tcp_port"] for p in producers] == [b.tcp_address[1]]
        assert [p["http_port"] for p in producers] == [b.http_address[1]]
    finally:
        assert lookupd.stop() == 0, lookupd.text()
