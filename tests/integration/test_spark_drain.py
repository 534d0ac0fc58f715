"""Available-now on a channel: "drained" means silence from servers that were heard from,
not silence alone.

The channel source (stream_reader) ends an available-now run when no message comes for
``drain_timeout``. A server that stalls (or a process stalled on a loaded machine) is
silent too; the run used to end there, leaving the rest of the channel for the next run.
Here the stall is a proxy between the source and the broker that stops passing the
broker's bytes on: messages and heartbeats are held back, as a stopped server would. The
reader's calls run in the test, without Spark (only pyspark's classes are needed), each
in a worker thread so that the source's SIGTERM handler is not put into pytest's process.
"""
from __future__ import annotations

import socket
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest

from pybroker.spark.options import SourceOptions
from tests.integration.test_spark_core import publish
from tests.support.broker import BrokerProcess, unique_name, wait_until
from tests.support.programs import require_module

require_module("pyspark", "pip install '.[spark]' in the clone")
require_module("pyarrow", "pip install '.[spark]' in the clone")

from pybroker.spark.stream_reader import PyBrokerStreamReader  # noqa: E402 (needs pyspark)

pytestmark = pytest.mark.timeout(60)


class FreezingProxy:
    """A TCP proxy for one connection; ``freeze()`` holds back what the server sends."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.hostport = "127.0.0.1:%d" % self.listener.getsockname()[1]
        self.flowing = threading.Event()
        self.flowing.set()
        self.socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True, name="proxy-accept").start()

    def _accept(self) -> None:
        try:
            client, _ = self.listener.accept()
        except OSError:
            return
        server = socket.create_connection(self.upstream)
        self.socks += [client, server]
        threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
        threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, gated: bool) -> None:
        try:
            while data := src.recv(65536):
                if gated:
                    self.flowing.wait()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def freeze(self) -> None:
        self.flowing.clear()

    def thaw(self) -> None:
        self.flowing.set()

    def close(self) -> None:
        self.thaw()
        self.listener.close()
        for s in self.socks:
            s.close()


def in_thread(fn: Callable[[], Any], timeout_s: float) -> tuple[threading.Thread, list[Any]]:
    """Run fn in a worker thread; returns the thread and a list that gets its result."""
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True, name="reader-call")
    t.start()
    t.join(timeout_s)
    return t, out


def post(b: BrokerProcess, path: str) -> None:
    req = urllib.request.Request(f"http://{b.http_hostport}{path}", data=b"", method="POST")
    urllib.request.urlopen(req, timeout=5).close()


def test_available_now_waits_out_a_stalled_server(make_broker: Callable[..., BrokerProcess]
                                                   ) -> None:
    b = make_broker()
    assert b.tcp_address is not None
    topic = unique_name("sp_stall")
    bodies = [b"s-%03d" % i for i in range(50)]
    publish(b, topic, bodies)
    # the source's channel is paused while it subscribes: nothing is delivered yet
    post(b, f"/channel/create?topic={topic}&channel=spark")
    post(b, f"/channel/pause?topic={topic}&channel=spark")
    proxy = FreezingProxy(b.tcp_address)
    reader = PyBrokerStreamReader(SourceOptions.parse({
        "nsqd": proxy.hostport, "topic": topic, "channel": "spark", "drain_timeout": "1s"}))
    try:
        t, _ = in_thread(reader.prepareForTriggerAvailableNow, 15)
        assert not t.is_alive()
        proxy.freeze()                              # the server falls silent...
        post(b, f"/channel/unpause?topic={topic}&channel=spark")  # ...with 50 to send
        t, result = in_thread(lambda: reader.latestOffset(None), 3.0)
        # 3 s of silence, three drain timeouts: a stall, since no heartbeat came either
        assert t.is_alive(), f"called the channel drained during a stall: {result}"
        proxy.thaw()
        t.join(15)
        assert not t.is_alive() and result
        end = result[0]
        got = [m.body for m in reader.ledger.planned(None, end)]
        assert sorted(got) == bodies
        in_thread(lambda: reader.commit(end), 10)
        # a channel that really is drained still ends the run, about a drain timeout later
        started = time.monotonic()
        t, result = in_thread(lambda: reader.latestOffset(end), 15)
        assert not t.is_alive() and result == [end], result
        assert time.monotonic() - started < 5
        wait_until(lambda: reader.ledger.counts()["finished"] == 50, 5, what="50 FINs")
    finally:
        in_thread(reader.stop, 15)
        proxy.close()
