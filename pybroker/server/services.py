"""What each part of the server uses of the Runtime, as typed Protocols.

The Runtime (server/runtime.py) builds the threads and wires them together; a part is
given the Runtime only through the Protocol below that names what it may use, so mypy
checks every use and the dependencies are written down. Typing only: no behaviour
(``owner_loop`` is a cast).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, cast

if TYPE_CHECKING:
    import ssl

    from pybroker.config import Options
    from pybroker.core.broker import Broker
    from pybroker.core.channel import Channel
    from pybroker.core.seams import Owner
    from pybroker.core.topic import Topic
    from pybroker.server.authhttp import AuthClient
    from pybroker.server.listener import Listener
    from pybroker.server.loop import EventLoop
    from pybroker.server.storage import StorageManager


def owner_loop(owner: Owner[Channel] | None) -> EventLoop:
    """A channel's or topic's owner as the server's loop: every owner the Runtime gives
    the Broker is one of its EventLoops (the core knows them only as ``Owner``)."""
    return cast("EventLoop", owner)


class StorageHost(Protocol):
    """What the storage thread uses (server/storage.py)."""

    options: Options
    broker: Broker
    health: str | None
    loops: list[EventLoop]


class LoopServices(Protocol):
    """What an event loop, its connections and the V2 handlers use (server/loop.py,
    connection.py, handlers.py, auth.py, transport.py, deadletter.py)."""

    options: Options
    broker: Broker
    storage: StorageManager
    auth: AuthClient | None
    tls_context: ssl.SSLContext | None
    health: str | None
    loops: list[EventLoop]
    cluster: ClusterHooks | None

    def request_stop(self) -> None: ...
    def storage_failed(self, err: BaseException, topic: Topic | None = None) -> None: ...
    def consumer_left(self, ch: Channel) -> None: ...


class RegistrarHost(Protocol):
    """What the nsqlookupd registrar uses (server/lookupd.py)."""

    options: Options
    broker: Broker
    cluster: ClusterHooks | None


class HttpHost(Protocol):
    """What the HTTP thread uses (http/server.py, api.py, collect.py, options.py,
    statsd.py)."""

    options: Options
    broker: Broker
    storage: StorageManager
    health: str | None
    loops: list[EventLoop]
    listener: Listener | None
    tls_context: ssl.SSLContext | None
    cluster: ClusterHooks | None

    def request_stop(self) -> None: ...
    def storage_failed(self, err: BaseException, topic: Topic | None = None) -> None: ...


class Notified(Protocol):
    """Something told when what it reports changed (the nsqlookupd registrar)."""

    def notify(self) -> None: ...


class ClusterHost(Protocol):
    """What a cluster node (pybroker.cluster.node) uses of the Runtime."""

    options: Options
    broker: Broker
    storage: StorageManager
    loops: list[EventLoop]

    @property
    def lookupd(self) -> Notified | None: ...


class ClusterHooks(Protocol):
    """What the server and the HTTP API ask of a cluster node (pybroker.cluster.node's
    ``ClusterNode``; None on a single node): whether a topic's publishes and SUBs are
    this node's to serve, forwarding, waiting for replicas, and its report."""

    def start(self, tcp_address: str, http_address: str) -> None: ...
    def stop(self, timeout_s: float) -> None: ...
    def diverts(self, name: str) -> bool: ...
    def refusal(self, name: str) -> str | None: ...
    def divert(self, loop: EventLoop, name: str, payload: Any, defer_ns: int,
               done: Callable[[Any], None], deadline_ns: int = 0) -> None: ...
    def await_replicas(self, topic: Topic, end: int, done: Callable[[Any], None]) -> bool: ...
    def sub_refusal(self, name: str) -> str | None: ...
    def registers(self, name: str) -> bool: ...
    def add_stats(self, doc: dict[str, Any]) -> None: ...
    def metrics_text(self) -> bytes: ...
