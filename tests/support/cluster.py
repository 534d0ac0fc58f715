"""A replicated pybroker cluster for tests: a real etcd (tests.support.etcd) and N real
pybroker processes on loopback, each with its own data path, stopped by PID.

Also the test clients that outlive a node: ``Publishers`` (threads that PUB over real
sockets to any node, remembering every body answered OK) and ``Consumers`` (threads
that SUB to whichever node accepts, FIN everything and remember what they got). Both
reconnect to the next node when a connection fails, as an NSQ client with several
nsqd addresses does.
"""
from __future__ import annotations

import json
import signal
import socket
import struct
import threading
import time
import urllib.request
from typing import Any

from tests.support.broker import BrokerProcess, wait_until
from tests.support.etcd import EtcdProcess
from tests.support.wire import FRAME_ERROR, FRAME_MESSAGE, FRAME_RESPONSE, HEARTBEAT, \
    MAGIC_V2, fin, nop, pub, rdy, sub

LEASE = "3s"


class Cluster:
    def __init__(self, n: int = 3, factor: int = 3, min_insync: int = 2,
                 extra: list[str] | None = None, env: dict[str, str] | None = None,
                 node_env: dict[int, dict[str, str]] | None = None) -> None:
        """``env``: for every node; ``node_env``: more for node i (its own fault plan)."""
        self.etcd = EtcdProcess().start()
        self.nodes: dict[int, BrokerProcess] = {}
        for i in range(1, n + 1):
            self.nodes[i] = BrokerProcess("pybroker", [
                f"--node-id={i}", f"--cluster-etcd={self.etcd.url}",
                "--cluster-address=127.0.0.1:0", f"--replication-factor={factor}",
                f"--min-insync-replicas={min_insync}", f"--cluster-lease-ttl={LEASE}",
                *(extra or [])], env={**(env or {}), **(node_env or {}).get(i, {})} or None)
        try:
            for b in self.nodes.values():
                b.start()
            for i in self.nodes:
                self.wait_joined(i, n)
        except BaseException:
            self.close()          # nothing left running when start-up fails
            raise

    def wait_joined(self, i: int, n: int) -> None:
        """Until node i sees n live nodes (a topic created earlier has fewer
        replicas: they are chosen among the live nodes)."""
        def joined() -> bool:
            try:
                with urllib.request.urlopen(f"{self.nodes[i].http_url}/stats?format=json"
                                            "&topic=-", timeout=2) as r:
                    doc = json.loads(r.read())
            except OSError:
                return False
            return len(doc.get("cluster", {}).get("live_nodes", [])) >= n

        wait_until(joined, 20, 0.05, what=f"node {i} to see {n} live nodes")

    def close(self) -> list[str]:
        """Stop every node (SIGCONT first: a test may have stopped one) and etcd;
        returns the problems seen (a node that did not exit 0, a traceback)."""
        problems = []
        for i, b in self.nodes.items():
            if b.proc is not None:
                try:
                    b.proc.send_signal(signal.SIGCONT)
                    code = b.stop(signal.SIGTERM)
                except AssertionError as e:
                    problems.append(f"node {i}: {e}")
                    code = 0
                if code != 0:
                    problems.append(f"node {i} exited {code}:\n{b.stderr_text()[-4000:]}")
            if "Traceback" in b.stderr_text():
                problems.append(f"node {i} logged a traceback:\n{b.stderr_text()[-6000:]}")
            b.cleanup()
        self.etcd.cleanup()
        return problems

    # -- what the nodes say ------------------------------------------------------------
    def replication(self, i: int, topic: str) -> dict[str, Any] | None:
        """Node i's /stats replication object of topic (None: unknown or down)."""
        t = self.topic_stats(i, topic)
        return t.get("replication") if t is not None else None

    def summary(self, i: int) -> dict[str, Any]:
        """Node i's /stats ``cluster`` object."""
        with urllib.request.urlopen(f"{self.nodes[i].http_url}/stats?format=json&topic=-",
                                    timeout=2) as r:
            return dict(json.loads(r.read()).get("cluster", {}))

    def topic_stats(self, i: int, topic: str) -> dict[str, Any] | None:
        b = self.nodes[i]
        if b.proc is None or b.http_address is None:
            return None
        try:
            with urllib.request.urlopen(f"{b.http_url}/stats?format=json&topic={topic}",
                                        timeout=2) as r:
                doc = json.loads(r.read())
        except OSError:
            return None
        for t in doc.get("topics") or []:
            if t["topic_name"] == topic:
                return dict(t)
        return None

    def leader(self, topic: str, exclude: tuple[int, ...] = ()) -> int | None:
        """The node that says it leads topic (and whose followers agree)."""
        for i in self.nodes:
            if i in exclude:
                continue
            r = self.replication(i, topic)
            if r is not None and r["role"] == "leader":
                return i
        return None

    def settled(self, topic: str, members: int) -> int | None:
        """The leader, once its in-sync set has ``members`` nodes and those follow it."""
        lead = self.leader(topic)
        if lead is None:
            return None
        r = self.replication(lead, topic)
        if r is None or len(r["isr"]) != members:
            return None
        for i in r["isr"]:
            if i == lead:
                continue
            f = self.replication(i, topic)
            if f is None or f["role"] != "follower" or f["leader"] != lead \
                    or f["epoch"] != r["epoch"]:
                return None
        return lead

    def http_pub(self, i: int, topic: str, body: bytes) -> tuple[int, bytes]:
        req = urllib.request.Request(f"{self.nodes[i].http_url}/pub?topic={topic}", body)
        try:
            with urllib.request.urlopen(req, timeout=15) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()


# -- clients --------------------------------------------------------------------------
class _Conn:
    """A raw V2 connection with a frame buffer (no half-read frame on a timeout)."""

    def __init__(self, addr: tuple[str, int]) -> None:
        self.sock = socket.create_connection(addr, timeout=2)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.sendall(MAGIC_V2)
        self.buf = bytearray()

    def frames(self, timeout_s: float) -> list[tuple[int, bytes]]:
        """The frames that arrive within timeout_s (at least one read); raises
        ConnectionError on EOF."""
        self.sock.settimeout(timeout_s)
        try:
            data = self.sock.recv(65536)
        except TimeoutError:
            return []
        if not data:
            raise ConnectionError("EOF")
        self.buf += data
        out = []
        while len(self.buf) >= 8:
            size, ftype = struct.unpack_from(">ii", self.buf, 0)
            if len(self.buf) < 4 + size:
                break
            body = bytes(self.buf[8:4 + size])
            del self.buf[:4 + size]
            if ftype == FRAME_RESPONSE and body == HEARTBEAT:
                self.sock.sendall(nop())
                continue
            out.append((ftype, body))
        return out

    def close(self) -> None:
        self.sock.close()


class Publishers:
    """``n`` threads publishing ``<prefix>-<thread>-<seq>`` to topic, one PUB at a time,
    to node addresses in turn (moving on when a connection fails or a publish is
    refused). ``acked``: every body answered OK."""

    def __init__(self, cluster: Cluster, topic: str, n: int, prefix: str = "m") -> None:
        self.cluster = cluster
        self.topic = topic
        self.prefix = prefix
        self.acked: set[bytes] = set()
        self.failed = 0
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(k,), daemon=True)
                        for k in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, k: int) -> None:
        seq = 0
        turn = k
        ids = sorted(self.cluster.nodes)
        while not self.stopping.is_set():
            b = self.cluster.nodes[ids[turn % len(ids)]]
            turn += 1
            addr = b.tcp_address
            if b.proc is None or addr is None:
                continue
            try:
                c = _Conn(addr)
            except OSError:
                time.sleep(0.05)
                continue
            try:
                while not self.stopping.is_set():
                    body = f"{self.prefix}-{k}-{seq}".encode()
                    seq += 1
                    c.sock.sendall(pub(self.topic, body))
                    got: list[tuple[int, bytes]] = []
                    deadline = time.monotonic() + 20
                    while not got and time.monotonic() < deadline:
                        got = c.frames(0.5)
                    if not got:
                        raise ConnectionError("no answer in 20 s")
                    if got[0] == (FRAME_RESPONSE, b"OK"):
                        with self.lock:
                            self.acked.add(body)
                    else:
                        with self.lock:
                            self.failed += 1
                        break                  # E_PUB_FAILED is fatal: next node
            except (OSError, ConnectionError):
                with self.lock:
                    self.failed += 1
            finally:
                c.close()
            time.sleep(0.02)

    def count(self) -> int:
        with self.lock:
            return len(self.acked)

    def stop(self) -> set[bytes]:
        self.stopping.set()
        for t in self.threads:
            t.join(30)
        with self.lock:
            return set(self.acked)


class Consumers:
    """``n`` threads, each SUB'd to topic/channel on whichever node accepts (the
    leader), FINning every message; ``got`` maps body -> (arrival time, node)."""

    def __init__(self, cluster: Cluster, topic: str, channel: str, n: int) -> None:
        self.cluster = cluster
        self.topic = topic
        self.channel = channel
        self.got: dict[bytes, tuple[float, int]] = {}
        self.deliveries = 0
        self.subscribed: dict[int, int] = {}       # thread -> node
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(k,), daemon=True)
                        for k in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, k: int) -> None:
        ids = sorted(self.cluster.nodes)
        turn = k
        while not self.stopping.is_set():
            i = ids[turn % len(ids)]
            turn += 1
            b = self.cluster.nodes[i]
            if b.proc is None or b.tcp_address is None:
                continue
            try:
                c = _Conn(b.tcp_address)
            except OSError:
                time.sleep(0.05)
                continue
            try:
                c.sock.sendall(sub(self.topic, self.channel))
                got: list[tuple[int, bytes]] = []
                deadline = time.monotonic() + 5
                while not got and time.monotonic() < deadline:
                    got = c.frames(0.5)
                if not got or got[0] != (FRAME_RESPONSE, b"OK"):
                    time.sleep(0.05)
                    continue
                with self.lock:
                    self.subscribed[k] = i
                c.sock.sendall(rdy(50))
                while not self.stopping.is_set():
                    for ftype, body in c.frames(0.5):
                        if ftype == FRAME_MESSAGE:
                            msg_id, data = body[10:26], body[26:]
                            with self.lock:
                                self.deliveries += 1
                                self.got.setdefault(data, (time.monotonic(), i))
                            c.sock.sendall(fin(msg_id))
                        elif ftype == FRAME_ERROR:
                            raise ConnectionError(body.decode())
            except (OSError, ConnectionError):
                pass
            finally:
                with self.lock:
                    self.subscribed.pop(k, None)
                c.close()

    def received(self) -> set[bytes]:
        with self.lock:
            return set(self.got)

    def first_after(self, t: float, exclude_node: int) -> float | None:
        """When the first message arrived after t from a node other than exclude_node."""
        with self.lock:
            times = [at for at, node in self.got.values() if at > t and node != exclude_node]
        return min(times) if times else None

    def stop(self) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(10)
