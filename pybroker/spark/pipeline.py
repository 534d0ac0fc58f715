"""The archive pipeline: a topic streamed into a columnar lake partitioned by date/hour.

``ArchiveJob`` says what to archive and where; ``start_archive`` starts the Structured
Streaming query on a SparkSession (``spark_session`` makes one, local unless a master
URL is given). Rows keep the source's columns, gain ``date`` and ``hour`` (of the
publish time, in the session time zone, UTC by default) as partition columns and,
given a DDL schema, the fields parsed from JSON bodies. The checkpoint directory
(``<output>/_checkpoint`` by default) makes restarts resume without loss: in mode log
(offset ranges) with a file sink, exactly once; in mode channel the source is told about
it so that it can FIN what the commit log proves written (at least once).
"""
from __future__ import annotations

import logging
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pybroker.spark import register, require_pyspark
from pybroker.spark.checkpoint import local_path
from pybroker.spark.options import (
    COLUMNS,
    DEFAULT_MAX_IN_FLIGHT,
    OptionError,
    parse_starting_offsets,
)

if TYPE_CHECKING:   # pyspark is imported where a job starts, never at import time
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.streaming.query import StreamingQuery

log = logging.getLogger("pybroker.spark")

FORMATS = ("parquet", "orc", "json")
PARTITION_COLUMNS = ("date", "hour")


class JobError(ValueError):
    """The job cannot run as given (bad schema, missing Java...)."""


@dataclass
class ArchiveJob:
    """One archive run: a topic into ``output`` (see the module docstring).

    mode ``log`` (default) reads offset ranges from ``nsqd_http`` (pybroker) and keeps
    ``channel``'s cursor at what is stored; mode ``channel`` consumes ``channel`` from
    ``nsqd``/``lookupd`` (any nsqd) and FINs what is stored.
    """

    topic: str
    channel: str
    output: str
    mode: str = "log"
    nsqd_http: str = ""
    starting_offsets: str = "earliest"
    max_offsets_per_trigger: int = 0
    nsqd: list[str] = field(default_factory=list)
    lookupd: list[str] = field(default_factory=list)
    format: str = "parquet"
    trigger_s: float = 10.0
    available_now: bool = False
    checkpoint: str = ""
    json_schema: str = ""
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    max_batch_size: int = 0              # 0: half of max_in_flight
    num_partitions: int = 2
    msg_timeout: str = ""
    drain_timeout: str = "2s"
    query_name: str = ""

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint or os.path.join(self.output, "_checkpoint")

    def source_options(self) -> dict[str, str]:
        if self.mode == "log":
            return {k: v for k, v in {
                "mode": "log", "topic": self.topic, "channel": self.channel,
                "nsqd_http": self.nsqd_http, "startingOffsets": self.starting_offsets,
                "maxOffsetsPerTrigger": str(self.max_offsets_per_trigger or ""),
                "numPartitions": str(self.num_partitions),
                "checkpoint": self.checkpoint_dir
                if local_path(self.checkpoint_dir) is not None else ""}.items() if v}
        opts = {"mode": "channel", "topic": self.topic, "channel": self.channel,
                "nsqd": ",".join(self.nsqd), "lookupd": ",".join(self.lookupd),
                "max_in_flight": str(self.max_in_flight),
                "num_partitions": str(self.num_partitions),
                "drain_timeout": self.drain_timeout}
        if self.max_batch_size:
            opts["max_batch_size"] = str(self.max_batch_size)
        if self.msg_timeout:
            opts["msg_timeout"] = self.msg_timeout
        if local_path(self.checkpoint_dir) is not None:
            opts["checkpoint"] = self.checkpoint_dir
        return {k: v for k, v in opts.items() if v}

    def validate(self) -> None:
        if self.format not in FORMATS:
            raise JobError(f"--format must be one of {', '.join(FORMATS)}")
        if self.mode not in ("log", "channel"):
            raise JobError("--mode must be log or channel")
        if self.mode == "log" and not self.nsqd_http:
            raise JobError("mode log reads pybroker's log over HTTP: give "
                           "--nsqd-http-address (for a plain nsqd: --mode channel with "
                           "--nsqd-tcp-address or --lookupd-http-address)")
        if self.mode == "channel" and not self.nsqd and not self.lookupd:
            raise JobError("give --nsqd-tcp-address or --lookupd-http-address")
        if self.mode == "log":
            try:
                parse_starting_offsets(self.starting_offsets)
            except OptionError as e:
                raise JobError(str(e).replace("option startingOffsets",
                                              "--starting-offsets")) from None
        if self.trigger_s <= 0 and not self.available_now:
            raise JobError("--trigger must be a positive duration")


def find_java() -> str | None:
    """The java that PySpark will start: $JAVA_HOME/bin/java, else java on PATH."""
    home = os.environ.get("JAVA_HOME")
    if home and os.access(os.path.join(home, "bin", "java"), os.X_OK):
        return os.path.join(home, "bin", "java")
    return shutil.which("java")


def spark_session(master: str = "local[*]", app_name: str = "pybroker",
                  conf: dict[str, str] | None = None) -> SparkSession:
    """A SparkSession with the pybroker data source registered.

    A local master runs the Python workers with this interpreter (unless
    PYSPARK_PYTHON says otherwise), so they import the same pybroker.

    Raises:
        MissingSpark: pyspark is not installed. JobError: no Java to run Spark with.
    """
    require_pyspark()
    if find_java() is None:
        raise JobError("Spark needs a Java runtime (17 or 21): install one (Debian: "
                       "apt-get install openjdk-17-jre-headless) or set JAVA_HOME")
    if master.startswith("local"):
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.master(master).appName(app_name)
    settings = {"spark.sql.session.timeZone": "UTC", "spark.ui.showConsoleProgress": "false"}
    settings.update(conf or {})
    for key, value in settings.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    register(spark)
    return spark


def existing_session() -> SparkSession | None:
    """The SparkSession already active in this thread (an embedding program's), if any."""
    require_pyspark()
    from pyspark.sql import SparkSession

    return SparkSession.getActiveSession()


def archive_frame(spark: SparkSession, job: ArchiveJob) -> DataFrame:
    """The streaming DataFrame the job writes: source columns, parsed JSON, date, hour.

    Raises:
        JobError: the JSON schema is not valid DDL, or a field collides with a column.
    """
    from pyspark.sql import functions as F

    reader = spark.readStream.format("pybroker")
    for key, value in job.source_options().items():
        reader = reader.option(key, value)
    df = reader.load()
    if job.json_schema:
        try:
            parsed = F.from_json(F.col("body").cast("string"), job.json_schema,
                                 {"mode": "PERMISSIVE"})
            df = df.withColumn("_json", parsed)
            fields = df.select("_json.*").columns
        except Exception as e:  # pyspark's parse errors have no common base class
            raise JobError(f"--json-schema: {e}") from e
        clash = sorted(set(fields) & (set(COLUMNS) | set(PARTITION_COLUMNS)))
        if clash:
            raise JobError(f"--json-schema fields {clash} collide with the archive's "
                           "columns; rename them in the schema")
        df = df.select(*COLUMNS, "_json.*")
    return (df.withColumn("date", F.to_date("timestamp"))
              .withColumn("hour", F.hour("timestamp")))


def start_archive(spark: SparkSession, job: ArchiveJob) -> StreamingQuery:
    """Start the archive query (see ``start_query``); returns the StreamingQuery.

    Raises:
        JobError: the job is invalid.
    """
    job.validate()

    def start() -> StreamingQuery:
        writer = (archive_frame(spark, job).writeStream.format(job.format)
                  .option("path", job.output)
                  .option("checkpointLocation", job.checkpoint_dir)
                  .partitionBy(*PARTITION_COLUMNS)
                  .outputMode("append"))
        if job.query_name:
            writer = writer.queryName(job.query_name)
        if job.available_now:
            writer = writer.trigger(availableNow=True)
        else:
            writer = writer.trigger(processingTime=f"{job.trigger_s} seconds")
        return writer.start()

    return start_query(start)


# Spark gives a new Python worker a fixed 10 s to connect back (PythonWorkerFactory); the
# stream reader's worker starts when the query initializes its sources, and on a loaded
# machine it can miss that window. The query then ends before reading anything, so
# starting it again from its checkpoint loses and repeats nothing.
WORKER_NO_SHOW = "Python worker failed to connect back"
START_TRIES = 3          # starts of one query, the first included
START_WAIT_S = 60.0      # longest wait for one start's sources (Spark's own bound is 10 s)
# a query's status message until its sources are up: "Initializing StreamExecution"
# before its thread runs, then "Initializing sources"
INITIALIZING = "Initializing "


def start_query(start: Callable[[], StreamingQuery],
                tries: int = START_TRIES, wait_s: float = START_WAIT_S) -> StreamingQuery:
    """``start()`` a streaming query and wait until its sources are initialized.

    A query that ended there because Spark's Python worker did not connect back in time
    is started again, up to ``tries`` starts in all; any other outcome (running, done,
    failed otherwise, still initializing after ``wait_s``) is returned as it is.
    """
    for attempt in range(1, tries + 1):
        query = start()
        if attempt == tries or not _worker_missed_start(query, wait_s):
            return query
        log.warning("query start %d of %d failed: Spark's Python worker did not connect "
                    "back in time; starting again", attempt, tries)
    raise AssertionError("unreachable: the last try returns")  # pragma: no cover


def wait_for(query: StreamingQuery, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for the query to end; True if it has ended.

    Unlike ``awaitTermination``, a query that failed is not raised here: its error is
    ``query.exception()``.
    """
    from pyspark.errors import StreamingQueryException

    try:
        # pyspark annotates whole seconds; it takes a float (int(timeout * 1000) ms)
        return bool(query.awaitTermination(timeout_s))  # type: ignore[arg-type]
    except StreamingQueryException:
        return True


def _worker_missed_start(query: StreamingQuery, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while str(query.status.get("message", "")).startswith(INITIALIZING):
        if time.monotonic() > deadline or wait_for(query, 0.05):
            break
    if query.isActive:
        return False
    error = query.exception()
    return error is not None and WORKER_NO_SHOW in str(error)


def batch_rows(query: StreamingQuery) -> dict[int, int]:
    """{batch id: input rows} of the query's recent progress reports."""
    out: dict[int, int] = {}
    for p in query.recentProgress or []:
        get = p.get if isinstance(p, dict) else lambda k, d=None, p=p: getattr(p, k, d)
        batch, rows = get("batchId", None), get("numInputRows", 0)
        if batch is not None:
            out[int(batch)] = int(rows or 0)
    return out
