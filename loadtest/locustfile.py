"""Locust users for an NSQ broker (pybroker or nsqd) over TCP and over HTTP.

Users (pick some by name on the command line, or weigh them with --nsq-mix):
  NsqTcpPublisher       PUB, one message per request            request type "PUB"
  NsqTcpMultiPublisher  MPUB of --nsq-batch messages            request type "MPUB"
  NsqTcpConsumer        SUB + RDY --nsq-max-in-flight, FIN after --nsq-handler-delay;
                        each delivery is reported as request type "E2E" whose response
                        time is publish timestamp -> receipt
  NsqHttpPublisher      POST /pub                               request type "POST"
  NsqHttpMultiPublisher POST /mpub (newline-separated)          request type "POST"

Bodies start with the publisher's wall-clock time in ns (19 ASCII digits), so E2E covers
the whole trip; bodies from other publishers fall back to the broker's timestamp in the
message frame. Settings are Locust arguments, each with an environment variable:

  --nsq-tcp-address NSQ_TCP_ADDRESS  127.0.0.1:4150    --nsq-topic   NSQ_TOPIC    locust
  --nsq-http-address NSQ_HTTP_ADDRESS 127.0.0.1:4151   --nsq-channel NSQ_CHANNEL  locust
  --nsq-size NSQ_SIZE 200 (bytes)   --nsq-batch NSQ_BATCH 10   --nsq-pub-wait NSQ_PUB_WAIT 0
  --nsq-max-in-flight NSQ_MAX_IN_FLIGHT 100   --nsq-handler-delay NSQ_HANDLER_DELAY 0 (s)
  --nsq-mix NSQ_MIX "tcp_pub=1,tcp_mpub=1,consumer=1,http_pub=1,http_mpub=1" (0 drops one)

A headless run against a local broker, writing CSV stats (see README, "Benchmarks"):
  locust -f loadtest/locustfile.py --headless -u 10 -r 10 -t 30s --csv out/nsq
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import gevent
from locust import FastHttpUser, User, constant, events, task
from locust.env import Environment

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pybroker.bench.wire import (
    MSG_BODY_START,
    NsqConn,
    NsqError,
    fin_cmds,
    publish_cmd,
    rdy_cmd,
)

MIX_KEYS = {"tcp_pub": "NsqTcpPublisher", "tcp_mpub": "NsqTcpMultiPublisher",
            "consumer": "NsqTcpConsumer", "http_pub": "NsqHttpPublisher",
            "http_mpub": "NsqHttpMultiPublisher"}
DEFAULTS: dict[str, tuple[str, Any, str]] = {
    # option: (environment variable, default, help)
    "nsq_tcp_address": ("NSQ_TCP_ADDRESS", "127.0.0.1:4150", "broker TCP HOST:PORT"),
    "nsq_http_address": ("NSQ_HTTP_ADDRESS", "127.0.0.1:4151",
                         "broker HTTP HOST:PORT (unless --host is given)"),
    "nsq_topic": ("NSQ_TOPIC", "locust", "topic to publish to and consume from"),
    "nsq_channel": ("NSQ_CHANNEL", "locust", "consumers' channel"),
    "nsq_size": ("NSQ_SIZE", 200, "message body bytes (at least 20)"),
    "nsq_batch": ("NSQ_BATCH", 10, "messages per MPUB (TCP and HTTP)"),
    "nsq_pub_wait": ("NSQ_PUB_WAIT", 0.0, "seconds a publisher waits between requests"),
    "nsq_max_in_flight": ("NSQ_MAX_IN_FLIGHT", 100, "consumers' RDY count"),
    "nsq_handler_delay": ("NSQ_HANDLER_DELAY", 0.0, "seconds a consumer spends per message"),
    "nsq_mix": ("NSQ_MIX", "tcp_pub=1,tcp_mpub=1,consumer=1,http_pub=1,http_mpub=1",
                "user weights; 0 leaves a user out"),
}


@events.init_command_line_parser.add_listener
def _add_arguments(parser: Any) -> None:
    group = parser.add_argument_group("NSQ", "settings of the NSQ users")
    for name, (env, default, help_text) in DEFAULTS.items():
        group.add_argument("--" + name.replace("_", "-"), type=type(default), env_var=env,
                           default=default, help=help_text)


def setting(environment: Environment, name: str) -> Any:
    """A --nsq-* option; its environment variable or default outside the locust CLI."""
    opts = environment.parsed_options
    if opts is not None and hasattr(opts, name):
        return getattr(opts, name)
    env, default, _ = DEFAULTS[name]
    return type(default)(os.environ.get(env, default))


@events.init.add_listener
def _apply_mix(environment: Environment, **_: Any) -> None:
    """Set user weights from --nsq-mix; drop weight-0 users; point HTTP users at the broker."""
    weights = {}
    for part in str(setting(environment, "nsq_mix")).split(","):
        key, _, value = part.partition("=")
        if key.strip() in MIX_KEYS:
            weights[MIX_KEYS[key.strip()]] = int(value or 1)
    for cls in list(environment.user_classes):
        if cls.__name__ in weights:
            cls.weight = weights[cls.__name__]
    kept = [c for c in environment.user_classes if c.weight > 0 or c.fixed_count > 0]
    if kept:
        environment.user_classes[:] = kept
    if not environment.host:
        url = "http://" + str(setting(environment, "nsq_http_address"))
        for cls in (NsqHttpPublisher, NsqHttpMultiPublisher):
            cls.host = url


def make_body(size: int) -> bytes:
    """Wall-clock ns as 19 ASCII digits, padded to ``size`` (no newline: /mpub-safe)."""
    return b"%019d" % time.time_ns() + b"-" * max(0, size - 19)


def sent_ns(buf: bytes, pos: int, end: int) -> int:
    """A message's publish time: the body's stamp if it has one, else the frame's."""
    head = buf[pos + MSG_BODY_START:pos + MSG_BODY_START + 19]
    if len(head) == 19 and head.isdigit() and pos + MSG_BODY_START + 19 <= end:
        return int(head)
    return int.from_bytes(buf[pos + 8:pos + 16], "big")


class _TcpUser(User):
    abstract = True

    def on_start(self) -> None:
        env = self.environment
        self.topic = str(setting(env, "nsq_topic"))
        self.size = max(20, int(setting(env, "nsq_size")))
        self.conn: NsqConn | None = None
        self.connect()

    def connect(self) -> None:
        self.conn = NsqConn(str(setting(self.environment, "nsq_tcp_address")),
                            client_id=f"locust-{type(self).__name__}")

    def on_stop(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def report(self, kind: str, started: float, length: int, exc: Exception | None) -> None:
        self.environment.events.request.fire(
            request_type=kind, name=self.topic, response_time=(time.perf_counter() - started)
            * 1000.0, response_length=length, exception=exc, context={})


class _Publisher(_TcpUser):
    abstract = True
    batch = 1

    def wait_time(self) -> float:
        return float(setting(self.environment, "nsq_pub_wait"))

    @task
    def publish(self) -> None:
        bodies = [make_body(self.size) for _ in range(self.batch)]
        cmd = publish_cmd(self.topic, bodies)
        kind = "PUB" if self.batch == 1 else "MPUB"
        started = time.perf_counter()
        exc: Exception | None = None
        try:
            if self.conn is None:
                self.connect()
            assert self.conn is not None
            self.conn.request(cmd, kind)
        except (OSError, NsqError) as e:
            exc = e
            self.on_stop()      # reconnect on the next request
        self.report(kind, started, len(cmd), exc)


class NsqTcpPublisher(_Publisher):
    """PUB one message per request."""


class NsqTcpMultiPublisher(_Publisher):
    """MPUB --nsq-batch messages per request."""

    def on_start(self) -> None:
        self.batch = max(1, int(setting(self.environment, "nsq_batch")))
        super().on_start()


class NsqTcpConsumer(_TcpUser):
    """SUB, RDY max-in-flight; every delivery reported as "E2E" (publish -> receipt)."""

    wait_time = constant(0)

    def connect(self) -> None:
        super().connect()
        assert self.conn is not None
        env = self.environment
        self.conn.subscribe(self.topic, str(setting(env, "nsq_channel")))
        self.delay = float(setting(env, "nsq_handler_delay"))
        self.conn.send(rdy_cmd(int(setting(env, "nsq_max_in_flight"))))

    @task
    def receive(self) -> None:
        if self.conn is None:
            self.connect()
        conn = self.conn
        assert conn is not None
        got: list[tuple[bytes, int, int]] = []

        def on_message(buf: bytes, pos: int) -> None:
            end = pos + 4 + int.from_bytes(buf[pos:pos + 4], "big")
            got.append((buf[pos + 18:pos + 34], sent_ns(buf, pos, end), end - pos - 34))

        try:
            if not conn.recv_some(1.0):
                return
            now = time.time_ns()
            conn.scan(on_message)
        except (OSError, NsqError) as e:
            self.environment.events.request.fire(
                request_type="E2E", name=self.topic, response_time=0, response_length=0,
                exception=e, context={})
            self.on_stop()
            return
        fire = self.environment.events.request.fire
        for msg_id, sent, length in got:
            fire(request_type="E2E", name=self.topic,
                 response_time=max(0.0, (now - sent) / 1e6), response_length=length,
                 exception=None, context={})
            if self.delay > 0:
                gevent.sleep(self.delay)
                conn.send(fin_cmds([msg_id]))
        if self.delay <= 0:
            conn.send(fin_cmds([m for m, _, _ in got]))


class _HttpPublisher(FastHttpUser):
    abstract = True
    host = "http://127.0.0.1:4151"
    path = "/pub"

    def wait_time(self) -> float:
        return float(setting(self.environment, "nsq_pub_wait"))

    def on_start(self) -> None:
        env = self.environment
        self.topic = str(setting(env, "nsq_topic"))
        self.size = max(20, int(setting(env, "nsq_size")))
        self.batch = 1 if self.path == "/pub" else max(1, int(setting(env, "nsq_batch")))

    @task
    def publish(self) -> None:
        body = b"\n".join(make_body(self.size) for _ in range(self.batch))
        with self.client.post(f"{self.path}?topic={self.topic}", data=body,
                              name=f"{self.path} {self.topic}", catch_response=True) as resp:
            if resp.status_code != 200 or resp.content != b"OK":
                resp.failure(f"{resp.status_code} {resp.content[:200]!r}")


class NsqHttpPublisher(_HttpPublisher):
    """POST /pub, one message per request."""


class NsqHttpMultiPublisher(_HttpPublisher):
    """POST /mpub, --nsq-batch newline-separated messages per request."""

    path = "/mpub"
