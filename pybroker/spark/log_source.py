"""The partitioned streaming source (mode ``log``, the default): offset ranges of a
topic's log, read on the executors, offsets in Spark's checkpoint.

Driver side (the Python process Spark runs the stream reader in): ``initialOffset``
resolves ``startingOffsets`` and pins the source's channel there, ``latestOffset`` asks the
broker for the log's end (capped by ``maxOffsetsPerTrigger`` or the trigger's limit),
``partitions`` cuts ``[start, end)`` into ``numPartitions`` contiguous ranges, and
``commit(end)`` moves the channel's cursor to ``end`` so that retention may delete what
Spark has stored. Executor side: ``read`` pages the range from ``GET /topic/read`` and
decodes each page into one Arrow record batch with a few numpy operations (the C codec
checks every record's CRC and finds where each starts in one call).

A batch is a deterministic offset range written to the checkpoint's offset log before
it runs, so a rerun after a crash reads exactly the same records: with an idempotent sink
(Spark's file sink) every message is written exactly once. Offsets are JSON like
``{"topic": "events", "offset": 12345}`` (the next offset to read).
"""
from __future__ import annotations

import array
import logging
import time
from collections.abc import Iterator, Mapping

import numpy as np
import pyarrow as pa  # type: ignore[import-untyped]
from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadLimit, ReadMaxRows, SupportsTriggerAvailableNow

from pybroker import _native
from pybroker.spark.checkpoint import committed_offset
from pybroker.spark.log_client import LogClient, LogError, OffsetsLost
from pybroker.spark.options import LogSourceOptions

log = logging.getLogger("pybroker.spark")

LOG_ARROW_SCHEMA = pa.schema([
    pa.field("id", pa.string()), pa.field("body", pa.binary()),
    pa.field("timestamp", pa.timestamp("us", tz="UTC")), pa.field("attempts", pa.int32()),
    pa.field("topic", pa.string()), pa.field("offset", pa.int64()),
])
REC_HEADER = 16             # [u32 crc][u32 length][u64 offset]
#: a body starts after the record head and the payload's deliver_at 8, ts 8, attempts 2, id 16
BODY_AT = REC_HEADER + 34
MAX_PAYLOAD = 1 << 31


class OffsetRange(InputPartition):
    """Offsets [start, end) of one topic: one task."""

    def __init__(self, topic: str, start: int, end: int) -> None:
        super().__init__((start, end))
        self.topic = topic
        self.start = start
        self.end = end


def split_range(start: int, end: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) as at most ``parts`` contiguous, non-empty, nearly equal ranges."""
    n = end - start
    parts = max(1, min(parts, n))
    if n <= 0:
        return []
    step, extra = divmod(n, parts)
    out, at = [], start
    for i in range(parts):
        size = step + (1 if i < extra else 0)
        out.append((at, at + size))
        at += size
    return out


def _gather(a: np.ndarray, at: np.ndarray, width: int) -> np.ndarray:
    """The ``width`` bytes at each position of ``at`` as an (n, width) uint8 array."""
    return a[at[:, None] + np.arange(width)]


def decode(data: bytes, first: int, topic: str) -> pa.RecordBatch:
    """Records as stored in the log (back to back, from offset ``first``) -> rows.

    One C call finds the records and checks their CRCs; the columns are numpy gathers
    over the whole buffer (no Python code per message or per field).
    """
    pos_arr, used, (status, _, _) = _native.log_scan(data, first, True, MAX_PAYLOAD,
                                                      len(data) // 50 + 1)
    if used != len(data) or status < 0:
        raise LogError(f"damaged records in the broker's answer at offset "
                       f"{first + len(pos_arr)} (status {status})")
    n = len(pos_arr)
    a = np.frombuffer(data, dtype=np.uint8)
    if isinstance(pos_arr, array.array):     # the C codec's positions: no copy per item
        pos = np.frombuffer(pos_arr, dtype=np.uint32).astype(np.int64)
    else:
        pos = np.asarray(pos_arr, dtype=np.int64)
    ends = np.empty(n, np.int64)
    ends[:-1] = pos[1:]
    if n:
        ends[-1] = len(data)
    starts = pos + BODY_AT
    # bodies: every byte that is not one of the records' 50-byte heads, in order
    keep = np.ones(len(data), dtype=bool)
    keep[(pos[:, None] + np.arange(BODY_AT)).ravel()] = False
    bodies = a[keep]
    lens = ends - starts
    offsets = np.zeros(n + 1, np.int32)
    np.cumsum(lens, out=offsets[1:])
    ts_ns = _gather(a, pos + 24, 8).view(">i8").ravel()
    attempts = _gather(a, pos + 32, 2).view(">u2").ravel().astype(np.int32)
    ids = _gather(a, pos + 34, 16).ravel()
    id_offsets = np.arange(0, 16 * (n + 1), 16, dtype=np.int32)
    tb = topic.encode()
    topic_offsets = np.arange(0, len(tb) * (n + 1), len(tb), dtype=np.int32)
    return pa.RecordBatch.from_arrays([
        pa.StringArray.from_buffers(n, pa.py_buffer(id_offsets), pa.py_buffer(ids)),
        pa.BinaryArray.from_buffers(pa.binary(), n, [None, pa.py_buffer(offsets),
                                                     pa.py_buffer(bodies)]),
        pa.array((ts_ns // 1000).astype(np.int64), pa.int64()).cast(
            pa.timestamp("us", tz="UTC")),
        pa.array(attempts, pa.int32()),
        pa.StringArray.from_buffers(n, pa.py_buffer(topic_offsets), pa.py_buffer(tb * n)),
        pa.array(np.arange(first, first + n, dtype=np.int64), pa.int64()),
    ], schema=LOG_ARROW_SCHEMA)


# the offset Spark keeps in its checkpoint (a JSON object): the next record of the log
LogOffset = dict[str, str | int]


def _offset(topic: str, offset: int) -> LogOffset:
    return {"topic": topic, "offset": offset}


def _offset_of(o: Mapping[str, object]) -> int:
    """The ``offset`` of a LogOffset Spark hands back (a number, or its text)."""
    v = o["offset"]
    if isinstance(v, (int, float, str)):
        return int(v)
    raise LogError(f"not a log offset: {o!r}")


class LogStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Spark's stream reader for ``format("pybroker")`` in mode ``log``; see the module
    docstring. Created on the driver and again on executors; connects lazily."""

    def __init__(self, options: LogSourceOptions) -> None:
        self.opts = options
        self._client: LogClient | None = None
        self._target: int | None = None     # available-now: read up to here
        self._committed: int | None = None  # the channel's cursor as last set

    def _broker(self) -> LogClient:
        if self._client is None:
            self._client = LogClient(self.opts.nsqd_http, self.opts.timeout_s)
        return self._client

    # -- driver side -------------------------------------------------------------------
    def _resolve_start(self) -> int:
        o = self.opts
        start = o.starting_offsets
        client = self._broker()
        if isinstance(start, dict):
            at = client.offsets(o.topic, start["ts"]).at
            assert at is not None
            return at
        got = client.offsets(o.topic)
        if start == "earliest":
            return got.oldest
        if start == "latest":
            return got.end
        assert isinstance(start, int)
        if not got.oldest <= start <= got.end:
            raise LogError(f"startingOffsets {start}: topic {o.topic} holds offsets "
                           f"[{got.oldest}, {got.end})")
        return start

    def initialOffset(self) -> LogOffset:
        """Only for a query without a checkpoint: a new start. The channel is pinned
        there (created, or moved back from an earlier query's commits) so that
        retention keeps what this query is about to read."""
        o = self.opts
        start = self._resolve_start()
        self._committed = start
        try:
            client = self._broker()
            if client.commit(o.topic, o.channel, start) > start:
                client.rewind(o.topic, o.channel, start)
        except LogError as e:
            log.warning("could not pin channel %s/%s at %d: %s", o.topic, o.channel,
                        start, e)
        return _offset(o.topic, start)

    def getDefaultReadLimit(self) -> ReadLimit:
        from pyspark.sql.streaming.datasource import ReadAllAvailable

        if self.opts.max_offsets_per_trigger:
            return ReadMaxRows(self.opts.max_offsets_per_trigger)
        return ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self._broker().offsets(self.opts.topic).end

    # Spark hands back the offsets it was given, as the JSON objects it checkpointed
    def latestOffset(self, start: dict[str, object] | None = None,
                     limit: object = None) -> LogOffset:
        at = _offset_of(start if start is not None else self.initialOffset())
        self._from_checkpoint()
        end = self._broker().offsets(self.opts.topic).end
        if self._target is not None:
            end = min(end, self._target)
        if isinstance(limit, ReadMaxRows):
            end = min(end, at + max(1, limit.max_rows))
        return _offset(self.opts.topic, max(at, end))

    def partitions(self, start: dict[str, object], end: dict[str, object]) -> list[OffsetRange]:
        lo, hi = _offset_of(start), _offset_of(end)
        return [OffsetRange(self.opts.topic, a, b)
                for a, b in split_range(lo, hi, self.opts.num_partitions)]

    def _from_checkpoint(self) -> None:
        """Spark calls ``commit`` for batch N only when it plans N+1 (never for the last
        batch before a stop): the checkpoint's commit log tells it sooner."""
        if not self.opts.checkpoint:
            return
        done = committed_offset(self.opts.checkpoint, self.opts.topic)
        if done is not None and (self._committed is None or done > self._committed):
            self._commit(done)

    def _commit(self, offset: int) -> None:
        self._committed = offset
        try:
            self._broker().commit(self.opts.topic, self.opts.channel, offset)
        except LogError as e:
            # retention waits a little longer; the data itself is safe in the sink
            log.warning("could not move channel %s/%s to %d: %s", self.opts.topic,
                        self.opts.channel, offset, e)

    def commit(self, end: dict[str, object]) -> None:
        at = _offset_of(end)
        if self._committed is None or at > self._committed:
            self._commit(at)

    def stop(self) -> None:
        self._from_checkpoint()
        if self._client is not None:
            self._client.close()
            self._client = None

    # -- executor side -----------------------------------------------------------------
    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, OffsetRange), type(partition)
        o = self.opts
        start = partition.start
        started = time.monotonic()
        with LogClient(o.nsqd_http, o.timeout_s) as client:
            try:
                yield from self._read_range(client, partition, start)
            except OffsetsLost as e:
                if o.fail_on_data_loss:
                    raise LogError(f"{e}; set failOnDataLoss=false to skip lost "
                                   "offsets") from e
                log.warning("%s: skipped (failOnDataLoss=false)", e)
                resume = max(start, e.oldest)
                if resume < partition.end:
                    yield from self._read_range(client, partition, resume)
        log.debug("read [%d, %d) of %s in %.3fs", partition.start, partition.end,
                  partition.topic, time.monotonic() - started)

    def _read_range(self, client: LogClient, part: OffsetRange,
                    start: int) -> Iterator[pa.RecordBatch]:
        for chunk in client.read(part.topic, start, part.end, self.opts.fetch_bytes):
            if chunk.data:
                yield decode(chunk.data, chunk.first, part.topic)
