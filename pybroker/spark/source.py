"""The ``pybroker`` PySpark data source: live topics, archives, and publishing.

=========================================  ==========================================
``spark.readStream.format("pybroker")``    a topic's log as offset ranges (log_source), or
                                           with mode channel a channel, FIN after commit
                                           (stream_reader)
``spark.read.format("pybroker").load(p)``  files written by ``pybroker to-file``
``df.write.format("pybroker")``            MPUB each partition from the executors
``df.writeStream.format("pybroker")``      the same, per micro-batch
=========================================  ==========================================

The live topic and the archive share one schema (options.SCHEMA_DDL); archive rows have
no id, attempts or offset, channel rows no offset. Spark pickles these classes by reference, so executors need
pybroker installed with the spark extra (``pip install '.[spark]'`` in the clone).
"""
from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pyarrow as pa  # type: ignore[import-untyped]
from pyspark import TaskContext
from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceReader,
    DataSourceStreamArrowWriter,
    DataSourceStreamReader,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.types import StructType

from pybroker.spark.archive_files import ArchiveFile, find_archives, read_bodies
from pybroker.spark.options import (
    SCHEMA_DDL,
    ArchiveOptions,
    LogSourceOptions,
    SinkOptions,
    SourceOptions,
    source_mode,
)
from pybroker.spark.log_source import LogStreamReader
from pybroker.spark.publisher import pick_address, publish
from pybroker.spark.stream_reader import ARROW_SCHEMA, PyBrokerStreamReader

log = logging.getLogger("pybroker.spark")


class PyBrokerDataSource(DataSource):
    """``format("pybroker")``; options are documented in README.md's Spark section."""

    @classmethod
    def name(cls) -> str:
        return "pybroker"

    def schema(self) -> str:
        return SCHEMA_DDL

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        if source_mode(self.options) == "channel":
            return PyBrokerStreamReader(SourceOptions.parse(self.options))
        return LogStreamReader(LogSourceOptions.parse(self.options))

    def reader(self, schema: StructType) -> ArchiveReader:
        return ArchiveReader(ArchiveOptions.parse(self.options))

    def writer(self, schema: StructType, overwrite: bool) -> TopicWriter:
        return TopicWriter(SinkOptions.parse(self.options))

    def streamWriter(self, schema: StructType, overwrite: bool) -> TopicStreamWriter:
        return TopicStreamWriter(SinkOptions.parse(self.options))


# -- archives ---------------------------------------------------------------------------
class ArchivePartition(InputPartition):
    """One archive file (gzip is not splittable, so a file is a task)."""

    def __init__(self, file: ArchiveFile) -> None:
        super().__init__(file.path)
        self.file = file


class ArchiveReader(DataSourceReader):
    """Reads ``pybroker to-file`` / ``nsq_to_file`` output as the topic's rows.

    Files are listed on the driver and read by the executors, so on a cluster the
    directory must be on a file system every executor mounts.
    """

    def __init__(self, opts: ArchiveOptions) -> None:
        self.opts = opts

    def partitions(self) -> Sequence[InputPartition]:
        files = find_archives(self.opts.paths, self.opts.topic, self.opts.datetime_format,
                              self.opts.utc)
        return [ArchivePartition(f) for f in files]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, ArchivePartition), type(partition)
        f = partition.file
        bodies: list[bytes] = []
        for body in read_bodies(f.path):
            bodies.append(body)
            if len(bodies) >= self.opts.batch_rows:
                yield _archive_batch(bodies, f)
                bodies = []
        if bodies:
            yield _archive_batch(bodies, f)


def _archive_batch(bodies: list[bytes], f: ArchiveFile) -> pa.RecordBatch:
    n = len(bodies)
    return pa.RecordBatch.from_arrays([
        pa.nulls(n, pa.string()), pa.array(bodies, pa.binary()),
        pa.array([f.timestamp_us] * n, pa.timestamp("us", tz="UTC")),
        pa.nulls(n, pa.int32()), pa.array([f.topic] * n, pa.string()),
        pa.nulls(n, pa.int64()),
    ], schema=ARROW_SCHEMA)


# -- sinks ------------------------------------------------------------------------------
@dataclass
class Published(WriterCommitMessage):
    """What one task published (returned to the driver's commit)."""

    count: int
    address: str
    partition: int


def _publish_task(batches: Iterator[pa.RecordBatch], opts: SinkOptions) -> Published:
    ctx = TaskContext.get()
    partition = ctx.partitionId() if ctx is not None else 0
    attempt = ctx.attemptNumber() if ctx is not None else 0
    address = pick_address(opts.nsqd, partition, attempt)
    count = publish(batches, opts, address)
    return Published(count, address, partition)


def _total(messages: Sequence[WriterCommitMessage | None]) -> int:
    return sum(m.count for m in messages if isinstance(m, Published))


class TopicWriter(DataSourceArrowWriter):
    """Batch sink: each task MPUBs its partition; a refused MPUB fails the task."""

    def __init__(self, opts: SinkOptions) -> None:
        self.opts = opts

    def write(self, iterator: Iterator[pa.RecordBatch]) -> Published:
        return _publish_task(iterator, self.opts)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        log.info("published %d messages to %s", _total(messages),
                 self.opts.topic or "the rows' topics")

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        log.warning("publish job aborted after %d messages were published (a retry "
                    "publishes them again)", _total(messages))


class TopicStreamWriter(DataSourceStreamArrowWriter):
    """Streaming sink: each micro-batch task MPUBs its partition (at least once)."""

    def __init__(self, opts: SinkOptions) -> None:
        self.opts = opts

    def write(self, iterator: Iterator[pa.RecordBatch]) -> Published:
        return _publish_task(iterator, self.opts)

    def commit(self, messages: list[WriterCommitMessage | None],
               batchId: int) -> None:
        log.info("batch %d: published %d messages", batchId, _total(messages))

    def abort(self, messages: list[WriterCommitMessage | None],
              batchId: int) -> None:
        log.warning("batch %d aborted after %d messages were published", batchId,
                    _total(messages))
