"""HttpServer: nsqd's HTTP API on ``http_address``, served by one ``http`` thread.

Theory of operation
-------------------
One thread owns a selector, the listening socket, every HttpConn and a wake-up
socketpair; no asyncio and no thread per request. One turn: ``select()`` (at most until
the next deadline sweep); accept, read (parse, answer) and write; carry on with
connections that used up their per-turn budget of answers (``TURN_BUDGET``, so a
pipelining client cannot starve the others); run calls posted from other threads
(results of loop jobs); flush the connections that have output (a publish has
appended to and written its topic's log, and woken the channels' loops, before its
"OK" is queued); every ``SWEEP_S`` finish Gathers whose loops did not
answer in time, and every few sweeps close connections whose deadline passed.

The HTTP thread never blocks on an event loop: a request that needs loop threads
(stats, channel pause/empty) is a Gather whose jobs are posted with the loops'
``call_soon_threadsafe``; each job posts its result back here, and the request is
answered when the last one arrives (or at its deadline). Other requests on other
connections go on meanwhile, and so does the TCP side.
"""
from __future__ import annotations

import functools
import itertools
import logging
import selectors
import socket
import time
from typing import TYPE_CHECKING, Any

from pybroker.config import TLS_REQUIRED
from pybroker.evloop import SelectorLoop
from pybroker.http.api import Api, build_router
from pybroker.http.conn import HttpConn
from pybroker.http.gather import MISSING, Gather, Posted, Poster, run_jobs
from pybroker.http.process import GcPauses
from pybroker.http.request import Request
from pybroker.http.reader import MAX_FINISHES
from pybroker.http.response import DateCache, Response, error
from pybroker.http.statstext import go_duration
from pybroker.http.views import HttpFigures
from pybroker.server.listener import HTTP_RESERVE, Admission
from pybroker.server.sockets import bind_address
from pybroker.server.services import HttpHost

if TYPE_CHECKING:
    from pybroker.http.statsd import StatsdPusher

log = logging.getLogger("pybroker")
monotonic_ns = time.monotonic_ns
SWEEP_S = 0.1
CONN_SWEEP_EVERY = 5  # connection deadlines are checked every 5th sweep
MAX_CONNECTIONS = 10_000
_UNAVAILABLE = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\n"
                b"Content-Length: 20\r\nConnection: close\r\n\r\nTOO_MANY_CONNECTIONS")
# matches nsqd: /pub and /mpub are not logged (hot paths); other requests are
_QUIET = frozenset({"/pub", "/mpub", "/metrics"})


class _Pending:
    __slots__ = ("conn", "deadline_ns", "gather", "remaining", "req", "results")

    def __init__(self, conn: HttpConn, req: Request, gather: Gather[Response]) -> None:
        self.conn = conn
        self.req = req
        self.gather = gather
        self.results: list[object] = [MISSING] * len(gather.jobs)
        self.remaining = len(gather.jobs)
        self.deadline_ns = monotonic_ns() + int(gather.timeout_s * 1e9)


class _Accepting:
    """A listening socket in the selector: readable means clients to accept."""

    __slots__ = ("server", "https")

    def __init__(self, server: "HttpServer", https: bool) -> None:
        self.server = server
        self.https = https

    def on_readable(self) -> None:
        self.server._accept(self.https)

    def on_writable(self) -> None:
        """Never registered for writing."""

    def close(self) -> None:
        """Listeners are closed by HttpServer._close_all."""


class HttpServer(SelectorLoop):
    """The ``http`` thread's SelectorLoop (pybroker.evloop)."""

    def __init__(self, runtime: HttpHost) -> None:
        super().__init__("http")
        self.runtime = runtime
        o = runtime.options
        self.options = o
        # slowloris limits, from nsqd's client_timeout (nsqd's HTTP server has none)
        self.request_timeout_ns = int(o.client_timeout)
        self.header_timeout_ns = min(int(o.client_timeout), 10_000_000_000)
        self.idle_timeout_ns = int(o.client_timeout)
        self.api = Api(runtime, self)
        self.router = build_router(self.api)
        self.dates = DateCache()
        self._listening = _Accepting(self, False)
        self.sock: socket.socket | None = None
        self.https_sock: socket.socket | None = None
        self.https_port = 0
        # matches nsqd: tls_required=true (not tcp-https) refuses plain HTTP requests
        self.tls_required = int(o.tls_required) == TLS_REQUIRED
        self.port = 0
        self.tcp_port = 0
        self.address = ""
        self.started_at = time.time()
        self.conns: set[HttpConn] = set()
        self.to_flush: dict[HttpConn, None] = {}
        self.to_process: dict[HttpConn, None] = {}  # out of budget last turn
        self._pending: dict[int, _Pending] = {}
        # this turn's Gather jobs, posted at its end: one call per loop per turn
        self._outbox: dict[Poster, list[Posted]] = {}
        self._tokens = itertools.count(1)
        self.requests: dict[int, int] = {}
        self._sweeps = 0
        self._accept_paused = False
        self._accept_failures = 0
        self._accept_logged = 0.0
        # the descriptor reserve (smaller than TCP's, so /ping answers when TCP refuses)
        # and MAX_CONNECTIONS; see pybroker.server.listener.Admission
        self.admission = Admission("HTTP", HTTP_RESERVE, MAX_CONNECTIONS)
        self.statsd: StatsdPusher | None = None

    # -- lifecycle ------------------------------------------------------------------------
    def listen(self, sock: socket.socket | None = None,
               https_sock: socket.socket | None = None) -> str:
        """Serve the listening sockets (bound here when not given) and start the ``http``
        thread; returns "host:port". Raises OSError."""
        self.sock = sock if sock is not None else bind_address(self.options.http_address)
        host, port = self.sock.getsockname()[:2]
        self.port = port
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        listener = self.runtime.listener
        if listener is not None:
            self.tcp_port = listener.sock.getsockname()[1]
        GcPauses.install()
        self.selector.register(self.sock, selectors.EVENT_READ, self._listening)
        ctx = self.runtime.tls_context
        if ctx is not None and self.options.https_address:
            # matches nsqd: HTTPS listens only when TLS is configured
            self.https_sock = (https_sock if https_sock is not None
                               else bind_address(self.options.https_address))
            host, port = self.https_sock.getsockname()[:2]
            self.https_port = port
            log.info("HTTPS: listening on %s", f"[{host}]:{port}" if ":" in host else
                     f"{host}:{port}")
            self.selector.register(self.https_sock, selectors.EVENT_READ,
                                   _Accepting(self, True))
        self.call_later(int(SWEEP_S * 1e9), self._sweep_tick)
        self.start()
        if self.options.statsd_address:
            from pybroker.http.statsd import StatsdPusher

            self.statsd = StatsdPusher(self.runtime, self)
            self.statsd.start()
        return self.address

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop accepting, close every HTTP connection, join the thread (any thread)."""
        if self.statsd is not None:
            self.statsd.stop(timeout_s)
        SelectorLoop.stop(self)
        if self.thread is not None:
            self.thread.join(timeout_s)
            if self.thread.is_alive():
                log.error("HTTP: the http thread did not stop within %.0fs", timeout_s)
                return
        self.api.reader.stop(timeout_s)   # after the http thread: nothing submits now
        self.close()

    # -- the loop (SelectorLoop hooks) -------------------------------------------------
    def busy(self) -> bool:
        return bool(self.to_process)

    def end_of_turn(self) -> None:
        if self.to_process:
            again = self.to_process
            self.to_process = {}
            for conn in again:
                if not conn.closed:
                    conn.process()
        self._flush()
        if self._outbox:
            outbox, self._outbox = self._outbox, {}
            for loop, jobs in outbox.items():
                loop.call_soon_threadsafe(run_jobs, jobs)

    def on_error(self, obj: object) -> None:
        log.exception("%r: unexpected error; closing the connection", obj)
        if isinstance(obj, (HttpConn, _Accepting)):   # the only objects registered here
            obj.close()

    def on_exit(self) -> None:
        self._close_all()

    def on_crash(self) -> None:
        log.error("HTTP: the http thread crashed")
        self.runtime.request_stop()
        self._close_all()

    def _sweep_tick(self) -> None:
        try:
            self._sweep()
        finally:
            self.call_later(int(SWEEP_S * 1e9), self._sweep_tick)

    def _flush(self) -> None:
        while self.to_flush:
            conns = self.to_flush
            self.to_flush = {}
            for conn in conns:
                if not conn.closed:
                    conn.flush()  # may answer more queued requests (and publish)

    def _accept(self, https: bool = False) -> None:
        listener = self.https_sock if https else self.sock
        assert listener is not None
        for _ in range(64):
            try:
                sock, addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                # EMFILE and friends: the connection stays in the backlog, so the socket
                # stays readable: stop watching it until the next sweep (no spinning),
                # and log at most once a second
                self._accept_failures += 1
                now = time.monotonic()
                if now - self._accept_logged >= 1.0:
                    self._accept_logged = now
                    log.error("HTTP: accept failed: %s (%d times)", e.strerror,
                              self._accept_failures)
                if not self._accept_paused and self.sock is not None and not https:
                    self._accept_paused = True
                    self.selector.unregister(self.sock)
                return
            if self.admission.check(sock, len(self.conns)) is not None:
                try:  # a new socket's buffer takes this at once
                    sock.setblocking(False)
                    sock.send(_UNAVAILABLE)
                except OSError:
                    pass
                sock.close()
                continue
            sock.setblocking(False)
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
            if https:
                ctx = self.runtime.tls_context
                assert ctx is not None   # HTTPS listens only with a TLS context
                from pybroker.server.tls import TlsSocket  # with tls_cert only (ssl)

                # socket.socket's manners, not its class (HttpConn and send_some take one)
                tls_sock: Any = TlsSocket(ctx, sock)
                conn = HttpConn(self, tls_sock, addr)
                conn.tls = True
            else:
                conn = HttpConn(self, sock, addr)
            self.conns.add(conn)
            conn.events = selectors.EVENT_READ
            self.selector.register(conn.sock, selectors.EVENT_READ, conn)

    def _sweep(self) -> None:
        now = monotonic_ns()
        self._sweeps += 1
        if self._accept_paused and self.sock is not None:
            self._accept_paused = False
            self.selector.register(self.sock, selectors.EVENT_READ, self._listening)
        if self._sweeps % CONN_SWEEP_EVERY == 0:  # deadlines are seconds: 0.5 s is precise enough
            for conn in list(self.conns):
                why = conn.expired(now)
                if why is not None:
                    if why != "linger":
                        log.info("HTTP: closing %s (%s)", conn.remote, why)
                    conn.close()
        for token, p in list(self._pending.items()):
            if now >= p.deadline_ns:
                log.warning("HTTP: %s %s: event loops did not answer within %.1fs",
                            p.req.method.decode(), p.req.path, p.gather.timeout_s)
                self._finish(token)

    def _close_all(self) -> None:
        if self.sock is not None:
            log.info("HTTP: closing %s", self.address)
            try:
                self.selector.unregister(self.sock)
            except (KeyError, ValueError):
                pass
            self.sock.close()
        if self.https_sock is not None:
            try:
                self.selector.unregister(self.https_sock)
            except (KeyError, ValueError):
                pass
            self.https_sock.close()
        for conn in list(self.conns):
            conn.close()

    # -- used by connections --------------------------------------------------------------
    def update_events(self, conn: HttpConn) -> None:
        want = conn.wanted_events()
        if want == conn.events or conn.closed:
            return
        try:
            if conn.events == 0:
                self.selector.register(conn.sock, want, conn)
            elif want == 0:
                self.selector.unregister(conn.sock)
            else:
                self.selector.modify(conn.sock, want, conn)
        except (KeyError, ValueError, OSError):
            return
        conn.events = want

    def forget(self, conn: HttpConn) -> None:
        self.conns.discard(conn)
        self.to_flush.pop(conn, None)
        self.to_process.pop(conn, None)
        if conn.events:
            try:
                self.selector.unregister(conn.sock)
            except (KeyError, ValueError, OSError):
                pass
            conn.events = 0

    def count(self, status: int, r: Request, remote: str) -> None:
        """Count an answer; log it as nsqd's Log decorator does (not /pub, /mpub)."""
        self.requests[status] = self.requests.get(status, 0) + 1
        if r.path not in _QUIET and r.method:
            log.info("%d %s %s (%s) %s", status, r.method.decode(), r.url.decode("latin-1"),
                     remote, go_duration(monotonic_ns() - r.begin_ns))

    def figures(self) -> HttpFigures:
        listener = self.runtime.listener
        return {"connections": len(self.conns), "requests": dict(self.requests),
                "refused": {"tcp": listener.refused if listener is not None else 0,
                            "http": self.admission.refused},
                "turns": self.turn_times.copy()}

    def submit(self, conn: HttpConn, req: Request, gather: Gather[Response]) -> None:
        """Queue gather's jobs for their loops (posted at the end of this turn, one call
        per loop for all of the turn's requests); conn.complete() runs when all
        answered."""
        token = next(self._tokens)
        self._pending[token] = _Pending(conn, req, gather)
        if not gather.jobs:
            self.call_soon_threadsafe(self._finish, token)
            return
        for i, (loop, fn, args) in enumerate(gather.jobs):
            deliver = functools.partial(self._deliver, token, i)
            self._outbox.setdefault(loop, []).append((fn, args, deliver))

    def _deliver(self, token: int, index: int, value: object) -> None:
        # on a loop thread: hand the result to the http thread
        self.call_soon_threadsafe(self._job_done, token, index, value)

    def _job_done(self, token: int, index: int, value: object) -> None:
        p = self._pending.get(token)
        if p is None:
            return  # finished at its deadline already
        p.results[index] = value
        p.remaining -= 1
        if p.remaining <= 0:
            self._finish(token)

    def _finish(self, token: int) -> None:
        p = self._pending.pop(token, None)
        if p is None:
            return
        reader = self.api.reader
        if p.gather.off_thread:
            # a long finish (/stats and /metrics: planned, gathered and encoded there)
            # on the log reader's thread, never here: this one goes on serving (/ping
            # waited up to 155 ms behind a /stats of 10,000 topics); the answer comes
            # back here (_complete). The reader's queue full: refused as a read is.
            if reader.busy(MAX_FINISHES):
                self._complete(p, error(503, "TOO_MANY_READS"))
                return
            try:
                reader.call_soon_threadsafe(self._finish_there, p)
            except RuntimeError:
                self._complete(p, error(503, "EXITING"))
            return
        self._complete(p, self._answer(p))

    @staticmethod
    def _answer(p: _Pending) -> Response:
        try:
            return p.gather.finish(p.results)
        except Exception:
            log.exception("HTTP: %s %s failed", p.req.method.decode(), p.req.path)
            return error(500, "INTERNAL_ERROR")

    def _finish_there(self, p: _Pending) -> None:
        """On the log reader's thread."""
        self.call_soon_threadsafe(self._complete, p, self._answer(p))

    @staticmethod
    def _complete(p: _Pending, resp: Response) -> None:
        p.conn.complete(p.req, resp)

    def statsd_prefix(self) -> str:
        """statsd_prefix with nsqd's expansion: %s -> broadcast host_port, and a final dot."""
        prefix = str(self.options.statsd_prefix)
        if not prefix:
            return ""
        # matches nsqd: the host key's port is broadcast_http_port when set
        port = getattr(self.options, "broadcast_http_port", 0) or self.port
        host_key = f"{self.options.broadcast_address}:{port}".replace(".", "_")
        prefix = prefix.replace("%s", host_key.replace(":", "_"))
        return prefix if prefix.endswith(".") else prefix + "."
