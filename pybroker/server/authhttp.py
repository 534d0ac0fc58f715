"""AuthClient: the auth servers' HTTP requests, non-blocking, on one ``auth`` loop thread.

Why a selector loop and not a pool of threads: a request that waits on a slow server
holds whatever runs it. With a fixed pool, 32 slow answers fill it and every other
client's AUTH waits behind them (head-of-line), even against a fast server; a pool per
server still queues a fast answer behind slow ones from the same server (a server slow
for some secrets only). Here a request is a socket in a selector and a deadline in a
timer heap: any number wait on slow answers while the others come back at once, and
one thread serves them all (pybroker.evloop.SelectorLoop, like every loop here).

Budgets (nsqd's QueryAnyAuthd and http_api client): each server is asked in turn from
a random start; each attempt has one deadline, ``http_client_request_timeout`` from its
start, covering connect, TLS, sending and the whole answer (a trickling server cannot
stretch it), and its connect must also finish within ``http_client_connect_timeout``.
An answer is at most ``MAX_RESPONSE`` bytes. At most ``MAX_IN_FLIGHT`` attempts are
open at once (each holds a descriptor); queries past that wait in order, and fail if
their own request timeout passes first. Host names are resolved on two small resolver
threads (cached ``DNS_TTL_S``), so a slow resolver delays only queries that need it.

The answer is parsed (JSON, RE2 patterns: server.grants) on this thread; ``done(state,
error)`` then runs on the asking client's loop (``call_soon_threadsafe``).
"""
from __future__ import annotations

import errno
import ipaddress
import logging
import os
import random
import selectors
import socket
import ssl
import time
import urllib.parse
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable, Protocol, Unpack

import httptools

from pybroker import __version__
from pybroker.evloop import SelectorLoop, Ts

if TYPE_CHECKING:
    from pybroker.config import Options
    from pybroker.server.authstate import AuthState

log = logging.getLogger("pybroker")
monotonic_ns = time.monotonic_ns
MAX_RESPONSE = 1 << 20     # bytes of one answer, headers included
MAX_IN_FLIGHT = 256        # attempts open at once
DNS_TTL_S = 30.0
Done = Callable[["AuthState | None", str], None]


class Poster(Protocol):
    """The asking client's loop, as far as an answer needs it."""

    def call_soon_threadsafe(self, fn: Callable[[Unpack[Ts]], object],
                             *args: Unpack[Ts]) -> None: ...


# one getaddrinfo result: family, type, proto, canonname, sockaddr
AddrInfo = tuple[int, int, int, str,
                 "tuple[str, int] | tuple[str, int, int, int] | tuple[int, bytes]"]


class AttemptFailed(Exception):
    """One server's attempt failed; the text is what nsqd would log."""


class _Query:
    """One AUTH: the servers in turn until one answers."""

    __slots__ = ("loop", "params", "done", "order", "errors", "queued_until")

    def __init__(self, loop: Poster, params: str, done: Done,
                 order: list[str]) -> None:
        self.loop = loop          # the asking client's EventLoop
        self.params = params
        self.done = done
        self.order = order        # the addresses still to ask
        self.errors: list[str] = []
        self.queued_until = 0


class _Attempt:
    """One HTTP/1.1 exchange with one auth server: a Pollable of the auth loop."""

    def __init__(self, client: "AuthClient", q: _Query, addr: str) -> None:
        self.client = client
        self.q = q
        self.addr = addr
        url = addr if "://" in addr else f"http://{addr}/auth"
        parts = urllib.parse.urlsplit(url)
        self.https = parts.scheme == "https"
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if self.https else 80)
        path = parts.path or "/"
        headers = [f"Host: {parts.netloc}", "Accept: application/vnd.nsq; version=1.0",
                   f"User-Agent: pybroker/{__version__}", "Connection: close"]
        body = b""
        if client.method == "post":
            body = q.params.encode()
            headers += ["Content-Type: application/x-www-form-urlencoded",
                        f"Content-Length: {len(body)}"]
        else:
            path += "?" + (parts.query + "&" if parts.query else "") + q.params
        self.out = (f"{client.method.upper()} {path} HTTP/1.1\r\n" + "\r\n".join(headers)
                    + "\r\n\r\n").encode() + body
        now = monotonic_ns()
        self.deadline = now + client.request_timeout_ns
        self.connect_deadline = now + min(client.connect_timeout_ns, client.request_timeout_ns)
        self.sock: socket.socket | None = None
        self.tls_sock: ssl.SSLSocket | None = None   # the same socket, once TLS wraps it
        self.state = "resolve"
        self.events = 0
        self.timer: object = None   # the deadline's handle on the auth loop
        self.received = 0
        self.status = 0
        self.reason = b""
        self.body: list[bytes] = []
        self.length = -1
        self.complete = False
        self.headers_done = False
        self.parser = httptools.HttpResponseParser(self)

    # -- httptools callbacks ------------------------------------------------------------
    def on_status(self, status: bytes) -> None:
        self.reason += status

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-length":
            try:
                self.length = int(value)
            except ValueError:
                pass

    def on_headers_complete(self) -> None:
        self.headers_done = True
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.complete = True

    # -- steps -------------------------------------------------------------------------
    @property
    def _sock(self) -> socket.socket:
        assert self.sock is not None, "no socket yet"
        return self.sock

    def connect(self, addrinfo: AddrInfo) -> None:
        family, _, _, _, sockaddr = addrinfo
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        self.sock = sock
        err = sock.connect_ex(sockaddr)
        if err not in (0, errno.EINPROGRESS, errno.EAGAIN):
            raise AttemptFailed(self._dial_error(err))
        self.state = "connect"
        self.want(socket_write=True)

    def _dial_error(self, err: int) -> str:
        return f"dial tcp {self.host}:{self.port}: connect: {os.strerror(err).lower()}"

    def on_writable(self) -> None:
        self.client.step(self, self._writable)

    def on_readable(self) -> None:
        self.client.step(self, self._readable)

    def _writable(self) -> None:
        if self.state == "connect":
            err = self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                raise AttemptFailed(self._dial_error(err))
            if self.https:
                self.sock = self.tls_sock = self.client.ssl_context.wrap_socket(
                    self._sock, server_hostname=self.host, do_handshake_on_connect=False)
                self.state = "handshake"
                self._handshake()
                return
            self.state = "send"
        if self.state == "handshake":
            self._handshake()
        elif self.state == "send":
            self._send()

    def _readable(self) -> None:
        if self.state == "handshake":
            self._handshake()
            return
        if self.state != "recv":
            return
        while True:
            try:
                data = self._sock.recv(65536)
            except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                return
            except ssl.SSLError as e:
                raise AttemptFailed(f"tls: {e.reason or e}") from None
            except OSError as e:
                raise AttemptFailed(f"read: {e.strerror or e}") from None
            if not data:
                self._at_eof()
                return
            self.received += len(data)
            if self.received > MAX_RESPONSE:
                raise AttemptFailed(f"response larger than {MAX_RESPONSE} bytes")
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserError as e:
                raise AttemptFailed(f"malformed HTTP response ({e})") from None
            if self.complete:
                self.client.answered(self)
                return

    def _at_eof(self) -> None:
        if self.headers_done and self.length < 0:
            self.complete = True  # a body delimited by the close
            self.client.answered(self)
            return
        raise AttemptFailed("unexpected EOF")

    def _handshake(self) -> None:
        try:
            assert self.tls_sock is not None
            self.tls_sock.do_handshake()
        except ssl.SSLWantReadError:
            self.want(socket_write=False)
            return
        except ssl.SSLWantWriteError:
            self.want(socket_write=True)
            return
        except (ssl.SSLError, ssl.CertificateError) as e:
            raise AttemptFailed(f"tls: {getattr(e, 'reason', None) or e}") from None
        self.state = "send"
        self._send()

    def _send(self) -> None:
        while self.out:
            try:
                n = self._sock.send(self.out)
            except (BlockingIOError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
                self.want(socket_write=True)
                return
            except OSError as e:
                raise AttemptFailed(f"write: {e.strerror or e}") from None
            self.out = self.out[n:]
        self.state = "recv"
        self.want(socket_write=False)
        if self.tls_sock is not None and self.tls_sock.pending():
            self._readable()

    def want(self, socket_write: bool) -> None:
        events = selectors.EVENT_WRITE if socket_write else selectors.EVENT_READ
        sel = self.client.selector
        if self.events == 0:
            sel.register(self._sock, events, self)
        elif self.events != events:
            sel.modify(self._sock, events, self)
        self.events = events

    def close(self) -> None:
        if self.sock is not None:
            if self.events:
                try:
                    self.client.selector.unregister(self.sock)
                except (KeyError, ValueError, OSError):
                    pass
                self.events = 0
            try:
                self.sock.close()
            except OSError:
                pass
            self.sock = self.tls_sock = None


class AuthClient(SelectorLoop):
    """The ``auth`` thread. ``query`` may be called from any thread."""

    def __init__(self, options: Options) -> None:
        super().__init__("auth")
        self.addresses: list[str] = list(options.auth_http_addresses)
        self.method = str(options.auth_http_request_method)
        self.connect_timeout_ns = int(options.http_client_connect_timeout)
        self.request_timeout_ns = int(options.http_client_request_timeout)
        ctx = ssl.create_default_context()
        if options.tls_root_ca_file:
            ctx.load_verify_locations(cafile=options.tls_root_ca_file)
        self.ssl_context = ctx
        self.in_flight = 0
        self.queued: deque[_Query] = deque()
        self._resolver = ThreadPoolExecutor(2, thread_name_prefix="auth-dns")
        self._dns: dict[tuple[str, int], tuple[float, AddrInfo]] = {}
        self._attempts: set[_Attempt] = set()
        self.start()

    # -- any thread ----------------------------------------------------------------------
    def query(self, loop: Poster, remote_ip: str, tls: bool, common_name: str, secret: str,
              done: Done) -> None:
        """Ask the servers; ``done(state, error)`` then runs on ``loop``."""
        params = urllib.parse.urlencode(sorted({
            "remote_ip": remote_ip, "tls": "true" if tls else "false", "secret": secret,
            "common_name": common_name}.items()))
        n = len(self.addresses)
        start = random.randrange(n)
        order = [self.addresses[(start + i) % n] for i in range(n)]
        self.call_soon_threadsafe(self._begin, _Query(loop, params, done, order))

    def stop(self, timeout_s: float = 5.0) -> None:
        SelectorLoop.stop(self)
        if self.thread is not None:
            self.thread.join(timeout_s)
        self._resolver.shutdown(wait=False, cancel_futures=True)
        if self.thread is None or not self.thread.is_alive():
            self.close()

    # -- the auth thread -------------------------------------------------------------------
    def on_exit(self) -> None:
        for a in list(self._attempts):
            a.close()
        self._attempts.clear()

    def on_error(self, obj: object) -> None:
        log.exception("auth: unexpected error in %r", obj)
        if isinstance(obj, _Attempt):
            self._failed(obj, "internal error")

    def _begin(self, q: _Query) -> None:
        if self.in_flight >= MAX_IN_FLIGHT:
            q.queued_until = monotonic_ns() + self.request_timeout_ns
            self.queued.append(q)
            return
        self._next(q)

    def _next(self, q: _Query) -> None:
        """Ask q's next server, or answer q with every failure."""
        if not q.order:
            self._answer(q, None, "; ".join(q.errors))
            return
        a = _Attempt(self, q, q.order.pop(0))
        self.in_flight += 1
        self._attempts.add(a)
        a.timer = self.call_later(a.connect_deadline - monotonic_ns(), self._expired, a)
        try:
            ip = ipaddress.ip_address(a.host)
        except ValueError:
            self._resolve(a)
            return
        family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
        self.step(a, lambda: a.connect((family, 0, 0, "", (a.host, a.port))))

    def _resolve(self, a: _Attempt) -> None:
        key = (a.host, a.port)
        hit = self._dns.get(key)
        if hit is not None and hit[0] > time.monotonic():
            self.step(a, lambda: a.connect(hit[1]))
            return

        def lookup() -> None:
            try:
                infos = socket.getaddrinfo(a.host, a.port, type=socket.SOCK_STREAM)
                result: AddrInfo | OSError = infos[0]
            except OSError as e:
                result = e
            self.call_soon_threadsafe(self._resolved, a, result)

        self._resolver.submit(lookup)

    def _resolved(self, a: _Attempt, result: AddrInfo | OSError) -> None:
        if a not in self._attempts:
            return  # its deadline passed meanwhile
        if isinstance(result, OSError):
            self._failed(a, f"dial tcp: lookup {a.host}: {result}")
            return
        self._dns[(a.host, a.port)] = (time.monotonic() + DNS_TTL_S, result)
        if len(self._dns) > 256:
            self._dns.clear()
        self.step(a, lambda: a.connect(result))

    def step(self, a: _Attempt, fn: Callable[[], None]) -> None:
        """Run one step of an attempt; a failure ends the attempt only."""
        if a not in self._attempts:
            return
        try:
            fn()
        except AttemptFailed as e:
            self._failed(a, str(e))
        except OSError as e:
            self._failed(a, e.strerror or str(e))

    def _expired(self, a: _Attempt) -> None:
        if a not in self._attempts:
            return
        now = monotonic_ns()
        if a.state in ("resolve", "connect") and now >= a.connect_deadline:
            self._failed(a, f"dial tcp {a.host}:{a.port}: i/o timeout")
        elif now >= a.deadline:
            self._failed(a, "Client.Timeout exceeded while awaiting or reading the answer")
        else:
            a.timer = self.call_later(a.deadline - now, self._expired, a)

    def _failed(self, a: _Attempt, why: str) -> None:
        self._end(a)
        a.q.errors.append(f"failed to auth against {a.addr} - {why}")
        self._next(a.q)

    def answered(self, a: _Attempt) -> None:
        from pybroker.server.authstate import parse_state

        self._end(a)
        body = b"".join(a.body)
        if a.status != 200:
            why = f"got response {a.status} {a.reason.decode('latin-1')} {body[:200]!r}"
            a.q.errors.append(f"failed to auth against {a.addr} - {why}")
            self._next(a.q)
            return
        try:
            state = parse_state(body)
        except ValueError as e:
            a.q.errors.append(f"failed to auth against {a.addr} - {e}")
            self._next(a.q)
            return
        self._answer(a.q, state, "")

    def _end(self, a: _Attempt) -> None:
        self._attempts.discard(a)
        self.cancel(a.timer)
        a.close()
        self.in_flight -= 1
        now = monotonic_ns()
        while self.queued and self.in_flight < MAX_IN_FLIGHT:
            q = self.queued.popleft()
            if now >= q.queued_until:
                q.errors.append("no auth request slot within http_client_request_timeout")
                self._answer(q, None, "; ".join(q.errors))
                continue
            self._next(q)

    def _answer(self, q: _Query, state: AuthState | None, err: str) -> None:
        q.loop.call_soon_threadsafe(q.done, state, err)
