"""What the parts above the event loops use of the Runtime, as typed Protocols.

The Runtime (pybroker/runtime.py) builds the threads and wires them together; a part is
given the Runtime only through the Protocol that names what it may use, so mypy checks
every use and the dependencies are written down. The Protocols of the loops' own seams
(``LoopServices``, ``StorageHost``, ``ClusterHooks``, a connection's ``Conn`` and a
loop's ``Loop``) live in server/ports.py, below the loops; this module is above them
(it names ``EventLoop``) and is imported by the HTTP API, the cluster and the nsqlookupd
registrar, never by the loops. Typing only: no behaviour (``owner_loop`` is a cast).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, cast

from pybroker.server.ports import ClusterHooks, LoopServices, StorageHost

if TYPE_CHECKING:
    import ssl

    from pybroker.config import Options
    from pybroker.core.broker import Broker
    from pybroker.core.channel import Channel
    from pybroker.core.seams import Owner
    from pybroker.core.topic import Topic
    from pybroker.server.listener import Listener
    from pybroker.server.loop import EventLoop
    from pybroker.server.ports import Loop
    from pybroker.server.storage import StorageManager

__all__ = ["ClusterHooks", "ClusterHost", "HttpHost", "LoopServices", "Notified",
           "RegistrarHost", "StorageHost", "owner_loop"]


def owner_loop(owner: Owner[Channel] | Loop | None) -> EventLoop:
    """A channel's or topic's owner (or a loop known by its Protocol) as the server's
    EventLoop: every owner the Runtime gives the Broker is one of its EventLoops (the
    core knows them only as ``Owner``, the loops' seams as ``ports.Loop``)."""
    return cast("EventLoop", owner)


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
