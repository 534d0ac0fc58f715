"""What the HTTP modules ask of each other, as Protocols and one TypedDict, so that the
parts the server and the API are built from never import them back.

What it owns: ``HttpFigures`` (the server's own counts), ``ServerView`` (what the API,
/config and the statsd pusher read of the server: its ports, start time, counts and
statsd prefix), ``ConnServer`` (what a connection asks of its server: routes, the
date cache, submitting a request's Gather, its events and counts; generic in the
connection type) and ``ApiView`` (what the channel-config and log-read endpoints use
of the API: the broker, the log reader, query and lookup helpers). The direction:
server -> api -> endpoints -> views; conn -> views; server -> conn.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, TypedDict, TypeVar

if TYPE_CHECKING:
    from pybroker.core.broker import Broker
    from pybroker.core.channel import Channel
    from pybroker.core.topic import Topic
    from pybroker.evloop import TurnTimes
    from pybroker.http.gather import Gather
    from pybroker.http.reader import LogReader
    from pybroker.http.request import Request
    from pybroker.http.response import DateCache, Response
    from pybroker.http.routes import Router

C = TypeVar("C")   # the connection type (http.conn.HttpConn)


class HttpFigures(TypedDict):
    """The HTTP server's own counts for /metrics and /stats: open connections, answers
    by status, connections refused by listener."""

    connections: int
    requests: dict[int, int]
    refused: dict[str, int]
    turns: TurnTimes            # the HTTP thread's loop turns (a copy)


class ServerView(Protocol):
    """What the API, /config and statsd read of the HTTP server (http.server)."""

    @property
    def port(self) -> int: ...
    @property
    def tcp_port(self) -> int: ...
    @property
    def started_at(self) -> float: ...

    def figures(self) -> HttpFigures: ...
    def statsd_prefix(self) -> str: ...


class ConnServer(Protocol[C]):
    """What an HTTP connection asks of its server (http.server.HttpServer), on the
    HTTP thread."""

    @property
    def router(self) -> Router: ...
    @property
    def dates(self) -> DateCache: ...
    @property
    def tls_required(self) -> bool: ...
    @property
    def https_port(self) -> int: ...
    @property
    def to_flush(self) -> dict[C, None]: ...
    @property
    def to_process(self) -> dict[C, None]: ...      # out of budget: carried to next turn
    @property
    def header_timeout_ns(self) -> int: ...
    @property
    def request_timeout_ns(self) -> int: ...
    @property
    def idle_timeout_ns(self) -> int: ...

    def submit(self, conn: C, req: Request, gather: Gather[Response]) -> None: ...
    def update_events(self, conn: C) -> None: ...
    def count(self, status: int, r: Request, remote: str) -> None: ...
    def forget(self, conn: C) -> None: ...


class ApiView(Protocol):
    """What the endpoints in http.channelconfig and http.logread use of the API
    (http.api.Api): the helpers raise the API's answer for a bad query."""

    @property
    def broker(self) -> Broker: ...
    @property
    def reader(self) -> LogReader: ...

    def _params(self, req: Request) -> dict[bytes, list[bytes]]: ...
    def _existing_topic(self, name: str) -> Topic: ...
    def _existing_channel(self, req: Request) -> Channel: ...
