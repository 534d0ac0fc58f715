"""Registration with nsqlookupd, as nsqd does it, so pybroker nodes join an NSQ cluster.

One ``lookupd`` thread talks to every address in ``nsqlookupd_tcp_addresses`` over the
lookupd TCP protocol (magic ``"  V1"``; replies are ``[int32 size][data]`` with no frame
type): IDENTIFY with this node's ports and addresses, then REGISTER every topic and
channel; afterwards it sends the difference whenever the broker's topics or channels
change, and a PING every 15 s. A peer that fails is dropped and reconnected (and fully
re-registered) on the next pass, after a back-off of 1 s doubling up to 15 s.

Registration at once: the thread waits in ``select()`` on its peers' sockets and on a
wake-up socketpair; the broker's change callback (``notify``, any thread: a publish over
TCP or HTTP creating a topic, a SUB creating a channel, a delete) writes one byte to it,
so the difference reaches every nsqlookupd within a millisecond or so however long the
wait for the next PING is, as nsqd's lookupLoop sends a REGISTER when notified.

Ownership: the ``lookupd`` thread owns its sockets and what it has registered; the
broker's change callbacks (any thread) only write to the wake-up socket; it copies
the topic list under ``Broker.lock`` and each topic's channel names (one copy of a
dict, atomic under the GIL), and changes neither.
"""
from __future__ import annotations

import json
import logging
import select
import socket
import struct
import threading
import time
from typing import TYPE_CHECKING, Any

from pybroker import NSQ_COMPAT_VERSION
from pybroker.config import split_hostport

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

    def connect(self, identity: dict[str, Any]) -> None:
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


class LookupdRegistrar:
    def __init__(self, runtime: RegistrarHost, tcp_port: int, http_port: int) -> None:
        self.runtime = runtime
        self.tcp_port = tcp_port
        self.http_port = http_port
        self._peers: dict[str, _Peer] = {}
        # the wake-up socketpair: notify() writes a byte (once per pass), the thread's
        # select() sees it at once
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._woken = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lookupd", daemon=True)

    def start(self) -> None:
        self.runtime.broker.on_change.append(self.notify)
        self._thread.start()

    def notify(self) -> None:
        """Topics or channels changed (any thread): wake the registrar now."""
        if self._woken:
            return  # a byte is already waiting; the next pass sees every change
        self._woken = True
        try:
            self._wake_w.send(b"\0")
        except OSError:  # full (a wake-up is pending anyway) or closed at shutdown
            pass

    def stop(self, timeout_s: float) -> None:
        self._stop.set()
        self._woken = False
        self.notify()
        self._thread.join(timeout_s)
        for p in self._peers.values():
            p.close()
        self._wake_r.close()
        self._wake_w.close()

    def _drain(self) -> None:
        """Take the pending wake-ups; changes after this send a new byte. The flag goes
        down before the read, so a change racing with it is seen by this pass or wakes
        the next one."""
        self._woken = False
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:  # BlockingIOError: drained
            pass

    def _wait(self, timeout_s: float, socks: list[socket.socket]) -> list[socket.socket]:
        """Wait up to timeout_s for a wake-up or a readable peer; the readable peers."""
        readable, _, _ = select.select([self._wake_r, *socks], [], [], max(0.0, timeout_s))
        return [r for r in readable if r is not self._wake_r]

    def _identity(self) -> dict[str, Any]:
        o = self.runtime.options
        return {"version": NSQ_COMPAT_VERSION, "tcp_port": self.tcp_port,
                "http_port": self.http_port, "hostname": socket.gethostname(),
                "broadcast_address": o.broadcast_address}

    def _desired(self) -> set[Registration]:
        broker = self.runtime.broker
        with broker.lock:
            topics = list(broker.topics.values())
        want: set[Registration] = set()
        for t in topics:
            want.add((t.name, ""))
            for name in list(t.channels):
                want.add((t.name, name))
        return want

    def _run(self) -> None:
        next_ping = 0.0
        retry_s = RETRY_S
        while not self._stop.is_set():
            self._drain()
            addresses = list(self.runtime.options.nsqlookupd_tcp_addresses)
            for addr in list(self._peers):
                if addr not in addresses:
                    self._peers.pop(addr).close()
            for addr in addresses:
                self._peers.setdefault(addr, _Peer(addr))
            want = self._desired()
            ping = time.monotonic() >= next_ping
            if ping:
                next_ping = time.monotonic() + PING_INTERVAL_S
            results = [self._sync(p, want, ping) for p in self._peers.values()]
            if all(results):
                retry_s = RETRY_S
                self._idle(next_ping)
            else:  # back off, up to the ping interval, while a peer keeps failing
                self._wait(retry_s, [])
                retry_s = min(retry_s * 2, PING_INTERVAL_S)

    def _idle(self, until: float) -> None:
        """Wait for a change (the wake-up socket) or the next ping, noticing at once a
        peer that hung up."""
        socks = [p.sock for p in self._peers.values() if p.sock is not None]
        readable = self._wait(until - time.monotonic(), socks)
        if readable:  # lookupd never speaks first: this is a close (or garbage)
            for p in self._peers.values():
                if p.sock in readable:
                    log.info("LOOKUPD(%s): connection closed by peer", p.address)
                    p.close()

    def _sync(self, peer: _Peer, want: set[Registration], ping: bool) -> bool:
        """Bring one peer up to date; False if it failed (it will be retried)."""
        try:
            if peer.sock is None:
                log.info("LOOKUP(%s): adding peer", peer.address)
                peer.connect(self._identity())
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
            peer.close()
            return False
