"""Publish a task's rows with MPUB: the sink's work on an executor, without Spark.

Rows arrive as Arrow record batches with a ``body`` column (binary or string) and,
when no topic option is given, a ``topic`` column. Bodies are cut into MPUBs of at most
``batch_size`` messages and ``batch_bytes`` bytes; up to ``pipeline`` MPUBs wait for
their answers at once. An answer other than OK (or none within ``timeout``) raises, so
Spark fails the task and retries it: delivery is at least once, and a retried task
publishes its rows again.
"""
from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future

import pyarrow as pa  # type: ignore[import-untyped]

from pybroker.client import Producer
from pybroker.client.protocol import is_valid_topic_name
from pybroker.spark.options import SinkOptions

log = logging.getLogger("pybroker.spark")


class PublishError(RuntimeError):
    """A row cannot be published (no body, empty body, bad topic)."""


def pick_address(addresses: list[str], partition: int, attempt: int) -> str:
    """Spread partitions over the nsqds; a retried task moves on to the next one."""
    return addresses[(partition + attempt) % len(addresses)]


def _messages(batches: Iterable[pa.RecordBatch], topic: str) -> Iterator[tuple[str, bytes]]:
    for batch in batches:
        names = batch.schema.names
        if "body" in names:
            body_col = batch.column(names.index("body"))
        elif len(names) == 1:
            body_col = batch.column(0)
        else:
            raise PublishError(f"no body column to publish among {names}")
        bodies = body_col.to_pylist()
        if topic:
            topics: Iterable[str] = [topic] * len(bodies)
        elif "topic" in names:
            topics = batch.column(names.index("topic")).to_pylist()
        else:
            raise PublishError("give option topic, or a topic column")
        for t, body in zip(topics, bodies):
            if body is None or len(body) == 0:
                raise PublishError("cannot publish a null or empty body (nsqd refuses it)")
            if isinstance(body, str):
                body = body.encode("utf-8")
            yield t, body


class _Pipeline:
    """MPUBs in flight on one Producer, oldest first."""

    def __init__(self, producer: Producer, opts: SinkOptions) -> None:
        self.producer, self.opts = producer, opts
        self.pending: deque[tuple[Future[bytes], int]] = deque()
        self.published = 0

    def send(self, topic: str, bodies: list[bytes]) -> None:
        if not is_valid_topic_name(topic):
            raise PublishError(f"invalid topic name {topic!r}")
        while len(self.pending) >= self.opts.pipeline:
            self._wait_oldest()
        self.pending.append((self.producer.multi_publish_async(topic, bodies), len(bodies)))

    def _wait_oldest(self) -> None:
        fut, n = self.pending.popleft()
        answer = fut.result(self.opts.timeout_s)   # raises ProtocolError for E_* frames
        if answer != b"OK":
            raise PublishError(f"MPUB answered {answer[:64]!r}, not OK")
        self.published += n

    def drain(self) -> None:
        while self.pending:
            self._wait_oldest()


def publish(batches: Iterable[pa.RecordBatch], opts: SinkOptions, address: str) -> int:
    """MPUB every row to ``address``; returns how many messages the server took.

    Raises:
        PublishError, pybroker.client.NSQError (E_* answers, lost connection),
        TimeoutError: the task must fail so that Spark retries it.
    """
    producer = Producer(address)
    try:
        pipe = _Pipeline(producer, opts)
        chunk: list[bytes] = []
        chunk_topic = ""
        size = 0
        for topic, body in _messages(batches, opts.topic):
            if chunk and (topic != chunk_topic or len(chunk) >= opts.batch_size
                          or size + len(body) > opts.batch_bytes):
                pipe.send(chunk_topic, chunk)
                chunk, size = [], 0
            chunk_topic = topic
            chunk.append(body)
            size += len(body) + 4
        if chunk:
            pipe.send(chunk_topic, chunk)
        pipe.drain()
        return pipe.published
    finally:
        producer.stop()
