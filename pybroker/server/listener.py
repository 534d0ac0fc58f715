"""Listener: accepts TCP clients on one loop and hands each to a loop, round-robin.

Ownership: the listening socket and its back-off belong to ``loops[0]`` (its selector
watches it); an accepted socket for another loop is handed over with that loop's
``call_soon_threadsafe(add_connection, ...)`` and never touched here again.

Admission (``Admission``, also used by the HTTP listener): a process that runs out of
descriptors cannot open a log segment, answer ``/ping`` or accept its operator, so each
listener keeps a reserve below the descriptor limit (RLIMIT_NOFILE's soft limit, raised
to the hard one at start): an accepted socket whose descriptor number is within
``reserve`` of the limit is refused (descriptors are allocated lowest first, so that
many are open), and so is one past ``max_connections`` (redis's maxclients). The TCP
listener keeps ``TCP_RESERVE``, the HTTP one the smaller ``HTTP_RESERVE``, so HTTP
(``/ping``, ``/stats``) still answers when TCP clients are refused. A refused TCP
client gets one ``E_INVALID`` frame and a close; refusals are counted (``refused``,
in /stats and /metrics) and logged once when refusing starts, once when it stops.
"""
from __future__ import annotations

import logging
import resource
import selectors
import socket
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pybroker.protocol.encoder import encode_error

if TYPE_CHECKING:
    from pybroker.server.loop import EventLoop

log = logging.getLogger("pybroker")
# connections accepted per loop turn: each new one's first commands (IDENTIFY, a TLS
# start) run in the same turn, so a burst of hundreds would hold the loop for others;
# the rest stay in the backlog (the socket stays readable) for the next turn
ACCEPTS_PER_TURN = 32
TCP_RESERVE = 64   # descriptors the TCP listener leaves free (HTTP, log files, AUTH)
HTTP_RESERVE = 16  # descriptors the HTTP listener leaves free


def fd_limit() -> int:
    """The soft limit on open descriptors (a large number when unlimited)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 1 << 30 if soft == resource.RLIM_INFINITY else int(soft)


class Admission:
    """Whether an accepted socket may stay; owned by the accepting thread (``refused``
    may be read from any thread)."""

    def __init__(self, name: str, reserve: int, max_connections: int = 0) -> None:
        self.name = name
        self.reserve = reserve
        self.max_connections = max_connections
        self.limit = fd_limit()
        self.refused = 0
        self.refusing = False
        self._logged_at = 0.0

    def check(self, sock: socket.socket, live: int) -> str | None:
        """None to keep ``sock``; otherwise why it is refused (counted and logged)."""
        fd = sock.fileno()
        if fd >= self.limit - self.reserve:
            why = (f"{fd + 1} of {self.limit} file descriptors in use (the last "
                   f"{self.reserve} are kept in reserve)")
        elif self.max_connections and live >= self.max_connections:
            why = f"max_connections ({self.max_connections}) reached"
        else:
            if self.refusing:
                self.refusing = False
                log.info("%s: accepting connections again (%d refused)", self.name,
                         self.refused)
            return None
        self.refused += 1
        now = time.monotonic()
        if not self.refusing and now - self._logged_at >= 1.0:
            self._logged_at = now
            log.warning("%s: refusing new connections: %s", self.name, why)
        self.refusing = True
        return why


def format_addr(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Listener:
    """Registered with loops[0]'s selector; ``on_readable`` accepts every waiting client."""

    closed = False

    def __init__(self, sock: socket.socket, loops: Sequence[EventLoop]) -> None:
        self.sock = sock
        self.loops = loops
        self._next = 0
        self.home = loops[0]
        # out of file descriptors: not watched for a back-off, logged at most once a second
        self._backoff_s = 0.0
        self._failures = 0
        self._logged_at = 0.0
        self.admission = Admission("TCP", TCP_RESERVE,
                                   int(self.home.options.max_connections))

    def start(self) -> None:
        self.home.call_soon_threadsafe(self._register)

    def _register(self) -> None:
        self.home.selector.register(self.sock, selectors.EVENT_READ, self)

    def on_writable(self) -> None:
        """Never registered for writing (SelectorLoop's Pollable)."""

    def on_readable(self) -> None:
        for _ in range(ACCEPTS_PER_TURN):
            try:
                sock, addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self._accept_failed(e)
                return
            if self._backoff_s:
                log.info("TCP: accepting again after %d failed accepts", self._failures)
                self._backoff_s, self._failures = 0.0, 0
            why = self.admission.check(sock, sum(len(lp.connections) for lp in self.loops))
            if why is not None:
                _refuse(sock, b"E_INVALID too many connections")
                continue
            loop = self.loops[self._next % len(self.loops)]
            self._next += 1
            if loop is self.home:
                loop.add_connection(sock, addr)
            else:
                loop.call_soon_threadsafe(loop.add_connection, sock, addr)

    @property
    def refused(self) -> int:
        return self.admission.refused

    def _accept_failed(self, e: OSError) -> None:
        """EMFILE/ENFILE and friends: the pending connection stays in the backlog, so
        the listener would be readable again at once and spin. Stop watching it for a
        back-off (100 ms, doubling to 1 s), then try again; log at most once a second."""
        self._failures += 1
        now = time.monotonic()
        if now - self._logged_at >= 1.0:
            self._logged_at = now
            log.error("TCP: accept failed: %s (%d times; backing off %.1fs)", e.strerror,
                      self._failures, min(max(self._backoff_s * 2, 0.1), 1.0))
        self._backoff_s = min(max(self._backoff_s * 2, 0.1), 1.0)
        try:
            self.home.selector.unregister(self.sock)
        except (KeyError, ValueError):
            return
        self.home.call_later(int(self._backoff_s * 1e9), self._resume)

    def _resume(self) -> None:
        if not self.closed:
            try:
                self.home.selector.register(self.sock, selectors.EVENT_READ, self)
            except (KeyError, ValueError):
                pass

    def close(self, reason: str = "") -> None:
        """Stop accepting (runs on the home loop)."""
        if self.closed:
            return
        self.closed = True
        log.info("TCP: closing %s", format_addr(self.sock))
        try:
            self.home.selector.unregister(self.sock)
        except (KeyError, ValueError):
            pass
        self.sock.close()


def _refuse(sock: socket.socket, payload: bytes) -> None:
    """One error frame (a new socket's buffer takes it), then close; what the client
    already sent (its magic) is read first, so the close is not a reset that loses it."""
    try:
        sock.setblocking(False)
        sock.send(encode_error(payload))
        sock.recv(4096)
    except OSError:
        pass
    sock.close()
