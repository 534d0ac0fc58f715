"""Options of the ``pybroker`` Spark data source, parsed from Spark's string options.

Spark hands a data source its ``.option(k, v)`` pairs as strings in a case-insensitive
mapping. This module turns them into typed, validated dataclasses, one per role
(stream source, sink, archive reader), and owns the table columns shared by all three.
It imports neither pyspark nor any socket code.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pybroker.client.config import parse_duration
from pybroker.client.protocol import is_valid_channel_name, is_valid_topic_name

#: The columns of the live topic and of the archive: one row per message. ``offset`` is
#: the record's offset in the topic's log (mode log); null from a channel or an archive.
SCHEMA_DDL = ("id string, body binary, timestamp timestamp, attempts int, topic string, "
              "offset bigint")
COLUMNS = ("id", "body", "timestamp", "attempts", "topic", "offset")

#: nsqd's default --max-rdy-count: a larger RDY is refused, so in-flight stops there.
DEFAULT_MAX_IN_FLIGHT = 2500


class OptionError(ValueError):
    """A data source option is missing or malformed; the message names the option."""


def _get(options: Mapping[str, str], name: str, default: str = "") -> str:
    # Spark's CaseInsensitiveDict lower-cases keys; a plain dict may not have.
    for key in (name, name.lower()):
        if key in options and options[key] is not None:
            return str(options[key]).strip()
    for key, value in options.items():
        if key.lower() == name.lower() and value is not None:
            return str(value).strip()
    return default


def _int(options: Mapping[str, str], name: str, default: int, minimum: int = 0) -> int:
    text = _get(options, name)
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        raise OptionError(f"option {name}: {text!r} is not an integer") from None
    if value < minimum:
        raise OptionError(f"option {name}: must be >= {minimum}, got {value}")
    return value


def _seconds(options: Mapping[str, str], name: str, default: float) -> float:
    """A Go duration ("5s", "250ms") or a plain number of seconds."""
    text = _get(options, name)
    if not text:
        return default
    try:
        value = float(text) if text.replace(".", "", 1).isdigit() else parse_duration(text)
    except ValueError:
        raise OptionError(f"option {name}: {text!r} is not a duration") from None
    if value < 0:
        raise OptionError(f"option {name}: must not be negative")
    return value


def _addresses(options: Mapping[str, str], name: str) -> list[str]:
    text = _get(options, name)
    return [a.strip() for a in text.split(",") if a.strip()]


def _topic(options: Mapping[str, str], required: bool = True) -> str:
    topic = _get(options, "topic")
    if not topic:
        if required:
            raise OptionError("option topic is required")
        return ""
    if not is_valid_topic_name(topic):
        raise OptionError(f"option topic: invalid topic name {topic!r}")
    return topic


@dataclass(frozen=True)
class SourceOptions:
    """The streaming source: where to subscribe and how much to hold per micro-batch.

    ``max_batch_size`` is capped at half of ``max_in_flight``: Spark commits batch N only
    while it plans batch N+1, and planning N+1 needs room for new messages to arrive.
    """

    topic: str
    channel: str
    nsqd: list[str] = field(default_factory=list)
    lookupd: list[str] = field(default_factory=list)
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    max_batch_size: int = DEFAULT_MAX_IN_FLIGHT // 2
    num_partitions: int = 2
    msg_timeout_s: float = 0.0          # 0: the server's --msg-timeout
    touch_interval_s: float = 0.0       # 0: a third of the granted msg_timeout
    max_attempts: int = 0               # 0: never give up on a message
    drain_timeout_s: float = 2.0        # available-now: idle time (servers heard) = drained
    checkpoint: str = ""                # the query's checkpointLocation (local path)
    lookupd_poll_interval_s: float = 15.0

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> SourceOptions:
        """Raises OptionError for a missing or malformed option."""
        topic = _topic(options)
        channel = _get(options, "channel")
        if not channel:
            raise OptionError("option channel is required")
        if not is_valid_channel_name(channel):
            raise OptionError(f"option channel: invalid channel name {channel!r}")
        nsqd, lookupd = _addresses(options, "nsqd"), _addresses(options, "lookupd")
        if not nsqd and not lookupd:
            raise OptionError("give option nsqd (host:port,...) or lookupd (host:port,...)")
        max_in_flight = _int(options, "max_in_flight", DEFAULT_MAX_IN_FLIGHT, minimum=2)
        window = max_in_flight // 2
        batch = _int(options, "max_batch_size", window, minimum=1)
        if batch > window:
            raise OptionError(f"option max_batch_size: {batch} exceeds half of "
                              f"max_in_flight ({window}); a batch waiting for its commit "
                              "must leave room for the next one")
        return cls(
            topic=topic, channel=channel, nsqd=nsqd, lookupd=lookupd,
            max_in_flight=max_in_flight, max_batch_size=batch,
            num_partitions=_int(options, "num_partitions", 2, minimum=1),
            msg_timeout_s=_seconds(options, "msg_timeout", 0.0),
            touch_interval_s=_seconds(options, "touch_interval", 0.0),
            max_attempts=_int(options, "max_attempts", 0),
            drain_timeout_s=_seconds(options, "drain_timeout", 2.0),
            checkpoint=_get(options, "checkpoint"),
            lookupd_poll_interval_s=_seconds(options, "lookupd_poll_interval", 15.0) or 15.0,
        )


@dataclass(frozen=True)
class SinkOptions:
    """The sink: which nsqd(s) to publish to, and how to cut rows into MPUBs."""

    nsqd: list[str]
    topic: str = ""                     # "" : each row's ``topic`` column
    batch_size: int = 500               # messages per MPUB
    batch_bytes: int = 1 << 20          # bytes per MPUB (nsqd's --max-body-size is 5 MiB)
    pipeline: int = 4                   # MPUBs awaiting their OK at once
    timeout_s: float = 30.0             # wait this long for each OK

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> SinkOptions:
        """Raises OptionError for a missing or malformed option."""
        nsqd = _addresses(options, "nsqd")
        if not nsqd:
            raise OptionError("option nsqd (host:port,...) is required to publish")
        return cls(
            nsqd=nsqd, topic=_topic(options, required=False),
            batch_size=_int(options, "batch_size", 500, minimum=1),
            batch_bytes=_int(options, "batch_bytes", 1 << 20, minimum=1),
            pipeline=_int(options, "pipeline", 4, minimum=1),
            timeout_s=_seconds(options, "timeout", 30.0) or 30.0,
        )


@dataclass(frozen=True)
class ArchiveOptions:
    """The batch reader over ``pybroker to-file``/``nsq_to_file`` output files."""

    paths: list[str]
    topic: str = ""                     # "": every topic found
    datetime_format: str = "%Y-%m-%d_%H"
    utc: bool = False                   # to-file's --datetime-format is in local time
    batch_rows: int = 8192

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> ArchiveOptions:
        """Raises OptionError for a missing or malformed option."""
        paths = _addresses(options, "path") or _addresses(options, "paths")
        if not paths:
            raise OptionError("give the archive directory or files: .load(path)")
        return cls(
            paths=paths, topic=_topic(options, required=False),
            datetime_format=_get(options, "datetime_format", "%Y-%m-%d_%H"),
            utc=_get(options, "utc", "false").lower() in ("1", "true", "yes"),
            batch_rows=_int(options, "batch_rows", 8192, minimum=1),
        )


MODES = ("log", "channel")
#: bytes per range read (the broker caps a response at 4 MiB)
DEFAULT_FETCH_BYTES = 4 * 1024 * 1024


def source_mode(options: Mapping[str, str]) -> str:
    """``log`` (the partitioned source, the default) or ``channel`` (FIN after commit)."""
    mode = _get(options, "mode", "log").lower()
    if mode not in MODES:
        raise OptionError(f"option mode: {mode!r} is not one of {', '.join(MODES)}")
    return mode


def parse_starting_offsets(text: str) -> str | int | dict[str, int]:
    """``earliest``, ``latest``, an offset (integer), ``{"ts": unix_ms}`` or an ISO 8601
    time (UTC unless it has an offset) -> "earliest" | "latest" | int | {"ts": ms}."""
    import json
    from datetime import datetime, timezone

    text = text.strip()
    low = text.lower()
    if low in ("", "earliest"):
        return "earliest"
    if low == "latest":
        return "latest"
    if text.isdigit():
        return int(text)
    if text.startswith("{"):
        try:
            doc = json.loads(text)
        except ValueError:
            doc = None
        if (isinstance(doc, dict) and set(doc) <= {"ts", "offset"} and len(doc) == 1
                and isinstance(next(iter(doc.values())), int)
                and next(iter(doc.values())) >= 0):
            return {"ts": doc["ts"]} if "ts" in doc else int(doc["offset"])
        raise OptionError(f"option startingOffsets: {text!r}: want {{\"ts\": unix_ms}} "
                          "or {\"offset\": n}")
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise OptionError(f"option startingOffsets: {text!r} is not earliest, latest, an "
                          "offset, {\"ts\": unix_ms} or an ISO 8601 time") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return {"ts": int(when.timestamp() * 1000)}


@dataclass(frozen=True)
class LogSourceOptions:
    """The partitioned source (mode ``log``): offset ranges read from pybroker's HTTP API.

    ``channel`` names the channel whose cursor follows what Spark committed, so that
    retention can delete it; it must have no consumers of its own.
    """

    topic: str
    nsqd_http: str
    channel: str = "spark"
    starting_offsets: str | int | dict[str, int] = "earliest"
    max_offsets_per_trigger: int = 0        # 0: no limit
    num_partitions: int = 2
    fail_on_data_loss: bool = True
    fetch_bytes: int = DEFAULT_FETCH_BYTES
    timeout_s: float = 30.0
    checkpoint: str = ""                # the query's checkpointLocation (local path)

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> LogSourceOptions:
        """Raises OptionError for a missing or malformed option."""
        topic = _topic(options)
        http = _addresses(options, "nsqd_http")
        if not http:
            raise OptionError("option nsqd_http (host:port of pybroker's HTTP API) is "
                              "required by mode log; for a plain nsqd use mode channel")
        if len(http) > 1:
            raise OptionError("option nsqd_http: mode log reads one broker's log; give "
                              "one host:port (run one query per broker)")
        channel = _get(options, "channel", "spark")
        if not is_valid_channel_name(channel):
            raise OptionError(f"option channel: invalid channel name {channel!r}")
        parts = _int(options, "numPartitions", 0, minimum=1) if _get(
            options, "numPartitions") else _int(options, "num_partitions", 2, minimum=1)
        fail = _get(options, "failOnDataLoss", "true").lower()
        if fail not in ("true", "false", "1", "0", "yes", "no"):
            raise OptionError(f"option failOnDataLoss: {fail!r} is not true or false")
        return cls(
            topic=topic, nsqd_http=http[0], channel=channel,
            starting_offsets=parse_starting_offsets(_get(options, "startingOffsets")),
            max_offsets_per_trigger=_int(options, "maxOffsetsPerTrigger", 0),
            num_partitions=parts,
            fail_on_data_loss=fail in ("true", "1", "yes"),
            fetch_bytes=_int(options, "fetch_bytes", DEFAULT_FETCH_BYTES, minimum=1024),
            timeout_s=_seconds(options, "timeout", 30.0) or 30.0,
            checkpoint=_get(options, "checkpoint"),
        )
