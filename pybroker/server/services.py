"""What each part of the server uses of the Runtime, as typed Protocols.

The Runtime (server/runtime.py) builds the threads and wires them together; a part is
given the Runtime only through the Protocol below that names what it may use, so mypy
checks every use and the dependencies are written down. Typing only: no behaviour.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import ssl

    from pybroker.cluster.node import ClusterNode
    from pybroker.config import Options
    from pybroker.core.broker import Broker
    from pybroker.core.channel import Channel
    from pybroker.core.topic import Topic
    from pybroker.server.auth import AuthClient
    from pybroker.server.listener import Listener
    from pybroker.server.loop import EventLoop
    from pybroker.server.storage import StorageManager


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
    cluster: ClusterNode | None

    def request_stop(self) -> None: ...
    def storage_failed(self, err: BaseException, topic: Topic | None = None) -> None: ...
    def consumer_left(self, ch: Channel) -> None: ...


class RegistrarHost(Protocol):
    """What the nsqlookupd registrar uses (server/lookupd.py)."""

    options: Options
    broker: Broker
    cluster: ClusterNode | None


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
    cluster: ClusterNode | None

    def request_stop(self) -> None: ...
    def storage_failed(self, err: BaseException, topic: Topic | None = None) -> None: ...
