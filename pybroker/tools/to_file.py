"""``pybroker to-file``: write topics to rotating local files (nsq_to_file's flags and files).

Topics come from ``--topic`` (repeatable) or, with ``--topic-pattern`` (a regular
expression, unanchored like Go's MatchString), from nsqlookupd's ``/topics`` every
``--topic-refresh``. Each topic gets a FileLogger (file_logger.py). SIGINT/SIGTERM sync,
FIN and close everything, then exit 0; SIGHUP syncs and closes the current files.
"""
from __future__ import annotations

import logging
import re
import threading
from typing import List

import typer

from pybroker import __version__
from pybroker.client import Config
from pybroker.client.lookupd import lookupd_topics
from pybroker.tools._common import (Progress, StopSignals, apply_opts, duration, fatal, opt,
                                    setup_logging)
from pybroker.tools.file_logger import FileLogger, FileOptions
from pybroker.tools.files import compute_filename_format, host_identifier

log = logging.getLogger("pybroker.tools")


class TopicDiscoverer:
    """Starts a FileLogger per allowed topic; owned by the command's main thread."""

    def __init__(self, opts: FileOptions, config: Config, nsqd: list[str], lookupd: list[str],
                 pattern: str, progress: Progress) -> None:
        self.opts, self.config = opts, config
        self.nsqd, self.lookupd = nsqd, lookupd
        self.pattern = re.compile(pattern) if pattern else None
        self.progress = progress
        self.loggers: dict[str, FileLogger] = {}
        self._lock = threading.RLock()     # re-entrant: SIGHUP's handler takes it too

    def allowed(self, topic: str) -> bool:
        return self.pattern is None or self.pattern.search(topic) is not None

    def update_topics(self, topics: list[str], strict: bool = False) -> None:
        """Start loggers for new topics; ``strict`` turns a failure into an exit."""
        for topic in topics:
            if topic in self.loggers:
                continue
            if not self.allowed(topic):
                log.warning("skipping topic %s (doesn't match pattern %s)", topic,
                            self.pattern.pattern if self.pattern else "")
                continue
            try:
                fl = FileLogger(topic, self.opts, self.config, self.progress.add)
                fl.connect(self.nsqd, self.lookupd)
            except Exception as e:
                if strict:
                    self.stop()
                    fatal(f"couldn't create logger for new topic {topic}: {e}")
                log.error("couldn't create logger for new topic %s: %s", topic, e)
                continue
            with self._lock:
                self.loggers[topic] = fl
            fl.start()

    def discover(self, timeout_s: float) -> None:
        topics: set[str] = set()
        errors = []
        for addr in self.lookupd:
            try:
                topics.update(lookupd_topics(addr, timeout_s))
            except (OSError, ValueError) as e:
                errors.append(f"{addr}: {e}")
        if errors and len(errors) == len(self.lookupd):
            log.error("could not retrieve topic list: %s", "; ".join(errors))
            return
        self.update_topics(sorted(topics))

    def hup(self) -> None:
        with self._lock:
            for fl in self.loggers.values():
                fl.hup()

    def stop(self) -> None:
        with self._lock:
            loggers = list(self.loggers.values())
        for fl in loggers:
            fl.terminate()
        for fl in loggers:
            fl.join(60.0)


def to_file_command(
    topic: List[str] = opt([], "topic", help="nsq topic (may be given multiple times)"),
    topic_pattern: str = opt("", "topic-pattern",
                             help="only log topics matching the following pattern"),
    topic_refresh: str = opt("1m", "topic-refresh",
                             help="how frequently the topic list should be refreshed"),
    channel: str = opt("nsq_to_file", "channel", help="nsq channel"),
    max_in_flight: int = opt(200, "max-in-flight",
                             help="max number of messages to allow in flight"),
    output_dir: str = opt("/tmp", "output-dir", help="directory to write output files to"),
    work_dir: str = opt("", "work-dir", help="directory for in-progress files before "
                        "moving to output-dir"),
    datetime_format: str = opt("%Y-%m-%d_%H", "datetime-format", help="strftime compatible "
                               "format for <DATETIME> in filename format"),
    filename_format: str = opt("<TOPIC>.<HOST><REV>.<DATETIME>.log", "filename-format",
                               help="output filename format (<TOPIC>, <HOST>, <PID>, "
                               "<DATETIME>, <REV> are replaced. <REV> is increased when "
                               "file already exists)"),
    host_identifier_: str = opt("", "host-identifier", help="value to output in log "
                                "filename in place of hostname. <SHORT_HOST> and "
                                "<HOSTNAME> are valid replacement tokens"),
    gzip_level: int = opt(6, "gzip-level", help="gzip compression level (1-9, "
                          "1=BestSpeed, 9=BestCompression)"),
    gzip: bool = opt(False, "gzip", help="gzip output files."),
    skip_empty_files: bool = opt(False, "skip-empty-files", help="skip writing empty files"),
    rotate_size: int = opt(0, "rotate-size", help="rotate the file when it grows bigger "
                           "than `rotate-size` bytes"),
    rotate_interval: str = opt("0", "rotate-interval", help="rotate the file every duration"),
    sync_interval: str = opt("30s", "sync-interval", help="sync file to disk every duration"),
    http_client_connect_timeout: str = opt("2s", "http-client-connect-timeout",
                                           help="timeout for HTTP connect"),
    http_client_request_timeout: str = opt("5s", "http-client-request-timeout",
                                           help="timeout for HTTP request"),
    nsqd_tcp_address: List[str] = opt([], "nsqd-tcp-address",
                                      help="nsqd TCP address (may be given multiple times)"),
    lookupd_http_address: List[str] = opt(
        [], "lookupd-http-address", help="lookupd HTTP address (may be given multiple times)"),
    consumer_opt: List[str] = opt([], "consumer-opt", help="option to passthrough to the "
                                  "Consumer, name,value (may be given multiple times)"),
    log_level: str = opt("info", "log-level", help="set log verbosity: debug, info, warn, "
                         "error, or fatal"),
    log_prefix: str = opt("[to-file] ", "log-prefix", help="log message prefix"),
    version: bool = opt(False, "version", help="print version string"),
) -> None:
    """Write messages of topics to local files (nsq_to_file)."""
    if version:
        typer.echo(f"pybroker to-file v{__version__}")
        return
    setup_logging(log_level, log_prefix)
    if not channel:
        fatal("--channel is required")
    connect_s = duration(http_client_connect_timeout, "http-client-connect-timeout")
    request_s = duration(http_client_request_timeout, "http-client-request-timeout")
    if connect_s <= 0:
        fatal("--http-client-connect-timeout should be positive")
    if request_s <= 0:
        fatal("--http-client-request-timeout should be positive")
    if not nsqd_tcp_address and not lookupd_http_address:
        fatal("--nsqd-tcp-address or --lookupd-http-address required.")
    if nsqd_tcp_address and lookupd_http_address:
        fatal("use --nsqd-tcp-address or --lookupd-http-address not both")
    if not 1 <= gzip_level <= 9:
        fatal(f"invalid --gzip-level value ({gzip_level}), should be 1-9")
    if not topic and not topic_pattern:
        fatal("--topic or --topic-pattern required")
    if not topic and not lookupd_http_address:
        fatal("--lookupd-http-address must be specified when no --topic specified")
    if topic_pattern:
        try:
            re.compile(topic_pattern)
        except re.error as e:
            fatal(f"invalid --topic-pattern: {e}")
    opts = FileOptions(
        channel=channel, output_dir=output_dir, work_dir=work_dir or output_dir,
        datetime_format=datetime_format, filename_format=filename_format,
        host=host_identifier(host_identifier_), gzip=gzip, gzip_level=gzip_level,
        skip_empty_files=skip_empty_files, rotate_size=rotate_size,
        rotate_interval=duration(rotate_interval, "rotate-interval"),
        sync_interval=duration(sync_interval, "sync-interval"), max_in_flight=max_in_flight)
    if opts.sync_interval <= 0:
        fatal("--sync-interval should be positive")
    try:
        compute_filename_format(opts.filename_format, "t", gzip=opts.gzip,
                                rotating=opts.rotate_size > 0 or opts.rotate_interval > 0,
                                work_dir_differs=opts.work_dir != opts.output_dir, host="h")
    except ValueError as e:
        fatal(str(e))
    cfg = Config(user_agent=f"pybroker-to-file/{__version__}")
    apply_opts(cfg, consumer_opt, "consumer-opt")
    cfg.max_in_flight = max_in_flight
    refresh_s = duration(topic_refresh, "topic-refresh")

    progress = Progress("to-file")
    discoverer = TopicDiscoverer(opts, cfg, nsqd_tcp_address, lookupd_http_address,
                                 topic_pattern, progress)
    with StopSignals(hup=discoverer.hup) as signals:
        progress.start()
        discoverer.update_topics(list(dict.fromkeys(topic)), strict=True)
        if not topic:
            discoverer.discover(request_s)
            while not signals.wait(refresh_s):
                discoverer.discover(request_s)
        else:
            signals.wait()
        discoverer.stop()
        progress.stop()
