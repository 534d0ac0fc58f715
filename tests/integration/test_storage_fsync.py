"""--durability=fsync answers a publish only after its record reached the disk: traced
with strace on the real server, the record's write to its topic log is followed by an
fsync/fdatasync before the OK is sent (TCP PUB/MPUB/DPUB and HTTP /pub). With the
default durability the record is written, but not synced, before the OK.

A kill -9 cannot tell these apart (the page cache survives the process), so the order
of system calls is the evidence. Skipped when strace is missing or cannot attach (a
failure in strict mode, as CI runs: tests/support/programs.py).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.broker import BrokerProcess, unique_name, wait_until
from tests.support.durability import create_channel, http
from tests.support.programs import missing, require_program
from tests.support.wire import WireClient

MakeBroker = Callable[..., BrokerProcess]
SYSCALLS = "fsync,fdatasync,pwrite64,pwritev,pwritev2,write,writev,sendto,sendmsg,recvfrom,read"
LINE_RE = re.compile(r"^(\d+)\s+[\d.]+\s+(\w+)\((\d+)(.*)$")
# a call another thread's call interrupted in the trace: its start, then the rest
# (a read's data is printed in the rest: "<... recvfrom resumed>"...", ...) = 40")
UNFINISHED = " <unfinished ...>"
RESUMED_RE = re.compile(r"^(\d+)\s+[\d.]+\s+<\.\.\. \w+ resumed>(.*)$")
ATTACHED_RE = re.compile(r"Process (\d+) attached(?: with (\d+) threads)?")


class Trace:
    """strace -f attached to a running server, writing to a file."""

    def __init__(self, strace: str, pid: int, out: Path) -> None:
        self.out = out
        self.proc = subprocess.Popen(
            [strace, "-f", "-y", "-ttt", "-s", "512", "-e", f"trace={SYSCALLS}", "-p", str(pid),
             "-o", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.err: list[str] = []
        self._reader = threading.Thread(target=self._read, name="strace-stderr", daemon=True)
        self._reader.start()
        # strace says "Process PID attached with N threads" once it holds all of them
        # (older versions: "Process TID attached" for each thread)
        threads = {int(t) for t in os.listdir(f"/proc/{pid}/task")}

        def attached() -> bool:
            if self.proc.poll() is not None:
                return True
            found = [m for m in map(ATTACHED_RE.search, list(self.err)) if m]
            if any(int(m.group(1)) == pid and m.group(2) for m in found):
                return True
            return threads <= {int(m.group(1)) for m in found}

        wait_until(attached, 10, what=f"strace to attach to the server's {len(threads)} "
                                      "threads")
        if self.proc.poll() is not None:
            self._reader.join(5)
            missing(f"strace cannot attach: {''.join(self.err).strip()[:200]}")

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            self.err.append(raw.decode("utf-8", "replace"))

    def calls(self) -> list[tuple[str, int, str]]:
        """(syscall, fd, rest of line) in the order traced so far."""
        out = []
        started: dict[str, str] = {}      # thread -> the start of its unfinished call
        for line in self.out.read_text(errors="replace").splitlines():
            if line.endswith(UNFINISHED):
                started[line.split(None, 1)[0]] = line[:-len(UNFINISHED)]
                continue
            resumed = RESUMED_RE.match(line)
            if resumed:
                start = started.pop(resumed.group(1), None)
                if start is None:
                    continue
                line = start + resumed.group(2)   # where it returned: its place in order
            m = LINE_RE.match(line)
            if m:
                out.append((m.group(2), int(m.group(3)), m.group(4)))
        return out

    def stop(self, marker: str, reply: str) -> list[tuple[str, int, str]]:
        """Wait until the reply to the request carrying ``marker`` is in the trace (strace
        writes a call when it returns, maybe after the client already read the reply),
        then detach; return the calls."""
        wait_until(lambda: _find(self.calls(), marker, reply) is not None, 10,
                   what=f"the reply to {marker!r} in the trace")
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(10)
        self._reader.join(5)
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        return self.calls()


def _find(calls: list[tuple[str, int, str]], marker: str, reply: str
          ) -> tuple[int, int] | None:
    """(index of the request carrying marker, index of its reply on the same fd)."""
    start = next((i for i, c in enumerate(calls)
                  if c[0] in ("recvfrom", "read") and marker in c[2]), None)
    if start is None:
        return None
    fd = calls[start][1]
    end = next((i for i in range(start + 1, len(calls))
                if calls[i][0] in ("sendto", "write", "sendmsg", "writev")
                and calls[i][1] == fd and reply in calls[i][2]), None)
    return None if end is None else (start, end)


def _between(calls: list[tuple[str, int, str]], marker: str, reply: str
             ) -> tuple[list[tuple[str, int, str]], int]:
    """The calls from the request carrying marker up to the reply on the same fd."""
    found = _find(calls, marker, reply)
    assert found is not None, f"request with {marker!r} or its reply not traced"
    start, end = found
    return calls[start:end + 1], calls[start][1]


def _is_file_write(call: tuple[str, int, str]) -> bool:
    """A write system call (a record reaching the topic log's file; replies to clients
    go out with send calls, so a write carrying the request's marker is the record)."""
    return call[0].startswith("pwrite") or call[0] in ("write", "writev")


def _publish(b: BrokerProcess, verb: str, topic: str, marker: bytes) -> str:
    """Publish marker with verb; return the text the reply frame/response carries."""
    if verb == "HTTP":
        q = urllib.parse.urlencode({"topic": topic})
        assert http(b, "POST", f"/pub?{q}", marker) == (200, b"OK")
        return "200 OK"
    with WireClient.connect(b.tcp_address) as c:  # type: ignore[arg-type]
        if verb == "PUB":
            c.pub(topic, marker)
        elif verb == "MPUB":
            c.mpub(topic, [marker, marker + b"-2"])
        else:
            c.dpub(topic, 5000, marker)
    return "OK"


@pytest.fixture
def strace_path() -> str:
    return require_program("strace", "(Debian package strace) to trace the fsync calls")


@pytest.mark.parametrize("verb", ["PUB", "MPUB", "DPUB", "HTTP"])
@pytest.mark.parametrize("with_channel", [True, False])
def test_fsync_mode_syncs_before_ok(make_broker: MakeBroker, strace_path: str,
                                    tmp_path: Path, verb: str, with_channel: bool) -> None:
    b = make_broker("--durability=fsync")
    topic = unique_name("fs")
    if with_channel:
        create_channel(b, topic, "ch")
    _publish(b, verb, topic, b"warm-up")   # queue files exist before the trace
    assert b.proc is not None
    trace = Trace(strace_path, b.proc.pid, tmp_path / "strace.out")
    marker = f"MARK-{verb}-{time.time_ns()}".encode()
    reply = _publish(b, verb, topic, marker)
    calls = trace.stop(marker.decode(), reply)
    span, _ = _between(calls, marker.decode(), reply)
    names = [c[0] for c in span]
    write_at = next((i for i, c in enumerate(span)
                     if _is_file_write(c) and marker.decode() in c[2]), None)
    assert write_at is not None, f"no record write in {names}"
    sync_at = next((i for i in range(write_at, len(span))
                    if span[i][0] in ("fsync", "fdatasync")), None)
    assert sync_at is not None, f"OK sent without an fsync after the write: {names}"


def test_memory_mode_does_not_sync_per_publish(make_broker: MakeBroker, strace_path: str,
                                               tmp_path: Path) -> None:
    b = make_broker("--durability=memory", "--mem-queue-size=0")
    topic = unique_name("nofs")
    create_channel(b, topic, "ch")
    _publish(b, "PUB", topic, b"warm-up")
    assert b.proc is not None
    trace = Trace(strace_path, b.proc.pid, tmp_path / "strace.out")
    markers = [f"MARK-{i}-{time.time_ns()}".encode() for i in range(5)]
    for m in markers:
        _publish(b, "PUB", topic, m)
    calls = trace.stop(markers[-1].decode(), "OK")
    for m in markers:
        span, _ = _between(calls, m.decode(), "OK")
        names = [c[0] for c in span]
        # the record is handed to the kernel before the OK (so kill -9 cannot lose it)...
        assert any(_is_file_write(c) and m.decode() in c[2] for c in span), names
        assert not {"fsync", "fdatasync"} & set(names), names   # ...and not synced first


def test_memory_mode_syncs_a_topic_every_sync_every_records(
        make_broker: MakeBroker, strace_path: str, tmp_path: Path) -> None:
    """nsqd's --sync-every: after that many records written to a topic its log is
    fsynced (not waited for by any publish), long before sync_timeout comes."""
    b = make_broker("--durability=memory", "--sync-every=4", "--sync-timeout=1h")
    topic = unique_name("every")
    create_channel(b, topic, "ch")
    _publish(b, "PUB", topic, b"warm-up")
    assert b.proc is not None
    trace = Trace(strace_path, b.proc.pid, tmp_path / "strace.out")
    first = [f"MARK-{i}-{time.time_ns()}".encode() for i in range(2)]
    for m in first:                                  # 3 records written with the warm-up
        _publish(b, "PUB", topic, m)

    def syncs() -> int:
        """fsyncs of the topic's own files (strace -y names each fd's file; metadata
        and channel-state saves sync their own files whenever they are due)."""
        return sum(c[0] in ("fsync", "fdatasync") and topic in c[2].split(">", 1)[0]
                   for c in trace.calls())

    assert syncs() == 0
    last = f"MARK-last-{time.time_ns()}".encode()
    _publish(b, "PUB", topic, last)                  # the 4th: a sync follows
    wait_until(lambda: syncs() >= 1, 10, what="an fsync after 4 records")
    trace.stop(last.decode(), "OK")


def test_an_idle_topics_channel_states_are_not_written_again(make_broker: MakeBroker
                                                             ) -> None:
    """Every checkpoint (sync_timeout) saves each topic's channel states: written
    again unchanged, 300 idle topics cost each node about a tenth of a core in fsyncs,
    renames and directory fsyncs. An unchanged state is not written again; one that
    changed (a message finished) is (its change, to the state's journal)."""
    b = make_broker("--sync-timeout=50ms")
    idle, busy = unique_name("idle"), unique_name("busy")
    create_channel(b, idle, "ch")
    create_channel(b, busy, "ch")
    state = Path(b.data_path) / "state"

    def ident(topic: str) -> tuple[int, ...] | None:
        """The state file and its journal of changes (pybroker.storage.statejournal)."""
        out: tuple[int, ...] = ()
        for name in (f"{topic}.json", f"{topic}.json.journal"):
            try:
                st = (state / name).stat()
            except FileNotFoundError:
                return None
            out += (st.st_ino, st.st_mtime_ns, st.st_size)
        return out

    first = wait_until(lambda: ident(idle), 10, 0.02, what="the idle topic's state saved")
    with WireClient.connect(b.tcp_address) as c:     # type: ignore[arg-type]
        c.sub(busy, "ch")
        c.rdy(1)
        for k in range(5):
            before = wait_until(lambda: ident(busy), 10, 0.02, what="busy state saved")
            http(b, "POST", f"/pub?topic={busy}", f"m{k}".encode())
            c.fin(c.read_message(5).id)
            # the finished message moves the channel's cursor: saved again
            wait_until(lambda before=before: ident(busy) != before, 10, 0.02,
                       what="the busy topic's changed state saved again")
    assert ident(idle) == first, "an unchanged state was written again"
