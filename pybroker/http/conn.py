"""HttpConn: one HTTP client connection — httptools parsing, limits, keep-alive,
pipelining, ordered responses, and a lingering close.

Owned by the HTTP thread (HttpServer). Requests are parsed as bytes arrive (httptools'
callbacks fill a Request) and answered strictly in order: while one waits for a Gather,
later pipelined requests wait in ``queue``. Reading stops while too many requests or
response bytes are waiting, so a client that sends without reading cannot grow memory.

Limits: the request line plus headers may not exceed ``MAX_HEADER_BYTES`` (431, then a
close); a body may not exceed the route's limit, checked against Content-Length as soon
as the headers arrive and while a chunked body streams (413 with nsqd's code, then a
close), except on routes whose handler never reads it (as nsqd's): there the request is
answered as usual, the body dropped unread, and the connection closed after; garbage
gets Go's ``400 Bad Request`` and a close. Deadlines (``expired``):
headers within ``header_timeout``, the whole request within ``request_timeout``, a
response drained within ``request_timeout``, an idle keep-alive connection closed after
``idle_timeout``.

Ownership: every HttpConn belongs to the ``http`` thread (HttpServer's SelectorLoop);
work for the event loops leaves as a Gather and its results come back through the
HTTP thread's call queue.
"""
from __future__ import annotations

import logging
import socket
import time
from collections import deque
from typing import TYPE_CHECKING

import httptools

from pybroker.http.gather import Gather
from pybroker.http.request import Request, split_url
from pybroker.http.response import (
    CONTINUE,
    Response,
    closing,
    encode,
    error,
    plain_error,
    tls_required,
)
from pybroker.server.sockio import scratch, send_some

if TYPE_CHECKING:
    from pybroker.http.views import ConnServer

log = logging.getLogger("pybroker")
monotonic_ns = time.monotonic_ns
# one read: under glibc's mmap threshold, and read into a buffer the thread keeps
# (docs/io.md), so a request of a few hundred bytes allocates nothing this big
RECV_SIZE = 64 * 1024
MAX_HEADER_BYTES = 64 * 1024
MAX_QUEUED = 64  # pipelined requests waiting before reading stops
TURN_BUDGET = 64  # requests answered per connection per turn, so one cannot starve others
HIGH_WATER = 4 * 1024 * 1024  # response bytes waiting before reading stops
LINGER_NS = 2_000_000_000  # after a close-response: wait this long for the peer's EOF
LINGER_BYTES = 16 * 1024 * 1024




class _HeaderTooLarge(Exception):
    pass


class HttpConn:
    """See the module docstring. Every method runs on the HTTP thread."""

    def __init__(self, server: ConnServer[HttpConn], sock: socket.socket,
                 addr: tuple[str, int] | tuple[str, int, int, int] | str) -> None:
        self.server = server
        self.sock = sock
        self.remote = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
        self.parser = httptools.HttpRequestParser(self)
        # Go's server accepts a bare LF as a line end; so do we
        self.parser.set_dangerous_leniencies(lenient_optional_cr_before_lf=True)
        self.cur: Request | None = None
        self.discard = False  # rest of the current message is being skipped
        self.queue: deque[Request] = deque()
        self.busy = False
        self.out: list[bytes] = []
        self.out_bytes = 0
        self.write_blocked = False  # the last flush left bytes behind: wait for EVENT_WRITE
        self.events = 0
        self.closed = False
        self.tls = False  # accepted on the HTTPS listener
        self.close_after = False  # no more requests: close once the output is flushed
        self.eof = False
        self.lingering = False
        self.linger_left = LINGER_BYTES
        now = monotonic_ns()
        self.last_io_ns = now  # last request completed, response byte sent, or linger start

    def __repr__(self) -> str:
        return f"http({self.remote})"

    # -- httptools callbacks ------------------------------------------------------------
    def on_message_begin(self) -> None:
        self.cur = Request(monotonic_ns())

    def on_url(self, url: bytes) -> None:
        r = self.cur
        assert r is not None
        r.url += url
        r.header_bytes += len(url)
        if r.header_bytes > MAX_HEADER_BYTES:
            raise _HeaderTooLarge()

    def on_header(self, name: bytes, value: bytes) -> None:
        r = self.cur
        assert r is not None
        r.header_bytes += len(name) + len(value) + 4
        if r.header_bytes > MAX_HEADER_BYTES:
            raise _HeaderTooLarge()
        n = len(name)
        if n == 14 and name.lower() == b"content-length":
            try:
                r.content_length = int(value)
            except ValueError:
                pass  # the parser rejects it
        elif n == 4 and name.lower() == b"host":
            r.has_host = True
        elif n == 6 and name.lower() == b"expect" and value.lower() == b"100-continue":
            r.expect_continue = True

    def on_headers_complete(self) -> None:
        r = self.cur
        assert r is not None
        p = self.parser
        r.method = p.get_method()
        r.version = p.get_http_version()
        r.keep_alive = p.should_keep_alive()
        r.path, r.query = split_url(r.url)
        r.headers_done = True
        if r.version not in ("1.0", "1.1"):
            r.reject = (plain_error(505, "unsupported protocol version")
                        if r.version >= "2" else plain_error(400, "malformed HTTP version"))
        elif r.version == "1.1" and not r.has_host:
            r.reject = plain_error(400, "missing required Host header")  # as Go's server
        else:
            r.limit, r.over_limit = self.server.router.limit(r.method, r.path)
            if r.content_length > r.limit:
                self._past_limit(r)                   # decided before the body is read
                return
            elif r.expect_continue and r.version == "1.1" and self._idle():
                self._write(CONTINUE)
        if r.reject is not None:
            self._queue_current()
            self.discard = True

    def _past_limit(self, r: Request) -> None:
        """A body larger than the route keeps: the rest of it is dropped unread, the
        request answered now, then the connection closed: refused with the route's
        answer, or, on a route whose handler never reads it (``over_limit`` None),
        answered as usual."""
        r.body = []
        if r.over_limit is None:
            r.keep_alive = False
        else:
            r.reject = closing(r.over_limit)
        self._queue_current()
        self.discard = True

    def on_body(self, data: bytes) -> None:
        if self.discard:
            return
        r = self.cur
        assert r is not None
        r.body_len += len(data)
        if r.body_len > r.limit:
            self._past_limit(r)               # a chunked body grew past the limit
            return
        r.body.append(data)

    def on_message_complete(self) -> None:
        if self.discard:
            self.discard = False
            self.cur = None
            return
        self._queue_current()

    def _queue_current(self) -> None:
        r = self.cur
        assert r is not None
        self.queue.append(r)
        self.cur = None
        self.last_io_ns = monotonic_ns()

    def _idle(self) -> bool:
        return not self.queue and not self.busy and not self.out

    # -- reading ------------------------------------------------------------------------
    def on_writable(self) -> None:
        if not self.closed:
            self.flush()

    def on_readable(self) -> None:
        """Receive into the thread's kept buffer and parse (httptools copies what it
        hands to the callbacks, so nothing keeps a view of the buffer)."""
        buf = scratch(RECV_SIZE)
        pending = getattr(self.sock, "pending", None)   # TLS: records decrypted already
        while True:
            try:
                n = self.sock.recv_into(buf)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self.close()
                return
            if not self._received(buf[:n]):
                return
            # a full buffer may leave at most one TLS record's plaintext decrypted
            if n < len(buf) or pending is None or not pending():
                return

    def _received(self, data: memoryview) -> bool:
        """Handle one read; False when nothing more should be read now."""
        if self.lingering:
            self.linger_left -= len(data)
            if not data or self.linger_left < 0:
                self.close()
            return False
        if self.eof:
            return False  # no more requests are read from this connection
        if not data:
            self.eof = True
            if self._idle():
                self.close()
            else:
                self.server.update_events(self)  # answer what was asked, then close
            return False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as e:
            if isinstance(e.__context__, _HeaderTooLarge):
                self._fail(plain_error(431))
            else:
                log.error("%r: error while parsing a request", self, exc_info=e.__context__)
                self._fail(plain_error(400))
        except httptools.HttpParserUpgrade:
            # Upgrade (websocket, h2c) is not served: answer what was parsed, then close
            self._fail(None)
        except httptools.HttpParserError:
            self._fail(plain_error(400))
        self.process()
        return not self.eof and not self.closed

    def _fail(self, response: Response | None) -> None:
        """Stop parsing: queue a final answer (after those already due), then close."""
        if response is not None:
            r = self.cur or Request(monotonic_ns())
            r.reject = response
            r.keep_alive = False
            if self.cur is not None:
                self.cur = None
            self.queue.append(r)
        self.cur = None
        self.discard = True
        self.eof = True  # read no more requests from this connection

    # -- answering -----------------------------------------------------------------------
    def process(self) -> None:
        """Answer queued requests in order until one waits for the event loops."""
        server = self.server
        budget = TURN_BUDGET
        while self.queue and not self.busy and not self.closed and not self.close_after:
            if budget == 0:
                server.to_process[self] = None  # carry on next turn
                break
            budget -= 1
            r = self.queue.popleft()
            if r.reject is not None:
                self.respond(r, r.reject)
                continue
            if server.tls_required and not self.tls:
                self.respond(r, tls_required(server.https_port))
                continue
            handler, answer, param = server.router.resolve(r.method, r.path, r.query)
            if handler is None:
                assert answer is not None
                self.respond(r, answer)
                continue
            r.param = param
            try:
                result = handler(r)
            except Exception:
                log.exception("%r: %s %s failed", self, r.method.decode(), r.path)
                result = error(500, "INTERNAL_ERROR")
            if isinstance(result, Gather):
                self.busy = True
                server.submit(self, r, result)
                break
            self.respond(r, result)
        if self.eof and not self.queue and not self.busy:
            self.close_after = True
        server.update_events(self)
        if self.close_after and not self.out and not self.busy and not self.lingering:
            self._begin_linger()

    def respond(self, r: Request, resp: Response) -> None:
        """Queue the encoded answer to r (the next one due on this connection)."""
        server = self.server
        server.count(resp.status, r, self.remote)
        self._write(encode(resp, server.dates.get(), r.version, r.keep_alive,
                           head=r.method == b"HEAD"))
        if resp.close or not r.keep_alive:
            self.close_after = True
            self.queue.clear()
            self.eof = True

    def complete(self, r: Request, resp: Response) -> None:
        """A Gather finished: answer r, then carry on with the queued requests."""
        self.busy = False
        if self.closed:
            return
        self.respond(r, resp)
        self.process()

    def _write(self, data: bytes) -> None:
        self.out.append(data)
        self.out_bytes += len(data)
        self.server.to_flush[self] = None

    # -- writing ------------------------------------------------------------------------
    def flush(self) -> None:
        if self.closed or not self.out:
            return
        result = send_some(self.sock, self.out, repr(self))
        if result is None:
            self.close()
            return
        rest, sent = result
        if sent:
            self.last_io_ns = monotonic_ns()
        if rest:
            self.out = [rest]
            self.out_bytes = len(rest)
            self.write_blocked = True
        else:
            self.out = []
            self.out_bytes = 0
            self.write_blocked = False
            if not self.busy and not self.queue and (self.close_after or self.eof):
                self._begin_linger()
                return
        self.server.update_events(self)

    def _begin_linger(self) -> None:
        """Half-close and read until the peer's EOF, so unread request bytes do not turn
        our close into a reset that destroys the answer before the client reads it."""
        if self.closed:
            return
        self.lingering = True
        self.last_io_ns = monotonic_ns()
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self.close()
            return
        self.server.update_events(self)

    def wanted_events(self) -> int:
        """Selector events this connection needs now (1 = read, 2 = write)."""
        if self.closed:
            return 0
        if self.lingering:
            return 1
        # write interest only while the socket is full (a syscall saved per answer)
        ev = 2 if self.write_blocked else 0
        if not self.eof and not self.close_after and len(self.queue) < MAX_QUEUED \
                and self.out_bytes < HIGH_WATER:
            ev |= 1
        return ev

    def expired(self, now_ns: int) -> str | None:
        """Why this connection has overstayed (a deadline passed), or None."""
        s = self.server
        if self.lingering:
            return "linger" if now_ns - self.last_io_ns > LINGER_NS else None
        r = self.cur
        if r is not None and not self.discard:
            if not r.headers_done:
                return "header timeout" if now_ns - r.begin_ns > s.header_timeout_ns else None
            return "request timeout" if now_ns - r.begin_ns > s.request_timeout_ns else None
        if self.out:
            return "write timeout" if now_ns - self.last_io_ns > s.request_timeout_ns else None
        if self.busy or self.queue:
            return None
        return "idle" if now_ns - self.last_io_ns > s.idle_timeout_ns else None

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.out = []
        self.queue.clear()
        self.server.forget(self)
        try:
            self.sock.close()
        except OSError:
            pass
