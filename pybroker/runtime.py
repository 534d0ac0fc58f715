"""Runtime: start-up, the threads, signals and shutdown.

Threads: the main thread (waits for SIGTERM/SIGINT), ``loop-N`` event loops (clients and
the channels they own), ``scanner`` and ``scanner-N`` (queue timeouts). The main thread
hands work to no one but the loops' ``call_soon_threadsafe``; shutdown goes through the
loops' wake-up sockets, and every thread is joined with a deadline.

Start-up follows nsqd: the listeners are bound first (server/sockets.py, usually before
this module is even imported), then the data path is locked and restored, then every
listener serves. Modules only some configurations use (TLS, AUTH, the nsqd data importer,
statsd) are imported when configured, so a plain start imports what serving needs.
"""
from __future__ import annotations

import gc
import logging
import resource
import signal
import sys
import threading
from typing import TYPE_CHECKING

from pybroker import NSQ_COMPAT_VERSION, __version__, _native
from pybroker.config import Options
from pybroker.core.broker import Broker
from pybroker.core.channel import Channel
from pybroker.core.topic import Topic
from pybroker.errors import ConfigError
from pybroker.server.listener import Listener, format_addr
from pybroker.server.lookupd import LookupdRegistrar
from pybroker.server.loop import EventLoop
from pybroker.server.scanner import QueueScanner
from pybroker.server.sockets import Bound, StartupError, bind_listeners
from pybroker.server.storage import StorageManager
from pybroker.stopflag import StopFlag
from pybroker.storage import StorageError
from pybroker.storage.lock import DataPathLocked

if TYPE_CHECKING:
    from pybroker.server.services import ClusterHooks
    import socket
    import ssl
    from types import FrameType

    from pybroker.core.seams import Owner

    from pybroker.http.server import HttpServer
    from pybroker.server.authhttp import AuthClient

__all__ = ["Runtime", "StartupError", "run"]

log = logging.getLogger("pybroker")


class Runtime:
    def __init__(self, options: Options, bound: Bound | None = None,
                 banner: str | None = None) -> None:
        self.options = options
        # listeners bound before start-up (server/sockets.py); start() binds them if None
        self.bound = bound
        self.banner = banner or f"pybroker v{__version__} (nsqd protocol v{NSQ_COMPAT_VERSION})"
        self.loops = [EventLoop(i, self) for i in range(options.loop_threads)]
        self.storage = StorageManager(self)
        self.broker = Broker(options, self.loops, self.storage.open_log, self._wake)
        self.scanner = QueueScanner(self.broker, options)
        self.listener: Listener | None = None
        self.http: HttpServer | None = None
        # None while healthy; otherwise why not (e.g. a storage write failure). HTTP /ping
        # answers 500 "NOK - <health>" and /stats reports it, as nsqd's SetHealth does.
        self.health: str | None = None
        self.lookupd: LookupdRegistrar | None = None
        self.tls_context: ssl.SSLContext | None = None  # tls_cert + tls_key (TCP and HTTPS)
        self.auth: AuthClient | None = None  # when auth_http_addresses is set
        # replication (pybroker.cluster), only when cluster_etcd is set: nothing of it
        # is imported otherwise
        self.cluster: ClusterHooks | None = None
        self._stop = StopFlag()     # set by the signal handlers: no lock

    # -- waking channels for publishers that are not loop threads (HTTP, start-up) ------
    def _wake(self, chans: list[Channel]) -> None:
        current = threading.current_thread()
        for loop in self.loops:
            if loop.thread is current:
                loop.wake(chans)
                return
        by_owner: dict[Owner[Channel], list[Channel]] = {}
        for ch in chans:
            by_owner.setdefault(ch.owner, []).append(ch)
        for owner, mine in by_owner.items():
            owner.call_soon_threadsafe(owner.mark_dirty_many, mine)

    def consumer_left(self, ch: Channel) -> None:
        """On ch's owner loop: remove an ephemeral channel whose last consumer left."""
        if ch.ephemeral and not ch.consumers and not ch.deleted:
            try:
                self.broker.delete_channel(ch.topic_name, ch.name)
            except Exception:  # already gone
                pass

    # -- lifecycle ------------------------------------------------------------------------
    def storage_failed(self, err: BaseException, topic: Topic | None = None) -> None:
        """A write to disk failed: log it and report it through /ping (any thread)."""
        self.storage.failed(err, topic)

    def start(self) -> None:
        o = self.options
        log.info("%s", self.banner)
        raise_fd_limit()
        # the fallback's one warning line was logged when the codec was imported
        log.info("codec: %s%s", _native.BACKEND,
                 " (the C codec is not built)" if _native.FALLBACK_REASON else "")
        log.info("ID: %d", o.id)
        log.info("NSQ: durability %s, data in %s", o.durability, self.storage.data_path)
        if o.tls_cert or o.tls_key:
            from pybroker.server.tls import server_context

            try:
                self.tls_context = server_context(o)
            except ConfigError as e:
                raise StartupError(str(e)) from None
        if o.auth_http_addresses:
            from pybroker.server.authhttp import AuthClient

            self.auth = AuthClient(o)
        if self.bound is None:
            self.bound = bind_listeners(o)
        # imported before the data path is read, so every listener starts serving at once
        http_class = self._http_class() if self.bound.http is not None else None
        try:
            self.storage.prepare()
        except DataPathLocked as e:
            raise StartupError(f"data_path: {e}") from None
        except (OSError, StorageError) as e:
            raise StartupError(f"data_path: cannot use {self.storage.data_path}: {e}") from None
        try:
            self.storage.restore()
        except (OSError, StorageError) as e:
            raise StartupError(f"data_path: cannot use {self.storage.data_path}: {e}") from None
        self.broker.on_change.append(self.storage.save_metadata)
        self.broker.on_delete_topic.append(self.storage.delete_topic)
        if o.cluster_etcd:
            from pybroker.cluster.node import ClusterNode

            self.cluster = ClusterNode(self)
            for loop in self.loops:
                loop.publisher.cluster = self.cluster
        for ch in self.broker.all_channels():  # read restored backlogs once consumers come
            ch.owner.call_soon_threadsafe(ch.owner.mark_dirty, ch)
        sock = self.bound.tcp
        http_sock = self.bound.http if http_class is not None else None
        http_port = http_sock.getsockname()[1] if http_sock is not None else 0
        # nsqd registers with nsqlookupd even when the list starts empty (PUT /config can
        # add addresses later), so the registrar always runs; it idles with no addresses.
        # matches nsqd: broadcast_tcp_port/broadcast_http_port, when set, are registered
        # instead of the ports listened on. Made here, before the listeners say they
        # listen (what supervisors and tests wait for): its selector and wake-up take
        # descriptors, which a flood of clients could otherwise take first
        self.lookupd = LookupdRegistrar(self, o.broadcast_tcp_port or sock.getsockname()[1],
                                        o.broadcast_http_port or http_port)
        for loop in self.loops:
            loop.start()
        self.listener = Listener(sock, self.loops)
        self.listener.start()
        log.info("TCP: listening on %s", format_addr(sock))
        if http_class is not None:
            self.http = http_class(self)
            log.info("HTTP: listening on %s", self.http.listen(self.bound.http, self.bound.https))
        self.scanner.start()
        self.lookupd.start()
        if self.cluster is not None:
            try:
                self.cluster.start(_advertised(sock, o), f"{o.broadcast_address}:{http_port}")
            except OSError as e:
                raise StartupError(f"cluster_address: cannot listen on "
                                   f"{o.cluster_address}: {e}") from None

    @staticmethod
    def _http_class() -> type[HttpServer] | None:
        try:
            from pybroker.http.server import HttpServer
        except ModuleNotFoundError as e:
            if e.name != "pybroker.http.server":
                raise
            log.warning("HTTP: the HTTP API is not available in this build")
            return None
        return HttpServer

    def request_stop(self) -> None:
        self._stop.set()

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT ask for a clean stop (installed before start-up begins)."""
        def on_signal(signum: int, frame: FrameType | None) -> None:
            self._stop.set()

        self._stop.prepare()        # its pipe exists before any client can use up the fds
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        # a signal the kernel hands to another thread (it does when the main thread
        # cannot take it then) wakes the main thread's wait through the pipe; the
        # handler itself runs in the main thread only
        signal.set_wakeup_fd(self._stop.wake_fd(), warn_on_full_buffer=False)

    def wait(self) -> None:
        """Block the main thread until SIGTERM/SIGINT (or request_stop)."""
        self._stop.wait()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop accepting, close clients, join every thread with a deadline."""
        self.broker.exiting = True
        if self.http is not None:
            self.http.stop(timeout_s)
        if self.listener is not None:
            self.listener.home.call_soon_threadsafe(self.listener.close)
        if self.cluster is not None:
            self.cluster.stop(timeout_s)   # leaderships end now: the others take over
        for loop in self.loops:
            loop.stop()
        for loop in self.loops:
            if not loop.stopped.wait(timeout_s):
                log.error("%s did not stop within %.0fs", loop.name, timeout_s)
        self.scanner.stop(timeout_s)
        if self.auth is not None:
            self.auth.stop(timeout_s)
        if self.lookupd is not None:
            self.lookupd.stop(timeout_s)
        self.storage.persist()
        if self.cluster is not None:
            self.cluster.stopped(self.health is None)
        for loop in self.loops:
            loop.close()
        log.info("NSQ: bye")


def _advertised(sock: socket.socket, o: Options) -> str:
    """host:port other nodes reach this node's TCP clients' port at."""
    host, port = sock.getsockname()[:2]
    if host in ("0.0.0.0", "::", ""):
        host = o.broadcast_address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def raise_fd_limit() -> None:
    """Raise the soft limit on open files to the hard one (Go's runtime does this for
    nsqd), so the broker is not capped near 1,024 clients by a shell's default."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY:
            hard = max(soft, 1 << 20)
        if soft != resource.RLIM_INFINITY and soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            log.info("fd limit raised from %d to %d", soft, hard)
        else:
            log.info("fd limit %d", soft)
    except (OSError, ValueError) as e:
        log.warning("fd limit not raised: %s", e)


def run(options: Options, bound: Bound | None = None, banner: str | None = None,
        prog: str = "pybroker") -> int:
    """Run the broker until a signal; returns the process exit status. ``bound``: the
    listeners bound before start-up (bound here when None); ``banner``: the first log
    line (the version)."""
    # In-flight bookkeeping allocates many small objects and creates few cycles: collect
    # young objects less often than the default 700 allocations. A young collection
    # walks what is alive of them: 100,000 (the threshold before) took 8-21 ms while a
    # consumer deferred thousands of messages a turn, 25,000 takes a quarter of that,
    # and the rates of loadtest/bench_io.py did not move (docs/storage.md, "Deferred
    # messages and the garbage collector").
    gc.set_threshold(25_000, 50, 100)
    rt = Runtime(options, bound, banner)
    rt.install_signal_handlers()
    try:
        rt.start()
    except StartupError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    gc.freeze()  # start-up objects (modules, options, restored state) are never garbage
    gc.enable()  # the command lines disable it while importing (nothing to collect yet)
    rt.wait()
    rt.shutdown()
    return 0
