"""``pybroker pub``: publish stdin to a topic, one message per delimited piece (to_nsq).

Pieces are split on ``--delimiter`` (one byte, default newline); empty pieces are
skipped, and a last piece without a trailing delimiter is published whole (less one
trailing newline when the delimiter is not newline, as ``echo a,b,c`` gives to_nsq). Every piece
goes to every ``--nsqd-tcp-address``. Publishing is pipelined (a window of unanswered
PUBs per server), keeps stdin's order, and stops at the first error (exit status 1).
``--rate`` throttles to N messages a second, with at most one second of burst.
"""
from __future__ import annotations

import logging
import queue
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import BinaryIO, List, cast

import typer

from pybroker import __version__
from pybroker.client import Config, Producer
from pybroker.stopflag import StopFlag
from pybroker.tools._common import Progress, StopSignals, apply_opts, fatal, opt, setup_logging

log = logging.getLogger("pybroker.tools")
_WINDOW = 512
_EOF = object()


def binary_stdin() -> BinaryIO:
    """stdin's bytes, unbuffered where it can be: the reader thread is a daemon, and a
    daemon blocked in a BufferedReader's read holds its lock, which makes the exit after
    an error (before stdin ended) a fatal error at interpreter shutdown."""
    buf: object = getattr(sys.stdin, "buffer", sys.stdin)
    return cast(BinaryIO, getattr(buf, "raw", buf))


def read_pieces(stream: BinaryIO, delim: bytes, out: "queue.Queue[object]") -> None:
    """Split ``stream`` on ``delim`` into ``out``, then put _EOF (reader thread)."""
    rest = b""
    try:
        while True:
            chunk = stream.read1(65536) if hasattr(stream, "read1") else stream.read(65536)
            if not chunk:
                break
            parts = (rest + chunk).split(delim)
            rest = parts.pop()
            for p in parts:
                if p:
                    out.put(p)
        if delim != b"\n" and rest.endswith(b"\n"):
            rest = rest[:-1]     # `echo a,b,c | ... --delimiter=,` means a, b and c
        if rest:
            out.put(rest)
    except (OSError, ValueError) as e:
        out.put(e)
    out.put(_EOF)


class Throttle:
    """to_nsq's --rate: N per second, unused capacity bounded to one second."""

    def __init__(self, rate: int) -> None:
        self.interval = 1.0 / rate if rate >= 1 else 0.0
        self.burst = float(rate)
        self._next = time.monotonic()

    def wait(self, stop: StopFlag) -> None:
        if not self.interval:
            return
        now = time.monotonic()
        self._next = max(self._next, now - self.burst * self.interval)
        if self._next > now:
            stop.wait(self._next - now)
        self._next += self.interval


def pub_command(
    topic: str = opt("", "topic", help="NSQ topic to publish to"),
    delimiter: str = opt("\n", "delimiter", help="character to split input from stdin"),
    nsqd_tcp_address: List[str] = opt([], "nsqd-tcp-address", help="destination nsqd TCP "
                                      "address (may be given multiple times)"),
    rate: int = opt(0, "rate", help="Throttle messages to n/second. 0 to disable"),
    producer_opt: List[str] = opt([], "producer-opt", help="option to passthrough to the "
                                  "Producer, name,value (may be given multiple times)"),
    version: bool = opt(False, "version", help="print version string"),
) -> None:
    """Publish lines from stdin to a topic (to_nsq)."""
    if version:
        typer.echo(f"pybroker pub v{__version__}")
        return
    setup_logging("warn")
    if not topic:
        fatal("--topic required")
    delim = delimiter.encode("utf-8")
    if len(delim) != 1:
        fatal("--delimiter must be a single byte")
    if not nsqd_tcp_address:
        fatal("--nsqd-tcp-address required")
    cfg = Config(user_agent=f"pybroker-pub/{__version__}")
    apply_opts(cfg, producer_opt, "producer-opt")
    producers = [Producer(addr, cfg) for addr in dict.fromkeys(nsqd_tcp_address)]
    if rate >= 1:
        log.info("Throttling messages rate to max:%d/second", rate)

    pieces: queue.Queue[object] = queue.Queue(maxsize=4096)
    reader = threading.Thread(target=read_pieces, args=(binary_stdin(), delim, pieces),
                              name="stdin-reader", daemon=True)
    progress = Progress("pub")
    windows: list[deque[Future[bytes]]] = [deque() for _ in producers]
    error: str | None = None
    throttle = Throttle(rate)

    def settle(window: deque[Future[bytes]], keep: int) -> None:
        while len(window) > keep:
            window.popleft().result()

    with StopSignals() as signals:
        reader.start()
        progress.start()
        try:
            while not signals.stop.is_set():
                try:
                    item = pieces.get(timeout=0.2)
                except queue.Empty:
                    continue
                if item is _EOF:
                    break
                if isinstance(item, Exception):
                    raise item
                assert isinstance(item, bytes)
                throttle.wait(signals.stop)
                for p, window in zip(producers, windows, strict=True):
                    window.append(p.publish_async(topic, item))
                    settle(window, _WINDOW)
                progress.add(1, len(item))
            for window in windows:
                settle(window, 0)
        except Exception as e:
            error = str(e) or type(e).__name__
        finally:
            progress.stop()
            for p in producers:
                p.stop()
    if error is not None:
        fatal(error)
