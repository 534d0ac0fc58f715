"""Registration with nsqlookupd, as nsqd does it, so pybroker nodes join an NSQ cluster.

The ``lookupd`` thread (a SelectorLoop, pybroker.evloop) talks to every address in
``nsqlookupd_tcp_addresses`` over the lookupd TCP protocol (magic ``"  V1"``; replies are
``[int32 size][data]`` with no frame type): IDENTIFY with this node's ports and addresses,
then REGISTER every topic and channel; afterwards it sends the difference whenever the
broker's topics or channels change, and a PING every 15 s. A peer that fails is dropped
and reconnected (and fully re-registered) on the next pass, after a back-off of 1 s
doubling up to 15 s; a peer that hangs up is noticed at once (its socket is watched).

Registration at once: the broker's change callback (``notify``, any thread: a publish
over TCP or HTTP creating a topic, a SUB creating a channel, a delete) queues a pass with
the loop's ``call_soon_threadsafe``, whose wake-up byte ends the loop's ``select()`` at
once, so the difference reaches every nsqlookupd within a millisecond or so however long
the wait for the next PING is, as nsqd's lookupLoop sends a REGISTER when notified.

Ownership: the ``lookupd`` thread owns its peers' sockets (blocking, with a 5 s timeout
per exchange: the thread is its own and nothing else waits on it) and what it has
registered; it copies the topic list under ``Broker.lock`` and each topic's channel names
(one copy of a dict, atomic under the GIL), and changes neither.
"""
from __future__ import annotations

import json
import logging
import selectors
import socket
import struct
import time
from typing import TYPE_CHECKING

from pybroker import NSQ_COMPAT_VERSION
from pybroker.config import split_hostport
from pybroker.evloop import SelectorLoop

if TYPE_CHECKING:
    from pybroker.server.services import RegistrarHost

log = logging.getLogger("pybroker")
PING_INTERVAL_S = 15.0
RETRY_S = 1.0
IO_TIMEOUT_S = 5.0

Registration = tuple[str, str]  # (topic, channel); channel "" registers the topic alone


class LookupdError(Exception):
    pass


class _Peer:
    """One nsqlookupd connection (used by the lookupd thread only)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.sock: socket.socket | None = None
        self.registered: set[Registration] = set()

    def connect(self, identity: dict[str, object]) -> None:
        host, port = split_hostport(self.address)
        self.sock = socket.create_connection((host, port), timeout=IO_TIMEOUT_S)
        self.sock.sendall(b"  V1")
        body = json.dumps(identity).encode()
        resp = self.command(b"IDENTIFY\n" + struct.pack(">i", len(body)) + body)
        if resp.startswith(b"E_"):
            hint = " (nsqlookupd needs this node's http_address)" if not identity["http_port"] else ""
            raise LookupdError(f"IDENTIFY refused: {resp.decode('utf-8', 'replace')}{hint}")
        log.info("LOOKUPD(%s): peer info %s", self.address, resp.decode("utf-8", "replace"))
        self.registered = set()

    def command(self, data: bytes) -> bytes:
        assert self.sock is not None
        self.sock.sendall(data)
        size = struct.unpack(">i", self._recv(4))[0]
        if not 0 <= size <= 64 * 1024 * 1024:
            raise LookupdError(f"bad response size {size}")
        resp = self._recv(size)
        if resp.startswith(b"E_") and not data.startswith(b"IDENTIFY"):
            raise LookupdError(resp.decode("utf-8", "replace"))
        return resp

    def _recv(self, n: int) -> bytes:
        assert self.sock is not None
        chunks = []
        while n:
            chunk = self.sock.recv(n)
            if not chunk:
                raise LookupdError("connection closed")
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
        self.sock = None
        self.registered = set()


def _cmd(verb: str, reg: Registration) -> bytes:
    topic, channel = reg
    return f"{verb} {topic} {channel}\n".encode() if channel else f"{verb} {topic}\n".encode()


class _Watch:
    """A connected peer's socket in the selector: lookupd never speaks first, so a
    readable socket is a hang-up (or garbage)."""

    __slots__ = ("registrar", "peer")

    def __init__(self, registrar: "LookupdRegistrar", peer: _Peer) -> None:
        self.registrar = registrar
        self.peer = peer

    def on_readable(self) -> None:
        log.info("LOOKUPD(%s): connection closed by peer", self.peer.address)
        self.registrar.drop(self.peer)
        self.registrar.notify()

    def on_writable(self) -> None:
        """Never registered for writing."""


class LookupdRegistrar(SelectorLoop):
    def __init__(self, runtime: RegistrarHost, tcp_port: int, http_port: int) -> None:
        super().__init__("lookupd")
        self.runtime = runtime
        self.tcp_port = tcp_port
        self.http_port = http_port
        self._peers: dict[str, _Peer] = {}
        self._queued = False  # a pass is queued (set by any thread, cleared by the pass)
        self._next_ping = 0.0
        self._retry_s = RETRY_S
        self._timer: object = None  # the next PING (a call_later handle), or the retry

    def start(self) -> None:
        self.runtime.broker.on_change.append(self.notify)
        super().start()
        self.notify()

    def notify(self) -> None:
        """Topics or channels changed (any thread): a pass, now."""
        if not self._queued:
            self._queued = True
            self.call_soon_threadsafe(self._pass)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the thread (any thread) and close every peer."""
        SelectorLoop.stop(self)
        if self.thread is not None:
            self.thread.join(timeout_s)
            if self.thread.is_alive():
                log.error("LOOKUPD: the lookupd thread did not stop within %.0fs", timeout_s)
                return
        self.close()

    def on_exit(self) -> None:
        for p in list(self._peers.values()):
            self.drop(p)

    def drop(self, peer: _Peer) -> None:
        """Close a peer's connection (it is reconnected on the next pass)."""
        if peer.sock is not None:
            try:
                self.selector.unregister(peer.sock)
            except (KeyError, ValueError):
                pass
        peer.close()

    def _identity(self) -> dict[str, object]:
        o = self.runtime.options
        return {"version": NSQ_COMPAT_VERSION, "tcp_port": self.tcp_port,
                "http_port": self.http_port, "hostname": socket.gethostname(),
                "broadcast_address": o.broadcast_address}

    def _desired(self) -> set[Registration]:
        broker = self.runtime.broker
        with broker.lock:
            topics = list(broker.topics.values())
        want: set[Registration] = set()
        cluster = self.runtime.cluster
        for t in topics:
            if cluster is not None and not cluster.registers(t.name):
                continue      # a replicated topic is registered by its leader only
            want.add((t.name, ""))
            for name in list(t.channels):
                want.add((t.name, name))
        return want

    def _pass(self) -> None:
        """Bring every peer up to date (PING when due), then wait for the next change,
        PING or retry."""
        self._queued = False
        addresses = list(self.runtime.options.nsqlookupd_tcp_addresses)
        for addr in list(self._peers):
            if addr not in addresses:
                self.drop(self._peers.pop(addr))
        for addr in addresses:
            self._peers.setdefault(addr, _Peer(addr))
        want = self._desired()
        ping = time.monotonic() >= self._next_ping
        if ping:
            self._next_ping = time.monotonic() + PING_INTERVAL_S
        results = [self._sync(p, want, ping) for p in self._peers.values()]
        self.cancel(self._timer)
        if all(results):
            self._retry_s = RETRY_S
            delay_s = max(0.0, self._next_ping - time.monotonic())
        else:  # back off, up to the ping interval, while a peer keeps failing
            delay_s = self._retry_s
            self._retry_s = min(self._retry_s * 2, PING_INTERVAL_S)
        self._timer = self.call_later(int(delay_s * 1e9), self._pass)

    def _sync(self, peer: _Peer, want: set[Registration], ping: bool) -> bool:
        """Bring one peer up to date; False if it failed (it will be retried)."""
        try:
            if peer.sock is None:
                log.info("LOOKUP(%s): adding peer", peer.address)
                peer.connect(self._identity())
                assert peer.sock is not None
                self.selector.register(peer.sock, selectors.EVENT_READ, _Watch(self, peer))
                ping = False
            # channels go before their topic on the way out, topics first on the way in
            for reg in sorted(peer.registered - want, key=lambda r: r[1] == ""):
                log.info("LOOKUPD(%s): %s", peer.address, _cmd("UNREGISTER", reg).strip().decode())
                peer.command(_cmd("UNREGISTER", reg))
                peer.registered.discard(reg)
            for reg in sorted(want - peer.registered, key=lambda r: r[1] != ""):
                log.info("LOOKUPD(%s): %s", peer.address, _cmd("REGISTER", reg).strip().decode())
                peer.command(_cmd("REGISTER", reg))
                peer.registered.add(reg)
            if ping:
                peer.command(b"PING\n")
            return True
        except (OSError, LookupdError, struct.error) as e:
            log.error("LOOKUPD(%s): %s", peer.address, e)
            self.drop(peer)
            return False
