"""The Structured Streaming source: a topic/channel read at least once into micro-batches.

The reader object Spark keeps on the driver (in the Python process that answers
``initialOffset``/``latestOffset``/``partitions``/``commit``) holds the Subscription, so
the consumer connection and the un-FIN'd messages live there. ``partitions()`` copies a
batch's messages into its InputPartitions, and ``read()`` (on an executor) only turns
them into Arrow rows: no executor ever talks to nsqd. Messages are FIN'd in ``commit()``
or, given the ``checkpoint`` option, as soon as the checkpoint's commit log shows their
batch done (Spark commits a batch only while planning the next one, which may be long
in coming on an idle topic, and never for the last batch before a stop).

Spark ends this process with SIGTERM when the query stops; the reader turns that signal
into a normal exit so that ``stop()`` runs and hands unfinished messages back with REQ.
"""
from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any

import pyarrow as pa  # type: ignore[import-untyped]
from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadMaxRows, SupportsTriggerAvailableNow

from pybroker.spark.checkpoint import committed_seq
from pybroker.spark.ledger import Ledger, Offset
from pybroker.spark.options import SourceOptions
from pybroker.spark.subscription import Subscription

log = logging.getLogger("pybroker.spark")

ARROW_SCHEMA = pa.schema([
    pa.field("id", pa.string()), pa.field("body", pa.binary()),
    pa.field("timestamp", pa.timestamp("us", tz="UTC")), pa.field("attempts", pa.int32()),
    pa.field("topic", pa.string()), pa.field("offset", pa.int64()),
])

#: While messages keep arriving, wait up to this long to fill a batch.
_LINGER_S = 0.5
_LINGER_STEP_S = 0.05
#: Available-now: after a server was heard from, the time left for what it sends with or
#: after the heartbeat (after a stall, both come at once) to arrive.
_SETTLE_S = 0.5
#: Available-now: the longest wait for a server to be heard from (a connection that
#: dropped reconnects after lookupd_poll_interval) before the run ends all the same.
_HEARD_CAP_S = 60.0


def drain_heartbeat_s(drain_timeout_s: float) -> float:
    """The heartbeat interval an available-now source asks for: twice the drain timeout,
    within the 1 to 30 s nsqd grants. A server sends one that often; it also closes a
    client it hears nothing from (not even the NOP answering a heartbeat) for two."""
    return max(1.0, min(30.0, 2 * drain_timeout_s))


class MessagePartition(InputPartition):
    """Some of one batch's messages, as columns (pickled to the executor)."""

    def __init__(self, topic: str, ids: list[str], bodies: list[bytes],
                 timestamps_ns: list[int], attempts: list[int]) -> None:
        super().__init__(len(ids))
        self.topic = topic
        self.ids, self.bodies = ids, bodies
        self.timestamps_ns, self.attempts = timestamps_ns, attempts


def record_batch(part: MessagePartition) -> pa.RecordBatch:
    """The rows of a partition in the source's schema (timestamps in microseconds)."""
    n = len(part.ids)
    return pa.RecordBatch.from_arrays([
        pa.array(part.ids, pa.string()),
        pa.array(part.bodies, pa.binary()),
        pa.array([t // 1000 for t in part.timestamps_ns], pa.timestamp("us", tz="UTC")),
        pa.array(part.attempts, pa.int32()),
        pa.array([part.topic] * n, pa.string()),
        pa.nulls(n, pa.int64()),
    ], schema=ARROW_SCHEMA)


class _Exit:
    """SIGTERM handler for Spark's source process: exit once, ignore repeats."""

    def __init__(self) -> None:
        self.fired = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if not self.fired:
            self.fired = True
            raise SystemExit(0)


def _install_exit_handler() -> None:
    # Only in the process Spark runs us in (main thread, default disposition), never
    # over a handler someone else installed.
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _Exit())


class PyBrokerStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Spark's stream reader for ``format("pybroker")``; see the module docstring.

    Created on the driver and again on executors (for ``read()``), so the constructor
    connects nothing: the subscription starts on the first driver-side call.
    """

    def __init__(self, options: SourceOptions) -> None:
        self.opts = options
        self._sub: Subscription | None = None
        self._drain_ts_ns: int | None = None

    # -- driver side -------------------------------------------------------------------
    @property
    def ledger(self) -> Ledger:
        return self._subscription().ledger

    def _subscription(self) -> Subscription:
        if self._sub is None:
            _install_exit_handler()
            heartbeat_s = (drain_heartbeat_s(self.opts.drain_timeout_s)
                           if self._drain_ts_ns is not None else 30.0)
            self._sub = Subscription(self.opts, heartbeat_s=heartbeat_s).start()
        return self._sub

    def initialOffset(self) -> dict[str, Any]:
        return self.ledger.offset(0)

    def prepareForTriggerAvailableNow(self) -> None:
        """Available-now: take what was published until now, then report no more data."""
        self._drain_ts_ns = time.time_ns()
        self._subscription()

    def latestOffset(self, start: dict[str, Any] | None = None,
                     limit: object = None) -> dict[str, Any]:
        ledger = self.ledger
        self._fin_from_checkpoint()
        max_rows = self._subscription().batch_cap()
        if isinstance(limit, ReadMaxRows):
            max_rows = min(max_rows, limit.max_rows)
        end = ledger.latest(start, max_rows, self._drain_ts_ns)
        if end is None and self._drain_ts_ns is not None:
            end = self._wait_for_data(start, max_rows)
        if end is not None:
            end = self._linger(start, end, max_rows)
        if end is None:
            # no new data: Spark expects the start offset back unchanged
            return start if start is not None else ledger.offset(0)
        return end

    def _wait_for_data(self, start: Offset | None, max_rows: int) -> Offset | None:
        """Available-now: poll for a message. Drained once drain_timeout has passed
        without one, every server was heard from (a heartbeat) since the wait began, and
        _SETTLE_S more passed after that. Silence alone is not enough: a stalled server,
        or this process stalled on a loaded machine, is silent too, and the run would end
        with the channel's messages left for the next one."""
        sub = self._subscription()
        drain = self.opts.drain_timeout_s
        use_beats = sub.heartbeat_s <= 2 * drain    # else it is silence alone, as before
        before = sub.heartbeats()
        began = time.monotonic()
        heard_at: float | None = None
        while True:
            now = time.monotonic()
            if heard_at is None and (not use_beats or sub.heard_since(before)):
                heard_at = now
            capped = now - began >= drain + _HEARD_CAP_S
            drained = capped or (heard_at is not None and now - began >= drain
                                 and now - heard_at >= min(drain, _SETTLE_S))
            end = self.ledger.latest(start, max_rows, self._drain_ts_ns)
            if end is not None or drained:
                if end is None and capped and heard_at is None:
                    log.warning("%s/%s: no server heard from for %.0fs; ending the run",
                                self.opts.topic, self.opts.channel, now - began)
                return end
            time.sleep(_LINGER_STEP_S)

    def _linger(self, start: Offset | None, end: Offset, max_rows: int) -> Offset:
        """While messages keep coming, wait a little to make the batch fuller."""
        ledger = self.ledger
        cap = min(max_rows, ledger.max_batch_size)
        base = ledger.base_seq(start)
        deadline = time.monotonic() + _LINGER_S
        end_seq = ledger.own_seq(end)
        while end_seq is not None and end_seq - base < cap and time.monotonic() < deadline:
            before = ledger.counts()["received"]
            time.sleep(_LINGER_STEP_S)
            if ledger.counts()["received"] == before:
                break
            end = ledger.latest(start, max_rows, self._drain_ts_ns) or end
            end_seq = ledger.own_seq(end)
        return end

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> list[InputPartition]:
        msgs = self.ledger.planned(start, end)
        if not msgs:
            return []
        n = min(self.opts.num_partitions, len(msgs))
        size = -(-len(msgs) // n)
        parts: list[InputPartition] = []
        for i in range(0, len(msgs), size):
            chunk = msgs[i:i + size]
            parts.append(MessagePartition(
                self.opts.topic, [m.id.decode("ascii", "replace") for m in chunk],
                [m.body for m in chunk], [m.timestamp for m in chunk],
                [m.attempts for m in chunk]))
        return parts

    def commit(self, end: dict[str, Any]) -> None:
        n = self.ledger.commit(end)
        log.debug("commit %s: %d messages finished", end, n)

    def _fin_from_checkpoint(self) -> None:
        if not self.opts.checkpoint or self._sub is None:
            return
        if self._sub.ledger.uncommitted_end() == 0:
            return
        seq = committed_seq(self.opts.checkpoint, self._sub.run)
        if seq is not None:
            self._sub.ledger.commit(seq)

    def stop(self) -> None:
        sub, self._sub = self._sub, None
        if sub is None:
            return
        done = committed_seq(self.opts.checkpoint, sub.run) if self.opts.checkpoint else None
        sub.close(done)

    # -- executor side -----------------------------------------------------------------
    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, MessagePartition), type(partition)
        if partition.ids:
            yield record_batch(partition)
