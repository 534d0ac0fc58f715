"""The listening sockets, bound before anything slow runs, as nsqd binds them in nsqd.New.

What it owns: binding ``tcp_address``, ``http_address`` and (with ``tls_cert``)
``https_address`` in one go, right after the options are resolved and before the server's
modules are imported or the data path is read, so a client that connects during start-up
waits in the listen backlog instead of being refused, and an address in use stops the
start at once. The sockets are handed to the Runtime, which serves them; this module
imports only ``socket`` and the option helpers.
"""
from __future__ import annotations

import socket
from typing import TYPE_CHECKING

from pybroker.config import split_hostport

if TYPE_CHECKING:
    from pybroker.config import Options

BACKLOG = 1024


class StartupError(Exception):
    """Start-up cannot go on (e.g. an address in use); the message says why."""


def bind_address(address: str) -> socket.socket:
    """A listening, non-blocking socket on "host:port" (IPv6 for an IPv6 host). OSError."""
    host, port = split_hostport(address)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


class Bound:
    """The listening sockets of one start (``http``/``https`` None when not configured)."""

    def __init__(self, tcp: socket.socket, http: socket.socket | None,
                 https: socket.socket | None) -> None:
        self.tcp = tcp
        self.http = http
        self.https = https

    def close(self) -> None:
        for s in (self.tcp, self.http, self.https):
            if s is not None:
                s.close()


def bind_listeners(o: Options) -> Bound:
    """Bind every listener the options ask for (nsqd's order: TCP, HTTP, HTTPS).
    Raises StartupError naming the option whose address cannot be used."""
    wanted = [("tcp_address", o.tcp_address), ("http_address", o.http_address or None),
              ("https_address", o.https_address if o.tls_cert and o.https_address else None)]
    socks: list[socket.socket | None] = []
    for key, address in wanted:
        if address is None:
            socks.append(None)
            continue
        try:
            socks.append(bind_address(address))
        except OSError as e:
            for s in socks:
                if s is not None:
                    s.close()
            raise StartupError(f"{key}: cannot listen on {address}: "
                               f"{e.strerror or e}") from None
    tcp, http, https = socks
    assert tcp is not None
    return Bound(tcp, http, https)
