"""Listener: accepts TCP clients on one loop and hands each to a loop, round-robin."""
from __future__ import annotations

import logging
import selectors
import socket
from typing import Any

log = logging.getLogger("pybroker")


def bind(host: str, port: int, backlog: int = 1024) -> socket.socket:
    """A listening, non-blocking socket (IPv6 when the host is an IPv6 address)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


def format_addr(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Listener:
    """Registered with loops[0]'s selector; ``on_readable`` accepts every waiting client."""

    closed = False

    def __init__(self, sock: socket.socket, loops: list[Any]) -> None:
        self.sock = sock
        self.loops = loops
        self._next = 0
        self.home = loops[0]

    def start(self) -> None:
        self.home.call_soon_threadsafe(self._register)

    def _register(self) -> None:
        self.home.selector.register(self.sock, selectors.EVENT_READ, self)

    def on_readable(self) -> None:
        for _ in range(256):
            try:
                sock, addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EMFILE and friends: log and try again on the next event
                log.error("TCP: accept failed: %s", e.strerror)
                return
            loop = self.loops[self._next % len(self.loops)]
            self._next += 1
            if loop is self.home:
                loop.add_connection(sock, addr)
            else:
                loop.call_soon_threadsafe(loop.add_connection, sock, addr)

    def close(self) -> None:
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
