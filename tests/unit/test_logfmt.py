"""The log writer (pybroker.logfmt.LineWriter): a caller never waits on the stream, the
lines waiting are bounded and those past the bound are counted in a line of their own,
the order is kept, and what waits is written at close."""
from __future__ import annotations

import contextlib
import logging
import os
import threading

import pytest

from pybroker.logfmt import LineWriter, NsqFormatter
from pybroker.testing import wait_until


def _record(i: int) -> logging.LogRecord:
    return logging.makeLogRecord({"levelno": logging.INFO, "levelname": "INFO",
                                  "msg": "line %d of %s", "args": (i, "many")})


def test_lines_in_order_formatted_like_nsqd() -> None:
    r, w = os.pipe()
    stream = os.fdopen(w, "w")
    writer = LineWriter(stream, NsqFormatter("[pybroker] "))
    for i in range(100):
        writer.emit(_record(i))
    writer.close()
    stream.close()
    with os.fdopen(r) as f:
        lines = f.read().splitlines()
    assert [line.split(": ", 1)[1] for line in lines] == [f"line {i} of many"
                                                          for i in range(100)]
    assert all(line.startswith("[pybroker] ") and " INFO: " in line for line in lines)


@pytest.mark.timeout(30)
def test_a_stream_that_does_not_drain_never_holds_the_caller() -> None:
    """Nobody reads the pipe: its 64 KiB fill, the writer thread waits in write, and
    20,000 emits still return at once; at most max_waiting are kept, the rest are
    counted, and every emitted line is either written or in the count."""
    r, w = os.pipe()
    stream = os.fdopen(w, "w")
    writer = LineWriter(stream, NsqFormatter(""), max_waiting=1000)
    emitted = 20_000
    for i in range(emitted):              # (a StreamHandler would wait here for good)
        writer.emit(_record(i))
    assert len(writer._waiting) <= 1000
    got: list[str] = []

    def drain() -> None:
        with os.fdopen(r) as f:
            got.extend(f.read().splitlines())

    reader = threading.Thread(target=drain)
    reader.start()
    # the dropped count is written once the writer has caught up: emit one more
    wait_until(lambda: not writer._waiting, 10, what="the writer to catch up")
    writer.emit(_record(emitted))
    writer.close()
    stream.close()
    reader.join(10)
    lines = [line for line in got if "log lines dropped" not in line]
    dropped = [line for line in got if "log lines dropped" in line]
    count = sum(int(line.split("WARN: ")[1].split()[0]) for line in dropped)
    assert count > 0 and len(lines) + count == emitted + 1, (len(lines), dropped)
    numbers = [int(line.split("line ")[1].split()[0]) for line in lines]
    assert numbers == sorted(numbers) and numbers[-1] == emitted


@pytest.mark.timeout(30)
def test_lines_dropped_just_before_close_are_counted() -> None:
    """Closed while the writer still drains the burst that overflowed: the count of the
    dropped lines is written with the last lines (it was lost when the close came in
    the same drain as them)."""
    for _ in range(5):
        r, w = os.pipe()
        stream = os.fdopen(w, "w")
        writer = LineWriter(stream, NsqFormatter(""), max_waiting=100)
        emitted = 5_000
        for i in range(emitted):
            writer.emit(_record(i))
        got: list[str] = []

        def drain(fd: int = r, into: list[str] = got) -> None:
            with os.fdopen(fd) as f:
                into.extend(f.read().splitlines())

        reader = threading.Thread(target=drain)
        reader.start()
        writer.close()
        stream.close()
        reader.join(10)
        lines = [line for line in got if "log lines dropped" not in line]
        counts = [int(line.split("WARN: ")[1].split()[0]) for line in got
                  if "log lines dropped" in line]
        assert counts and len(lines) + sum(counts) == emitted, (len(lines), counts)


def test_the_message_is_made_when_logged() -> None:
    """An argument that changes after the call does not change the line."""
    r, w = os.pipe()
    stream = os.fdopen(w, "w")
    writer = LineWriter(stream, NsqFormatter(""))
    state = ["before"]
    rec = logging.makeLogRecord({"levelno": logging.INFO, "levelname": "INFO",
                                 "msg": "state %s", "args": (state,)})
    writer.emit(rec)
    state[0] = "after"
    writer.close()
    stream.close()
    with os.fdopen(r) as f:
        assert f.read().strip().endswith("INFO: state ['before']")


def test_a_closed_stream_costs_the_lines_not_the_writer() -> None:
    r, w = os.pipe()
    os.close(r)
    stream = os.fdopen(w, "w")
    writer = LineWriter(stream, NsqFormatter(""))
    writer.emit(_record(1))              # EPIPE (SIGPIPE is ignored by Python)
    wait_until(lambda: not writer._waiting, 5, what="the write")
    writer.emit(_record(2))
    writer.close()
    assert not writer._thread.is_alive()
    with contextlib.suppress(OSError):
        stream.close()


def test_a_bad_format_costs_its_line_not_the_caller() -> None:
    r, w = os.pipe()
    stream = os.fdopen(w, "w")
    writer = LineWriter(stream, NsqFormatter(""))
    writer.emit(logging.makeLogRecord({"levelno": logging.INFO, "levelname": "INFO",
                                       "msg": "two %d %d", "args": (1,)}))
    writer.emit(_record(7))
    writer.close()
    stream.close()
    with os.fdopen(r) as f:
        lines = f.read().splitlines()
    assert "could not be formatted: 'two %d %d' % (1,)" in lines[0], lines
    assert lines[1].endswith("INFO: line 7 of many"), lines
