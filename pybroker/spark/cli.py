"""``pybroker spark archive``: the topic-to-Parquet pipeline on the command line.

``register(app)`` adds the ``spark`` command group to the ``pybroker`` command line;
``python -m pybroker.spark.cli archive ...`` runs it standalone. pyspark is imported
only when a command runs, so ``pybroker --help`` works without the extra installed.
Exit status: 0 done (or stopped by SIGINT/SIGTERM), 1 the query failed, 2 bad usage.
"""
from __future__ import annotations

import signal
import time
from typing import TYPE_CHECKING

import typer

from pybroker.client.config import parse_duration
from pybroker.stopflag import StopFlag

if TYPE_CHECKING:   # pyspark is imported when a job starts
    from pyspark.sql import SparkSession

    from pybroker.spark.pipeline import ArchiveJob

_HELP = "Process topics with Apache Spark (needs PySpark: the 'spark' extra)."


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"pybroker spark: {message}", err=True)
    raise typer.Exit(code)


def _conf_pairs(items: list[str]) -> dict[str, str]:
    conf = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            _fail(f"--conf wants KEY=VALUE, got {item!r}")
        conf[key.strip()] = value.strip()
    return conf


def archive(
    topic: str = typer.Option(..., "--topic", metavar="TEXT", help="the topic to archive"),
    channel: str = typer.Option("spark_archive", "--channel", metavar="TEXT",
                                help="mode log: the channel whose cursor follows what is "
                                     "written (so retention can delete it); mode channel: "
                                     "the channel to consume (FIN'd once written)"),
    output: str = typer.Option(..., "--output", metavar="PATH", help="the output directory (or URI)"),
    mode: str = typer.Option("log", "--mode", metavar="log|channel",
                             help="log: offset ranges of pybroker's log read in parallel, "
                                  "exactly once into files (needs --nsqd-http-address); "
                                  "channel: consume a channel of any nsqd, FIN after "
                                  "commit (at least once)"),
    nsqd_http_address: str = typer.Option("", "--nsqd-http-address", metavar="HOST:PORT",
                                          help="mode log: the broker's HTTP address"),
    starting_offsets: str = typer.Option("earliest", "--starting-offsets", metavar="TEXT",
                                         help="mode log, first run only (then the "
                                              "checkpoint's offsets): earliest, latest, "
                                              "an offset, {\"ts\": UNIX_MS} or an ISO "
                                              "8601 time"),
    max_offsets_per_trigger: int = typer.Option(0, "--max-offsets-per-trigger", metavar="INT",
                                                help="mode log: messages per micro-batch "
                                                     "at most (0: all available)"),
    num_partitions: int = typer.Option(2, "--num-partitions", metavar="INT",
                                       help="Spark partitions (parallel reads) per "
                                            "micro-batch"),
    nsqd_tcp_address: list[str] | None = typer.Option(None, "--nsqd-tcp-address", metavar="HOST:PORT",
                                               help="nsqd TCP address (repeatable)"),
    lookupd_http_address: list[str] | None = typer.Option(None, "--lookupd-http-address", metavar="HOST:PORT",
                                                   help="nsqlookupd HTTP address "
                                                        "(repeatable)"),
    master: str = typer.Option("local[*]", "--master", metavar="URL",
                               help="Spark master URL (local[*]: a local Spark with a core per "
                                    "CPU; spark://HOST:7077: a standalone cluster)"),
    fmt: str = typer.Option("parquet", "--format", metavar="parquet|orc|json", help="parquet, orc or json"),
    trigger: str = typer.Option("10s", "--trigger", metavar="DURATION", help="micro-batch interval"),
    available_now: bool = typer.Option(False, "--available-now",
                                       help="archive what was published until now, then "
                                            "exit (for batch/cron runs)"),
    checkpoint: str = typer.Option("", "--checkpoint", metavar="PATH",
                                   help="checkpoint directory",
                                   show_default="OUTPUT/_checkpoint"),
    json_schema: str = typer.Option("", "--json-schema", metavar="DDL",
                                    help="parse JSON bodies into columns with this DDL "
                                         "schema, e.g. 'user string, amount double'"),
    max_in_flight: int = typer.Option(2500, "--max-in-flight", metavar="INT",
                                      help="mode channel: messages held un-FIN'd at most"),
    batch_size: int = typer.Option(0, "--batch-size", metavar="INT",
                                   help="mode channel: messages per micro-batch at most "
                                        "(no more than half of --max-in-flight)",
                                   show_default="half of --max-in-flight"),
    drain_timeout: str = typer.Option("2s", "--drain-timeout", metavar="DURATION",
                                      help="mode channel, --available-now: idle time, with "
                                           "every server heard from, that means the "
                                           "channel is drained"),
    conf: list[str] | None = typer.Option(None, "--conf", metavar="KEY=VALUE", help="Spark setting KEY=VALUE "
                                                       "(repeatable)"),
) -> None:
    """Stream a topic into files partitioned by date and hour (Parquet by default)."""
    from pybroker.spark import MissingSpark
    from pybroker.spark.options import OptionError

    try:
        trigger_s = parse_duration(trigger)
        parse_duration(drain_timeout)
    except ValueError as e:
        _fail(str(e))
    try:
        from pybroker.spark.pipeline import (
            ArchiveJob,
            JobError,
            existing_session,
            spark_session,
        )
    except MissingSpark as e:
        _fail(str(e), 1)
    job = ArchiveJob(topic=topic, channel=channel, output=output, mode=mode,
                     nsqd_http=nsqd_http_address, starting_offsets=starting_offsets,
                     max_offsets_per_trigger=max_offsets_per_trigger,
                     num_partitions=num_partitions,
                     nsqd=list(nsqd_tcp_address or []),
                     lookupd=list(lookupd_http_address or []), format=fmt, trigger_s=trigger_s,
                     available_now=available_now, checkpoint=checkpoint,
                     json_schema=json_schema, max_in_flight=max_in_flight,
                     max_batch_size=batch_size, drain_timeout=drain_timeout)
    try:
        job.validate()
        # A session this process already runs (a notebook, a test) is used as it is
        # and left running; otherwise the command makes its own and stops it.
        owned = existing_session() is None
        spark = spark_session(master, f"pybroker-archive-{topic}",
                              _conf_pairs(list(conf or [])))
    except (JobError, MissingSpark) as e:
        _fail(str(e), 2 if isinstance(e, JobError) else 1)
    try:
        code = _run(spark, job)
    except (JobError, OptionError) as e:
        _fail(str(e))
    finally:
        if owned:
            spark.stop()
    raise typer.Exit(code)


def _run(spark: SparkSession, job: ArchiveJob) -> int:
    from pybroker.spark.pipeline import batch_rows, start_archive, wait_for

    stop = StopFlag()     # set by the signal handlers: no lock
    previous = {s: signal.signal(s, lambda *_: stop.set())
                for s in (signal.SIGINT, signal.SIGTERM)}
    seen: dict[int, int] = {}
    started = time.monotonic()
    try:
        query = start_archive(spark, job)
        source = (f"{job.topic} (log of {job.nsqd_http})" if job.mode == "log"
                  else f"{job.topic}/{job.channel}")
        typer.echo(f"archiving {source} to {job.output} "
                   f"(checkpoint {job.checkpoint_dir})", err=True)
        while not stop.is_set():
            ended = wait_for(query, 0.5)
            seen.update(batch_rows(query))
            if ended:
                break
        if query.isActive:
            query.stop()
        seen.update(batch_rows(query))
        error = query.exception()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    rows = sum(seen.values())
    took = time.monotonic() - started
    if error is not None:
        typer.echo(f"pybroker spark: archive query failed: {error}", err=True)
        return 1
    typer.echo(f"archived {rows} messages in {sum(1 for n in seen.values() if n)} "
               f"batches in {took:.1f}s", err=True)
    return 0


def make_app() -> typer.Typer:
    """The ``spark`` command group."""
    app = typer.Typer(add_completion=False, no_args_is_help=True, help=_HELP)

    @app.callback()
    def _group() -> None:
        """Process topics with Apache Spark."""

    app.command("archive")(archive)
    return app


def register(app: typer.Typer) -> None:
    """Add the ``spark`` command group (``pybroker spark archive``) to ``app``."""
    app.add_typer(make_app(), name="spark", help=_HELP)


def main() -> None:
    make_app()()


if __name__ == "__main__":
    main()
