"""nsqd's HTTP endpoints (nsqd/http.go): parameters, checks in nsqd's order, status codes
and ``{"message":"CODE"}`` bodies; plus /metrics.

Runs on the HTTP thread, which never appends to or writes a topic: /pub and /mpub are a
Gather job on the topic's owner loop, whose Publisher (pybroker.server.publish) appends
them with that turn's other publishes and settles the job when the write (and in fsync
mode the fsync) that carried them is settled. Anything that touches a channel's state
(pause, empty) or needs a consistent view of it (stats) is a Gather of jobs on the owner
loops. The endpoint table is at the bottom (``build_router``).
"""
from __future__ import annotations

import logging
import re
import socket
import time
from typing import TYPE_CHECKING, cast

from pybroker import NSQ_COMPAT_VERSION, _native
from pybroker.core import stats as core_stats
from pybroker.core.lifecycle import freeing
from pybroker.errors import ChannelNotFound, Exiting, TopicNotFound
from pybroker.http import channelconfig, logread, process, statstext
from pybroker.http.collect import Collected, SharedAnswers, plan_stats
from pybroker.http.gather import MISSING, Gather, Later, run_blocking
from pybroker.http.options import ConfigEndpoint
from pybroker.http.reader import LogReader, then
from pybroker.http.request import Request, first, parse_query
from pybroker.http.response import (TEXT, Response, empty, error, ok_json, ok_json_yielding,
                                    ok_text)
from pybroker.http.routes import Handler, Router
from pybroker.protocol.names import is_valid_name
from pybroker.server.services import owner_loop

if TYPE_CHECKING:
    from collections.abc import Callable

    from pybroker.core.channel import Channel
    from pybroker.core.statsdoc import StatsDocument
    from pybroker.core.topic import Topic
    from pybroker.http.views import ServerView
    from pybroker.server.loop import EventLoop
    from pybroker.server.services import HttpHost

log = logging.getLogger("pybroker")
MS = 1_000_000
OK = ok_text(b"OK")
_BOOL = {b"true": True, b"1": True, b"false": False, b"0": False}
_INT = re.compile(rb"[+-]?[0-9]+\Z")
# how long an HTTP publish may wait for its owner loop (and, in fsync mode, the fsync)
PUBLISH_TIMEOUT_S = 30.0


def _channel_pause(ch: Channel, paused: bool) -> None:
    """On ch's owner loop: stop or resume delivery."""
    ch.paused = paused
    if not paused and not ch.deleted:
        ch.owner.mark_dirty(ch)


def _publish_on_owner(loop: EventLoop, name: str, bodies: list[bytes],
                      defer_ns: int) -> Later:
    """On the topic's owner loop: hand the publish to its Publisher; the result (None,
    or the error) comes when the write that carried it is settled."""
    later = Later()
    loop.publisher.submit(name, bodies, defer_ns, later.resolve)
    return later


def _channel_rewind(ch: Channel, offset: int) -> int:
    """On ch's owner loop: move its cursor to offset (at most ``released``: a lookup
    by time may land past it while the topic is paused); -1 if the offset went
    meanwhile (or the channel did)."""
    offset = min(offset, ch.topic.released)
    if ch.deleted or offset < ch.topic.log.oldest:
        return -1
    ch.rewind(offset)
    ch.owner.mark_dirty(ch)
    return offset


def _channel_empty(ch: Channel) -> None:
    """On ch's owner loop: drop queued, in-flight, deferred and on-disk messages (the
    objects they were kept in are freed a step a turn: ``freeing``)."""
    owner_loop(ch.owner).run_steps(freeing(ch.empty()))


class Api:
    """The endpoints. Owned by the HttpServer; every method runs on the HTTP thread."""

    def __init__(self, runtime: HttpHost, server: ServerView) -> None:
        self.rt = runtime
        self.broker = runtime.broker
        self.opts = runtime.options
        self.server = server
        self.hostname = socket.gethostname()
        self.options = ConfigEndpoint(runtime, server)
        self.reader = LogReader()   # log reads and lookups by time, off this thread
        self.answers = SharedAnswers()   # /stats and /metrics, made on the reader's thread

    # -- health, info ---------------------------------------------------------------
    def health(self) -> str:
        """nsqd's GetHealth(): "OK" or "NOK - <why>"."""
        why = self.rt.health
        if why:
            return f"NOK - {why}"
        if self.broker.exiting:
            return "NOK - exiting"
        return "OK"

    def ping(self, req: Request) -> Response:
        # nsqd's PlainText decorator: no X-NSQ-Content-Type header, 500 when unhealthy
        h = self.health()
        return Response(200 if h == "OK" else 500, h.encode(), TEXT, nsq=False)

    def info(self, req: Request) -> Response:
        o = self.opts
        return ok_json({
            "version": NSQ_COMPAT_VERSION,
            "broadcast_address": o.broadcast_address,
            "hostname": self.hostname,
            "http_port": self.server.port,
            "tcp_port": self.server.tcp_port,
            "start_time": self.broker.start_time,
            "max_heartbeat_interval": o.max_heartbeat_interval,
            "max_output_buffer_size": o.max_output_buffer_size,
            "max_output_buffer_timeout": o.max_output_buffer_timeout,
            "max_deflate_level": o.max_deflate_level,
        })

    # -- publishing -----------------------------------------------------------------
    def _topic_from_query(self, req: Request) -> tuple[dict[bytes, list[bytes]], Topic]:
        """nsqd's getTopicFromQuery: parse, check, and get-or-create the topic."""
        q, ok = parse_query(req.query)
        if not ok:
            raise _Answer(error(400, "INVALID_REQUEST"))
        name = first(q, b"topic")
        if name is None:
            raise _Answer(error(400, "MISSING_ARG_TOPIC"))
        if not is_valid_name(name):
            raise _Answer(error(400, "INVALID_TOPIC"))
        try:
            return q, self.broker.get_topic(name.decode())
        except Exiting:
            raise _Answer(error(503, "EXITING")) from None

    def _publish(self, topic: Topic, bodies: list[bytes], defer_ns: int = 0,
                 failed: str = "PUB_FAILED") -> Response | Gather[Response]:
        """Hand the publish to the topic's owner loop and answer when it is settled: OK
        once the write (in fsync mode the fsync) carrying it worked, 500 ``failed`` if
        it failed (or the loop did not answer in time), 503 EXITING when exiting. The
        HTTP thread serves other requests meanwhile."""
        if self.broker.exiting:
            return error(503, "EXITING")
        if not bodies:
            return OK

        def answer(results: list[object]) -> Response:
            result = results[0]
            if result is None:
                return OK
            if isinstance(result, Exiting):
                return error(503, "EXITING")
            if result is MISSING:
                log.error("HTTP: a publish to %s was not settled within %.0fs",
                          topic.name, PUBLISH_TIMEOUT_S)
            return error(500, failed)

        owner = owner_loop(topic.owner)
        return Gather([(owner, _publish_on_owner, (owner, topic.name, bodies, defer_ns))],
                      answer, timeout_s=PUBLISH_TIMEOUT_S)

    def pub(self, req: Request) -> Response | Gather[Response]:
        o = self.opts
        body = req.body_bytes()
        if len(body) > o.max_msg_size:
            return error(413, "MSG_TOO_BIG")
        if not body:
            return error(400, "MSG_EMPTY")
        q, topic = self._topic_from_query(req)
        defer_ns = 0
        ds = first(q, b"defer")
        if ds is not None:
            # matches nsqd's strconv.Atoi: out of int64 range is an error (checked by
            # length first: Python's int() refuses over 4,300 digits)
            if not _INT.match(ds) or len(ds.lstrip(b"+-").lstrip(b"0")) > 19 \
                    or not -2**63 <= int(ds) < 2**63:
                return error(400, "INVALID_DEFER")
            defer_ns = int(ds) * MS
            if defer_ns < 0 or defer_ns > o.max_req_timeout:
                return error(400, "INVALID_DEFER")
        return self._publish(topic, [body], defer_ns)

    def mpub(self, req: Request) -> Response | Gather[Response]:
        o = self.opts
        if req.content_length > o.max_body_size:
            return error(413, "BODY_TOO_BIG")
        q, topic = self._topic_from_query(req)
        vals = q.get(b"binary")
        # matches nsqd: text is the default; an unrecognised binary value counts as true
        binary = _BOOL.get(vals[0], True) if vals else False
        body = req.body_bytes()
        if binary:
            try:
                parts = self._split_binary(body)
            except _native.ScanError as e:
                code = "BAD_BODY" if e.code in (_native.E_MPUB_COUNT_READ,
                                                _native.E_MPUB_COUNT) else "BAD_MESSAGE"
                return error(413, code)
        else:
            if len(body) > o.max_body_size:
                return error(413, "BODY_TOO_BIG")
            # matches nsqd: one message per line; empty lines are dropped
            parts = body.split(b"\n")
            if not parts[-1] or b"\n\n" in body or not parts[0]:
                parts = [p for p in parts if p]
            if len(body) > o.max_msg_size and any(len(p) > o.max_msg_size for p in parts):
                return error(413, "MSG_TOO_BIG")
        return self._publish(topic, parts, failed="MPUB_FAILED")

    def _split_binary(self, body: bytes) -> list[bytes]:
        o = self.opts
        max_count = (o.max_body_size - 4) // 5
        try:
            return _native.mpub_split(body, o.max_msg_size, max_count)
        except _native.ScanError as e:
            if e.code != _native.E_MPUB_TRAILING:
                raise
            # matches nsqd over HTTP: bytes after the last message are ignored
            return _native.mpub_split(memoryview(body)[:len(body) - e.value],
                                      o.max_msg_size, max_count)

    # -- topics ---------------------------------------------------------------------
    def _params(self, req: Request) -> dict[bytes, list[bytes]]:
        q, ok = parse_query(req.query)
        if not ok:
            raise _Answer(error(400, "INVALID_REQUEST"))
        return q

    def _topic_arg(self, req: Request, validate: bool) -> str:
        name = first(self._params(req), b"topic")
        if name is None:
            raise _Answer(error(400, "MISSING_ARG_TOPIC"))
        if validate and not is_valid_name(name):
            raise _Answer(error(400, "INVALID_TOPIC"))
        return name.decode("utf-8", "replace")

    def _existing_topic(self, name: str) -> Topic:
        try:
            return self.broker.find_topic(name)
        except TopicNotFound:
            raise _Answer(error(404, "TOPIC_NOT_FOUND")) from None

    def topic_create(self, req: Request) -> Response:
        self._topic_from_query(req)
        return empty()

    def topic_delete(self, req: Request) -> Response:
        try:
            self.broker.delete_topic(self._topic_arg(req, validate=False))
        except TopicNotFound:
            return error(404, "TOPIC_NOT_FOUND")
        return empty()

    def topic_empty(self, req: Request) -> Response:
        t = self._existing_topic(self._topic_arg(req, validate=True))
        t.empty()  # memory and disk
        return empty()

    def _topic_pause(self, req: Request, paused: bool) -> Response:
        t = self._existing_topic(self._topic_arg(req, validate=False))
        chans = t.set_paused(paused)
        if chans:
            self.broker.wake(chans)
        self.broker.notify_changed()  # matches nsqd: persist the paused flag at once
        return empty()

    def topic_pause(self, req: Request) -> Response:
        return self._topic_pause(req, True)

    def topic_unpause(self, req: Request) -> Response:
        return self._topic_pause(req, False)

    # -- channels -------------------------------------------------------------------
    def _topic_channel(self, req: Request) -> tuple[Topic, str]:
        """nsqd's getExistingTopicFromQuery (with GetTopicChannelArgs' error codes)."""
        q = self._params(req)
        topic = first(q, b"topic")
        if topic is None:
            raise _Answer(error(400, "MISSING_ARG_TOPIC"))
        if not is_valid_name(topic):
            raise _Answer(error(400, "INVALID_ARG_TOPIC"))
        channel = first(q, b"channel")
        if channel is None:
            raise _Answer(error(400, "MISSING_ARG_CHANNEL"))
        if not is_valid_name(channel):
            raise _Answer(error(400, "INVALID_ARG_CHANNEL"))
        return self._existing_topic(topic.decode()), channel.decode()

    def _existing_channel(self, req: Request) -> Channel:
        t, name = self._topic_channel(req)
        ch = t.find_channel(name)
        if ch is None:
            raise _Answer(error(404, "CHANNEL_NOT_FOUND"))
        return ch

    def channel_create(self, req: Request) -> Response:
        t, name = self._topic_channel(req)
        self.broker.get_channel(t, name)
        return empty()

    def channel_delete(self, req: Request) -> Response:
        t, name = self._topic_channel(req)
        try:
            self.broker.delete_channel(t.name, name)
        except (ChannelNotFound, TopicNotFound):
            return error(404, "CHANNEL_NOT_FOUND")
        return empty()

    def channel_empty(self, req: Request) -> Gather[Response]:
        ch = self._existing_channel(req)
        return Gather([(ch.owner, _channel_empty, (ch,))], lambda _: empty())

    def _channel_pause(self, req: Request, paused: bool) -> Gather[Response]:
        ch = self._existing_channel(req)

        def done(_: list[object]) -> Response:
            self.broker.notify_changed()  # matches nsqd: persist the paused flag at once
            return empty()

        return Gather([(ch.owner, _channel_pause, (ch, paused))], done)

    def channel_rewind(self, req: Request) -> Gather[Response] | Response:
        """Beyond nsqd: deliver a channel's messages again from a retained offset, or
        from the first message published at or after a time (``ts``, Unix ms: looked
        up on the log reader thread, then the rewind on the channel's owner loop)."""
        ch = self._existing_channel(req)
        q = self._params(req)
        off_arg, ts_arg = first(q, b"offset"), first(q, b"ts")
        if (off_arg is None) == (ts_arg is None):
            return error(400, "MISSING_ARG_OFFSET_OR_TS")
        arg = off_arg if off_arg is not None else ts_arg
        assert arg is not None
        if not arg.isdigit() or len(arg) > 19:
            return error(400, "INVALID_ARG_OFFSET" if off_arg is not None else "INVALID_ARG_TS")
        lg = ch.topic.log

        def rewound(results: list[object]) -> Response:
            got = results[0] if results else None
            if not isinstance(got, int):
                return error(500, "INTERNAL_ERROR")
            if got < 0:
                return error(400, "OFFSET_OUT_OF_RANGE")
            return ok_json({"offset": got, "oldest_offset": lg.oldest,
                            "newest_offset": ch.topic.released - 1})

        if off_arg is not None:
            offset = int(arg)
            if not lg.oldest <= offset <= ch.topic.released:
                return error(400, "OFFSET_OUT_OF_RANGE")
            return Gather([(ch.owner, _channel_rewind, (ch, offset))], rewound)
        if self.reader.busy():
            return error(503, "TOO_MANY_READS")
        job = then(self.reader, lg.offset_for_time, (int(arg) * MS,), ch.owner,
                   lambda offset: _channel_rewind(ch, offset))
        return Gather([job], rewound, timeout_s=10.0)

    def channel_pause(self, req: Request) -> Gather[Response]:
        return self._channel_pause(req, True)

    def channel_unpause(self, req: Request) -> Gather[Response]:
        return self._channel_pause(req, False)

    # -- stats, metrics -------------------------------------------------------------
    def stats(self, req: Request) -> Gather[Response]:
        q = self._params(req)
        as_json = first(q, b"format") == b"json"
        topic = (first(q, b"topic") or b"").decode("utf-8", "replace")
        channel = (first(q, b"channel") or b"").decode("utf-8", "replace")
        # matches nsqd: anything but a recognised false value means true
        include_clients = _BOOL.get(first(q, b"include_clients") or b"", True)
        include_mem = _BOOL.get(first(q, b"include_mem") or b"", True)

        def make() -> Response:      # (on the log reader's thread: collect.SharedAnswers)
            c = run_blocking(plan_stats(self.rt, topic, channel, include_clients))
            doc = self.stats_document(c, process.memory_stats() if include_mem else None)
            if as_json:
                return ok_json_yielding(doc)
            now = time.time()
            uptime_ns = int((now - self.server.started_at) * 1e9)
            return Response(200, statstext.render(doc, now, uptime_ns), TEXT)

        return self._shared(("stats", as_json, topic, channel, include_clients,
                             include_mem), make)

    def _shared(self, form: tuple[object, ...], make: Callable[[], Response]) -> Gather[Response]:
        """A Gather made and answered on the log reader's thread, shared by the requests
        of its form that wait for it (collect.SharedAnswers)."""
        ticket = self.answers.ticket()
        return Gather([], lambda _: self.answers.answer(form, ticket, make), off_thread=True)

    def stats_document(self, c: Collected, memory: dict[str, int] | None) -> StatsDocument:
        doc = core_stats.document(NSQ_COMPAT_VERSION, self.health(), self.broker.start_time,
                                  c.topics, memory, c.producers, _native.BACKEND,
                                  self.server.figures()["refused"])
        if self.rt.cluster is not None:
            # the cluster adds "cluster", and "replication" to replicated topics; its hook
            # (server.services.ClusterHooks) takes the document as a plain dict
            self.rt.cluster.add_stats(cast("dict[str, object]", doc))
        return doc

    def metrics(self, req: Request) -> Gather[Response]:
        from pybroker.http import metrics  # Prometheus' format: loaded when first asked for

        def make() -> Response:
            c = run_blocking(plan_stats(self.rt, include_clients=False, every_loop=True))
            body = metrics.render(c, self.health(), self.broker.start_time,
                                  self.server.figures())
            if self.rt.cluster is not None:
                body += self.rt.cluster.metrics_text()
            return Response(200, body, metrics.CONTENT_TYPE, nsq=False)

        return self._shared(("metrics",), make)


class _Answer(Exception):
    """Raised by a check to answer the request at once with ``response``."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status)
        self.response = response


def guarded(fn: Handler) -> Handler:
    """Turn an _Answer raised by a check into the handler's result."""
    def handler(req: Request) -> Response | Gather[Response]:
        try:
            return fn(req)
        except _Answer as a:
            return a.response
    handler.__name__ = getattr(fn, "__name__", "handler")
    return handler


def leader_only(api: Api, fn: Handler) -> Handler:
    """On a node of a cluster: an action that changes a replicated topic or its channels
    is the leader's to take (its channels are the ones consumers read; a follower's
    are the leader's shipped states, replaced at the next ship). So a follower answers
    307 to the same path and query on the leader's HTTP address (nsqadmin's and curl
    -L's clients follow it; the body is the message ``NOT_LEADER``), and 503
    ``NO_LEADER`` while the topic has no leader. A missing or invalid topic goes on to
    the handler (its 400)."""
    def handler(req: Request) -> Response | Gather[Response]:
        cluster = api.rt.cluster
        if cluster is not None:
            q, ok = parse_query(req.query)
            name = first(q, b"topic") if ok else None
            if name is not None and is_valid_name(name):
                where = cluster.leader_http(name.decode())
                if where == "":
                    return error(503, "NO_LEADER")
                if where is not None:
                    loc = f"http://{where}{req.path}".encode() + (b"?" + req.query
                                                                  if req.query else b"")
                    r = error(307, "NOT_LEADER")
                    r.headers = (b"Location: " + loc + b"\r\n",)
                    return r
        return fn(req)
    handler.__name__ = getattr(fn, "__name__", "handler")
    return handler


def build_router(api: Api) -> Router:
    """nsqd's routes (http.go), each with its body limit and the answer past it."""
    o = api.opts
    too_big = (o.max_body_size, error(413, "BODY_TOO_BIG", close=True))
    ignored = (o.max_body_size, None)     # the handler never reads the body (as nsqd's)
    r = Router(default_limit=too_big)
    r.add("GET", "/ping", api.ping, ignored)
    r.add("GET", "/info", api.info, ignored)
    r.add("POST", "/pub", guarded(api.pub), (o.max_msg_size, error(413, "MSG_TOO_BIG", close=True)))
    r.add("POST", "/mpub", guarded(api.mpub), too_big)
    r.add("GET", "/stats", guarded(api.stats), ignored)
    for verb in ("create", "delete", "empty", "pause", "unpause"):
        # a topic is made and deleted cluster-wide on any node (docs/replication.md);
        # the rest changes what the leader's consumers get
        topic_fn = guarded(getattr(api, f"topic_{verb}"))
        r.add("POST", f"/topic/{verb}", topic_fn if verb in ("create", "delete")
              else leader_only(api, topic_fn), ignored)
        r.add("POST", f"/channel/{verb}",
              leader_only(api, guarded(getattr(api, f"channel_{verb}"))), ignored)
    invalid = (o.max_msg_size, error(413, "INVALID_VALUE", close=True))
    r.add("GET", "/config/:opt", api.options.handle)
    r.add("PUT", "/config/:opt", api.options.handle, invalid)
    r.add("GET", "/metrics", api.metrics)  # beyond nsqd: Prometheus
    r.add("POST", "/channel/rewind",                               # beyond nsqd: replay
          leader_only(api, guarded(api.channel_rewind)))
    # beyond nsqd: a channel's max attempts and dead-letter topic
    r.add("GET", "/channel/config", guarded(lambda req: channelconfig.get_config(api, req)))
    r.add("POST", "/channel/config",
          leader_only(api, guarded(lambda req: channelconfig.post_config(api, req))))
    # beyond nsqd: the log read by offset (the partitioned Spark source; logread.py)
    r.add("GET", "/topic/offsets", guarded(lambda req: logread.topic_offsets(api, req)))
    r.add("GET", "/topic/read", guarded(lambda req: logread.topic_read(api, req)))
    r.add("POST", "/channel/commit",
          leader_only(api, guarded(lambda req: logread.channel_commit(api, req))))
    return r
