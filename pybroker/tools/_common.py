"""What the tools share: Go-style flags, fatal exits, stop signals, logging and progress.

NSQ's tools use Go's flag package, so scripts call them as ``-topic=x``, ``--topic x``
or ``-gzip=true``. Every option here is declared with both ``--name`` and ``-name``, and
``GoFlagsCommand`` turns ``-flag=true|false`` for boolean flags into click's form.
"""
from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from types import FrameType
from typing import TYPE_CHECKING, Any, Callable, NoReturn, TextIO

import typer
from typer.core import TyperCommand

from pybroker.client.config import Config, parse_duration
from pybroker.stopflag import StopFlag

if TYPE_CHECKING:
    from signal import _HANDLER   # what signal.signal returns (typeshed's name)

    # the click that typer bundles: TyperCommand's methods take its classes
    from typer._click import Context, HelpFormatter

_TRUE = {"1", "t", "true"}
_FALSE = {"0", "f", "false"}


class GoFlagsCommand(TyperCommand):
    """A typer command accepting Go's ``-boolflag=true|false`` spelling; its arguments'
    help shows their placeholder alone (``ID``), not typer's Python type (``ID <str>``)."""

    def format_help(self, ctx: Context, formatter: HelpFormatter) -> None:
        for p in self.params:
            if getattr(p, "param_type_name", "") == "argument" and p.metavar:
                setattr(p, "display_type_rich", lambda ctx: None)  # noqa: B010
        super().format_help(ctx, formatter)

    def parse_args(self, ctx: Context, args: list[str]) -> list[str]:
        names = [(name.lstrip("-"), bool(getattr(p, "is_flag", False)))
                 for p in self.params for name in getattr(p, "opts", [])]
        flags = {n for n, is_flag in names if is_flag}
        short = {n for n, is_flag in names if len(n) == 1 and not is_flag}
        out: list[str] = []
        for arg in args:
            if arg.startswith("--") and arg[2:3] and arg[3:4] in ("", "=") and \
                    arg[2] in short:
                arg = arg[1:]               # Go's --n: a one-letter flag, two dashes
            if arg.startswith("-") and "=" in arg:
                name, _, value = arg.lstrip("-").partition("=")
                if name in flags:
                    if value.lower() in _TRUE:
                        out.append("--" + name)
                    elif value.lower() not in _FALSE:
                        out.append(arg)     # let click report the bad value
                    continue
                if name in short:           # Go's -n=5; click reads "-n=5" as "-n '=5'"
                    out += ["-" + name, value]
                    continue
            out.append(arg)
        return super().parse_args(ctx, out)


def opt(default: object, name: str, *extra: str, help: str, metavar: str | None = None,
        show_default: bool | str | None = None, min: int | None = None,
        max: int | None = None) -> Any:   # typer.Option's own type: any parameter's default
    """``typer.Option`` with Go's single-dash alias (``--topic`` and ``-topic``).

    The value's placeholder in --help names its type (INT, HOST:PORT, TEXT), and a
    default holding control characters is shown escaped (``\\n``), never raw.
    """
    if metavar is None and not isinstance(default, bool):
        if name.endswith("-address"):
            metavar = "HOST:PORT"
        elif isinstance(default, int):
            metavar = "INT"
        elif isinstance(default, float):
            metavar = "FLOAT"
        else:
            metavar = "TEXT"
    if show_default is None:
        show_default = True     # typer's default
        if isinstance(default, str) and default and not default.isprintable():
            show_default = default.encode("unicode_escape").decode("ascii")
    return typer.Option(default, f"--{name}", f"-{name}", *extra, help=help, metavar=metavar,
                        show_default=show_default, min=min, max=max)


def fatal(message: str) -> NoReturn:
    """Go's log.Fatal: a dated line on stderr, exit status 1."""
    sys.stderr.write(time.strftime("%Y/%m/%d %H:%M:%S ") + message + "\n")
    sys.stderr.flush()
    raise typer.Exit(1)


def duration(value: str, flag: str) -> float:
    """Parse a Go duration flag value or exit like Go's flag package would."""
    try:
        return parse_duration(value)
    except ValueError:
        fatal(f'invalid value "{value}" for flag -{flag}: parse error')


def apply_opts(config: Config, opts: list[str], flag: str) -> None:
    """Apply ``--consumer-opt``/``--producer-opt`` values ("name,value")."""
    for text in opts:
        try:
            config.set_flag(text)
        except ValueError as e:
            fatal(f"invalid value {text!r} for flag -{flag}: {e}")


_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warn": logging.WARNING,
           "warning": logging.WARNING, "error": logging.ERROR, "fatal": logging.CRITICAL}


def setup_logging(level: str = "warn", prefix: str = "") -> None:
    """Send the client's and tools' logs to stderr, Go's log format, at ``level``."""
    if level.lower() not in _LEVELS:
        fatal("--log-level is invalid")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(prefix + "%(asctime)s %(levelname)s: %(message)s",
                                           "%Y/%m/%d %H:%M:%S"))
    for name in ("pybroker.client", "pybroker.tools"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(_LEVELS[level.lower()])
        logger.propagate = False


class StopSignals:
    """SIGINT/SIGTERM (and optionally SIGHUP) set events instead of killing the process.

    Use as a context manager in the main thread; the previous handlers come back after.
    The handlers take no lock: one that interrupted the main thread while it held the
    lock would wait for itself forever. So SIGHUP only counts, and ``wait`` (on the main
    thread) calls ``hup`` for it, within ``HUP_POLL_S``.
    """

    HUP_POLL_S = 0.1

    def __init__(self, hup: Callable[[], None] | None = None) -> None:
        self.stop = StopFlag()    # set by the handlers: no lock (see pybroker.stopflag)
        self.signal: int | None = None
        self._hup = hup
        self._hups = 0            # SIGHUPs received (the handler only counts)
        self._hups_done = 0
        self._saved: dict[int, _HANDLER] = {}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signal = signum
        self.stop.set()

    def _on_hup(self, signum: int, frame: FrameType | None) -> None:
        self._hups += 1

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._saved[sig] = signal.signal(sig, self._on_signal)
            if self._hup is not None:
                self._saved[signal.SIGHUP] = signal.signal(signal.SIGHUP, self._on_hup)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Sleep until a stop signal (or ``stop.set()``); True if stopped. Runs the
        ``hup`` callback for SIGHUPs received meanwhile."""
        if self._hup is None:
            return self.stop.wait(timeout_s)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if self.stop.wait(self.HUP_POLL_S if left is None
                              else max(0.0, min(left, self.HUP_POLL_S))):
                return True
            seen = self._hups
            if seen != self._hups_done:
                self._hups_done = seen
                self._hup()
            if left is not None and left <= self.HUP_POLL_S:
                return self.stop.is_set()


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


class Progress:
    """Messages and bytes so far and the current rate, redrawn on one TTY line.

    Silent (and threadless) unless ``stream`` is a terminal, so pipes stay clean.
    """

    def __init__(self, label: str, stream: TextIO | None = None, enabled: bool | None = None,
                 interval_s: float = 0.5) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            enabled = _isatty(self.stream)
        self.enabled = enabled
        self.interval_s = interval_s
        self.messages = 0
        self.bytes = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last = (time.monotonic(), 0)
        self._started = time.monotonic()
        self._rate = 0.0

    def add(self, messages: int = 1, nbytes: int = 0) -> None:
        with self._lock:
            self.messages += messages
            self.bytes += nbytes

    def start(self) -> "Progress":
        self._started = time.monotonic()
        self._last = (self._started, self.messages)
        if self.enabled:
            self._thread = threading.Thread(target=self._run, name="progress", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.draw()

    def draw(self) -> None:
        now = time.monotonic()
        with self._lock:
            msgs, nbytes = self.messages, self.bytes
        t0, m0 = self._last
        if now - t0 >= self.interval_s / 2:
            self._rate = (msgs - m0) / (now - t0)
            self._last = (now, msgs)
        line = (f"{self.label}: {msgs} messages, {_human_bytes(nbytes)}, "
                f"{self._rate:.0f} msg/s")
        try:
            self.stream.write("\r\x1b[K" + line)
            self.stream.flush()
        except (OSError, ValueError):
            pass

    def summary(self) -> str:
        """The closing line: totals, time taken and the average rate."""
        elapsed = max(time.monotonic() - self._started, 1e-9)
        with self._lock:
            msgs, nbytes = self.messages, self.bytes
        return (f"{self.label}: {msgs} messages, {_human_bytes(nbytes)} in {elapsed:.1f}s "
                f"({msgs / elapsed:.0f} msg/s)")

    def stop(self) -> None:
        """Stop redrawing and replace the progress line with the summary (TTY only)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(2)
        self._thread = None
        try:
            self.stream.write("\r\x1b[K" + self.summary() + "\n")
            self.stream.flush()
        except (OSError, ValueError):
            pass


def _isatty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
