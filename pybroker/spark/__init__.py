"""pybroker.spark: topics as PySpark sources and sinks (the optional ``spark`` extra).

    from pybroker.spark import register
    register(spark)                                   # adds format("pybroker")
    df = (spark.readStream.format("pybroker")       # offset ranges of the topic's log
          .option("nsqd_http", "127.0.0.1:4151").option("topic", "events")
          .load())              # id, body, timestamp, attempts, topic, offset
    nsq = (spark.readStream.format("pybroker").option("mode", "channel")  # any nsqd
           .option("nsqd", "127.0.0.1:4150").option("topic", "events")
           .option("channel", "archive").load())
    df.write.format("pybroker").option("nsqd", "127.0.0.1:4150") \\
        .option("topic", "copy").save()              # MPUB from the executors

Importing this package does not import pyspark; ``register`` and the modules that
define Spark classes (source, log_source, stream_reader) do. ``pybroker spark archive`` is the
topic-to-Parquet pipeline (cli.py, pipeline.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from pybroker.spark.options import COLUMNS, SCHEMA_DDL, OptionError

if TYPE_CHECKING:   # pyspark is imported when a job starts, never at import time
    from pyspark.sql import SparkSession

__all__ = ["COLUMNS", "SCHEMA_DDL", "MissingSpark", "OptionError", "register"]


class MissingSpark(ImportError):
    """pyspark (the ``spark`` extra) is not installed."""


def require_pyspark() -> None:
    """Raises MissingSpark with the install hint when pyspark cannot be imported."""
    hint = "pybroker.spark needs PySpark 4.2+ and pyarrow: pip install '.[spark]' in the clone"
    try:
        import pyarrow  # type: ignore[import-untyped]  # noqa: F401
        import pyspark
    except ImportError as e:
        raise MissingSpark(hint) from e
    # 4.2 brought latestOffset(start, limit) and Trigger.AvailableNow to Python sources
    major, minor = (int(p) for p in pyspark.__version__.split(".")[:2])
    if (major, minor) < (4, 2):
        raise MissingSpark(f"{hint} (found PySpark {pyspark.__version__})")


def register(spark: SparkSession) -> None:
    """Register the ``pybroker`` data source with a SparkSession."""
    require_pyspark()
    from pybroker.spark.source import PyBrokerDataSource

    spark.dataSource.register(PyBrokerDataSource)
