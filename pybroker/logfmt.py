"""The broker's log lines, in nsqd's format: ``<prefix>2006/01/02 15:04:05.000000 INFO: ...``.

Owns the ``pybroker`` logger's handler. Shared by ``pybroker serve`` (prefix
``[pybroker] ``) and ``pybroker-nsqd`` (nsqd's ``[nsqd] ``, or ``--log-prefix``); imports
only ``logging``, so either command sets it up before the heavy imports.

A loop never writes a line itself: ``LineWriter`` takes the record (its message made
then) and a thread of its own formats and writes it. A write to stderr can wait (a
pipe its reader empties slowly, a terminal), and a loop that waited there held every
client it serves; a burst of 10,000 connections logs 10,000 lines. The lines waiting
are bounded (``MAX_WAITING``): past it they are counted, not kept, and the count is
written as a line of its own once the writer catches up.
"""
from __future__ import annotations

import atexit
import collections
import logging
import sys
import threading
import time

TYPE_CHECKING = False     # (typing is not imported this early: start-up time)
if TYPE_CHECKING:
    from typing import TextIO

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warn": logging.WARNING,
          "warning": logging.WARNING, "error": logging.ERROR, "fatal": logging.CRITICAL}


_LEVEL_WORDS = {"WARNING": "WARN", "CRITICAL": "FATAL"}   # nsqd's words for them


class NsqFormatter(logging.Formatter):
    """nsqd's log line: ``[pybroker] 2006/01/02 15:04:05.000000 INFO: message``."""

    def __init__(self, prefix: str = "[pybroker] ") -> None:
        super().__init__()
        self.prefix = prefix
        self._second = -1         # the whole second last formatted, and its text
        self._second_text = ""

    def format(self, record: logging.LogRecord) -> str:
        created = record.created
        second = int(created)
        if second != self._second:
            self._second_text = time.strftime("%Y/%m/%d %H:%M:%S", time.localtime(second))
            self._second = second
        stamp = f"{self._second_text}.{int((created - second) * 1e6):06d}"
        level = _LEVEL_WORDS.get(record.levelname, record.levelname)
        text = f"{self.prefix}{stamp} {level}: {record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


MAX_WAITING = 10_000      # records waiting for the writer thread at most (a few MB)
LINGER_S = 0.005          # a woken writer waits this long for more lines first
WRITE_SLICE = 256         # lines formatted between two writes (about 1 ms of CPU)
STOP_WAIT_S = 5.0         # at exit: longest wait for the lines still waiting


class LineWriter(logging.Handler):
    """Records queued for a writer thread; ``emit`` never waits on the stream."""

    def __init__(self, stream: TextIO, formatter: logging.Formatter,
                 max_waiting: int = MAX_WAITING) -> None:
        super().__init__()
        self.setFormatter(formatter)
        self.stream = stream
        self.max_waiting = max_waiting
        self._waiting: collections.deque[logging.LogRecord | None] = collections.deque()
        self._ready = threading.Event()
        self._dropped = 0         # lines not kept since the last count was written
        self._drops = threading.Lock()   # (taken only when a line is dropped)
        self._thread = threading.Thread(target=self._run, name="log-writer", daemon=True)
        self._thread.start()

    def handle(self, record: logging.LogRecord) -> bool:
        """``emit`` without Handler's lock: a deque's append is safe from any thread."""
        self.emit(record)
        return True

    def emit(self, record: logging.LogRecord) -> None:
        if len(self._waiting) >= self.max_waiting:
            with self._drops:
                self._dropped += 1
            return
        # the message now, with the arguments as they are (an object can change later)
        try:
            record.msg = record.getMessage()
        except Exception:      # a bad format or argument: its line says so, never raises
            record.msg = f"(a log line that could not be formatted: {record.msg!r} " \
                         f"% {record.args!r})"
        record.args = None
        self._waiting.append(record)
        if not self._ready.is_set():   # (the writer clears it before it drains)
            self._ready.set()

    def _run(self) -> None:
        waiting, ready = self._waiting, self._ready
        while True:
            ready.wait()
            # lines come in bursts (a connection's, a storm of connections): wait for the
            # rest of it, so that the thread is woken (and takes the GIL) once for them
            time.sleep(LINGER_S)
            ready.clear()       # before the drain: a record queued during it sets it again
            while waiting:
                # a slice at a time: the write between slices gives the GIL back
                lines: list[str] = []
                while waiting and len(lines) < WRITE_SLICE:
                    record = waiting.popleft()
                    if record is None:       # closing: the count too, if lines were lost
                        self._write(lines + self._dropped_line())
                        return
                    lines.append(self._line(record))
                self._write(lines)
            self._write(self._dropped_line())

    def _dropped_line(self) -> list[str]:
        """The line that counts the lines dropped since the last such line (or none)."""
        with self._drops:
            dropped, self._dropped = self._dropped, 0
        if not dropped:
            return []
        return [self._line(logging.makeLogRecord({
            "levelno": logging.WARNING, "levelname": "WARNING",
            "msg": f"{dropped} log lines dropped: more than {self.max_waiting} "
                   "waited to be written"}))]

    def _line(self, record: logging.LogRecord) -> str:
        try:
            return self.format(record) + "\n"
        except Exception:          # a bad record costs its line, never the writer
            return f"(a log line that could not be formatted: {record.msg!r})\n"

    def _write(self, lines: list[str]) -> None:
        if not lines:
            return
        try:
            self.stream.write("".join(lines))
            self.stream.flush()
        except (OSError, ValueError):
            pass                    # stderr closed or gone: nothing left to tell

    def close(self) -> None:
        """Write what is waiting (up to STOP_WAIT_S) and stop the thread."""
        if self._thread.is_alive():
            self._waiting.append(None)
            self._ready.set()
            self._thread.join(STOP_WAIT_S)
        super().close()


def setup_logging(level: str, prefix: str = "[pybroker] ") -> logging.Logger:
    """The ``pybroker`` logger, writing nsqd's lines to stderr at ``level`` from a
    thread of its own (``LineWriter``); its lines are written at exit."""
    # what the lines never show, not looked up for each record (the logging HOWTO's
    # "Optimization"): the caller's frame, thread and process
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    handler = LineWriter(sys.stderr, NsqFormatter(prefix))
    atexit.register(handler.close)
    root = logging.getLogger("pybroker")
    for old in root.handlers:
        old.close()
    root.handlers[:] = [handler]
    root.setLevel(LEVELS.get(level.lower(), logging.INFO))
    root.propagate = False
    return root
