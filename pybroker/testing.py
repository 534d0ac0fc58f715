"""pytest plugin: a real pybroker for your tests (registered through the ``pytest11`` entry
point, so installing pybroker is enough).

Fixtures (none is autouse; a test that asks for none of them costs nothing)::

    def test_roundtrip(pybroker_server, pybroker_producer, pybroker_consumer):
        consumer = pybroker_consumer("events")              # SUB events/test
        pybroker_producer.publish("events", b"hello")
        assert [m.body for m in consumer.wait_for(1)] == [b"hello"]

- ``pybroker_server``: a broker subprocess (``python -m pybroker serve``) on ephemeral
  loopback ports with a temporary data path, ready (``/ping`` answered) before the test
  runs; ``.tcp_hostport``, ``.http_hostport``, ``.http_url``, ``.data_path``, ``.pid``.
- ``make_pybroker_server(*flags)``: more brokers, or one with options
  (``make_pybroker_server("--mem-queue-size=10")``).
- ``pybroker_producer``: a ``pybroker.client.Producer`` connected to ``pybroker_server``.
- ``pybroker_consumer(topic, channel="test", **options)``: a ``ConsumerHelper`` whose
  ``wait_for(n)`` returns the first n messages received (FIN'd when received).

Teardown stops each broker by its PID (SIGTERM, SIGKILL only after a deadline) and fails
the test if the broker exited non-zero or logged a traceback. A failing test's report
gets each broker's log as a section ("pybroker log"). The process helpers
(``BrokerProcess``, ``wait_until``) are plain Python and work without pytest fixtures.
"""
from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Self

import pytest

if TYPE_CHECKING:
    from pybroker.client import Message, Producer

LISTEN_RE = re.compile(r"(TCP|HTTPS|HTTP): listening on (\S+)")
START_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 15.0


def wait_until(pred: Callable[[], object], timeout_s: float = 5.0, interval_s: float = 0.01,
               what: str = "condition") -> object:
    """Poll pred() until it returns a truthy value (returned) or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


def find_nsqd() -> str | None:
    """An nsqd binary to compare against: $NSQD, else nsqd on PATH, else None."""
    path = os.environ.get("NSQD") or shutil.which("nsqd")
    return path if path and os.access(path, os.X_OK) else None


def split_addr(addr: str) -> tuple[str, int]:
    """"127.0.0.1:4150" or "[::1]:4150" -> (host, port)."""
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


def _thread_states(pid: int) -> str:
    """Each thread's name, state and kernel wait channel (Linux's /proc; else empty)."""
    out = []
    try:
        tids = sorted(os.listdir(f"/proc/{pid}/task"), key=int)
    except OSError:
        return ""
    for tid in tids:
        base = f"/proc/{pid}/task/{tid}"
        try:
            with open(f"{base}/comm") as f:
                name = f.read().strip()
            with open(f"{base}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"{base}/wchan") as f:
                wchan = f.read().strip()
        except OSError:
            continue
        out.append(f"{tid} {name} {state} {wchan}")
    return "; ".join(out)


class BrokerProcess:
    """One broker subprocess on ephemeral loopback ports.

    ``kind`` is "pybroker" (``python -m pybroker serve``, run by ``python``, default this
    interpreter) or "nsqd" (the binary at ``nsqd_path``). The broker prints the addresses
    it bound ("TCP: listening on 127.0.0.1:41234", as nsqd does), which ``start`` waits
    for. The process is stopped by its PID, never by name. Its data path is a new
    temporary directory unless one is given, and is removed by ``cleanup`` if it was new.
    """

    def __init__(self, kind: str = "pybroker", args: list[str] | None = None,
                 data_path: str | None = None, nsqd_path: str | None = None,
                 wait_http: bool | None = None, env: dict[str, str] | None = None,
                 python: str | None = None, cwd: str | None = None) -> None:
        self.kind = kind
        self.extra_args = list(args or [])
        self._own_data = data_path is None
        self.data_path = data_path or tempfile.mkdtemp(prefix=f"{kind}-test-")
        self.nsqd_path = nsqd_path
        # both kinds log "HTTP: listening on ..."; pass wait_http=False when HTTP is off
        self.wait_http = True if wait_http is None else wait_http
        self.env = env
        self.python = python or sys.executable
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None
        self.stderr_lines: list[str] = []
        self.tcp_address: tuple[str, int] | None = None
        self.http_address: tuple[str, int] | None = None
        self.https_address: tuple[str, int] | None = None  # with --tls-cert/--tls-key
        self.returncode: int | None = None
        self._reader: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------
    def command(self) -> list[str]:
        common = ["--tcp-address=127.0.0.1:0", "--http-address=127.0.0.1:0",
                  f"--data-path={self.data_path}"]
        # no HTTPS listener unless asked for (both listen on :4152 when given a cert)
        if not any(a.startswith("--https-address") for a in self.extra_args):
            common.append("--https-address=")
        if self.kind == "nsqd":
            assert self.nsqd_path, "no nsqd binary"
            return [self.nsqd_path, *common, *self.extra_args]
        return [self.python, "-m", "pybroker", "serve", *common, *self.extra_args]

    def start(self, timeout_s: float = START_TIMEOUT_S) -> Self:
        """Start the process and wait until it listens; raise (with its log) if it exits."""
        env = dict(os.environ)
        if self.env:
            env.update(self.env)
        self.stderr_lines = []
        self.tcp_address = self.http_address = self.https_address = None
        self.returncode = None
        self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     env=env, cwd=self.cwd)
        self._reader = threading.Thread(target=self._read_stderr, args=(self.proc,),
                                        name=f"{self.kind}-stderr", daemon=True)
        self._reader.start()

        def ready() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"{self.kind} exited with {self.proc.returncode}:\n"
                                     + self.stderr_text())
            return self.tcp_address is not None and (
                not self.wait_http or self.http_address is not None)

        wait_until(ready, timeout_s, what=f"{self.kind} to listen")
        return self

    def _read_stderr(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stderr is not None
        for raw in proc.stderr:
            self._took_line(raw.decode("utf-8", "replace"))

    def _took_line(self, line: str) -> None:
        """One line of the broker's stderr, read: kept, and its listening address noted."""
        self.stderr_lines.append(line)
        m = LISTEN_RE.search(line)
        if m:
            addr = split_addr(m.group(2))
            if m.group(1) == "TCP":
                self.tcp_address = addr
            elif m.group(1) == "HTTPS":
                self.https_address = addr
            else:
                self.http_address = addr

    def stderr_text(self) -> str:
        """Everything the broker has logged so far."""
        return "".join(self.stderr_lines)

    log_text = stderr_text

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """Signal the process by PID, wait with a deadline, SIGKILL only if needed;
        returns its exit status."""
        proc = self.proc
        if proc is None:
            return self.returncode or 0
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                threads = _thread_states(proc.pid)     # what each thread was doing
                proc.kill()
                proc.wait(5)
                self._close(proc)
                raise AssertionError(f"{self.kind} did not exit within {timeout_s}s of "
                                     f"signal {sig}; its threads: {threads}\n"
                                     + self.stderr_text()) from None
        self._close(proc)
        return proc.returncode

    def kill9(self) -> None:
        """SIGKILL (a crash), then reap."""
        proc = self.proc
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
            self._close(proc)

    def _close(self, proc: subprocess.Popen[bytes]) -> None:
        if self._reader is not None:
            self._reader.join(5)
        if proc.stderr is not None:
            proc.stderr.close()
        self.returncode = proc.returncode
        self.proc = None

    def cleanup(self) -> None:
        """Remove the data path if this object made it."""
        if self._own_data:
            shutil.rmtree(self.data_path, ignore_errors=True)

    # -- conveniences ----------------------------------------------------------------
    @property
    def pid(self) -> int:
        assert self.proc is not None, "not running"
        return self.proc.pid

    @property
    def tcp_hostport(self) -> str:
        assert self.tcp_address
        return f"{self.tcp_address[0]}:{self.tcp_address[1]}"

    @property
    def http_hostport(self) -> str:
        assert self.http_address
        return f"{self.http_address[0]}:{self.http_address[1]}"

    @property
    def http_url(self) -> str:
        return f"http://{self.http_hostport}"

    def ping(self, timeout_s: float = 5.0) -> bool:
        """True when GET /ping answers 200."""
        try:
            with urllib.request.urlopen(self.http_url + "/ping", timeout=timeout_s) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def connect(self, timeout_s: float = 5.0) -> socket.socket:
        """A plain TCP connection to the broker (no magic sent)."""
        assert self.tcp_address
        sock = socket.create_connection(self.tcp_address, timeout=timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock


class ConsumerHelper:
    """A ``pybroker.client.Consumer`` that keeps what it receives (each message FIN'd as
    it arrives) for ``wait_for`` to hand to the test."""

    def __init__(self, address: str, topic: str, channel: str, **options: Any) -> None:
        from pybroker.client import Consumer

        self.topic, self.channel = topic, channel
        self.received: list[Message] = []
        self._queue: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self.consumer = Consumer(topic, channel, self._handle, **options)
        self.consumer.connect_to_nsqd(address)

    def _handle(self, message: Message) -> None:
        self._queue.put(message)

    def wait_for(self, count: int, timeout_s: float = 10.0) -> list[Message]:
        """Block until ``count`` more messages arrived; return them in arrival order."""
        deadline = time.monotonic() + timeout_s
        got: list[Message] = []
        while len(got) < count:
            left = deadline - time.monotonic()
            try:
                got.append(self._queue.get(timeout=max(left, 0.0)))
            except queue.Empty:
                raise AssertionError(
                    f"{self.topic}/{self.channel}: {len(got)} of {count} messages within "
                    f"{timeout_s}s") from None
        self.received.extend(got)
        return got

    def close(self, timeout_s: float = 10.0) -> None:
        self.consumer.close(timeout_s)


# -- fixtures ------------------------------------------------------------------------------
_STARTED = pytest.StashKey[list[BrokerProcess]]()


def _finish(b: BrokerProcess) -> str | None:
    """Stop a broker; the reason it counts as failed, or None."""
    pid = b.proc.pid if b.proc is not None else None
    try:
        code = b.stop()
    except AssertionError as e:
        return str(e).splitlines()[0]
    if code != 0:
        return f"{b.kind} (pid {pid}) exited with status {code}"
    if "Traceback" in b.stderr_text():
        return f"{b.kind} logged a traceback"
    return None


@pytest.fixture
def make_pybroker_server(request: pytest.FixtureRequest,
                         tmp_path_factory: pytest.TempPathFactory
                         ) -> Iterator[Callable[..., BrokerProcess]]:
    """make_pybroker_server(*flags, env=None) -> a started broker with those flags."""
    started = request.node.stash.setdefault(_STARTED, [])

    def make(*flags: str, env: dict[str, str] | None = None) -> BrokerProcess:
        data = tmp_path_factory.mktemp("pybroker-data")
        b = BrokerProcess("pybroker", list(flags), data_path=str(data), env=env)
        started.append(b)
        b.start()
        wait_until(b.ping, START_TIMEOUT_S, interval_s=0.02, what="pybroker's /ping")
        return b

    yield make
    failures = [reason for b in started if (reason := _finish(b))]
    if failures:
        pytest.fail("; ".join(failures), pytrace=False)


@pytest.fixture
def pybroker_server(make_pybroker_server: Callable[..., BrokerProcess]) -> BrokerProcess:
    """A pybroker on ephemeral loopback ports with a temporary data path."""
    return make_pybroker_server()


@pytest.fixture
def pybroker_producer(pybroker_server: BrokerProcess) -> Iterator["Producer"]:
    """A pybroker.client.Producer connected to pybroker_server."""
    from pybroker.client import Producer

    producer = Producer(pybroker_server.tcp_hostport)
    producer.connect()
    yield producer
    producer.stop()


@pytest.fixture
def pybroker_consumer(pybroker_server: BrokerProcess
                      ) -> Iterator[Callable[..., ConsumerHelper]]:
    """pybroker_consumer(topic, channel="test", **options) -> a ConsumerHelper on
    pybroker_server (options are pybroker.client.Config fields, e.g. max_in_flight)."""
    helpers: list[ConsumerHelper] = []

    def make(topic: str, channel: str = "test", **options: Any) -> ConsumerHelper:
        helper = ConsumerHelper(pybroker_server.tcp_hostport, topic, channel, **options)
        helpers.append(helper)
        return helper

    yield make
    for helper in helpers:
        helper.close()


# -- the broker's log in a failing test's report -------------------------------------------
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Iterator[None]:
    outcome = yield
    started = item.stash.get(_STARTED, None)
    if not started:          # the test used none of these fixtures: nothing to do
        return
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.failed:
        for i, b in enumerate(started):
            name = "pybroker log" if len(started) == 1 else f"pybroker log ({i + 1})"
            report.sections.append((f"{name}: {b.data_path}", b.stderr_text()))
