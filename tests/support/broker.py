"""Start a real broker process (pybroker or nsqd) on ephemeral loopback ports.

The broker reports the addresses it bound in a log line, as nsqd does
("TCP: listening on 127.0.0.1:41234"), so the same fixture drives both.
Processes are stopped by their PID, never by name.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

LISTEN_RE = re.compile(r"(TCP|HTTP): listening on (\S+)")


def wait_until(pred: Callable[[], object], timeout_s: float = 5.0, interval_s: float = 0.01,
               what: str = "condition") -> object:
    """Poll pred() until it returns a truthy value or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


def find_nsqd() -> str | None:
    """The nsqd binary to compare against: $NSQD, else nsqd on PATH, else None."""
    path = os.environ.get("NSQD") or shutil.which("nsqd")
    return path if path and os.access(path, os.X_OK) else None


def _split_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


class BrokerProcess:
    """One broker subprocess. ``kind`` is "pybroker" or "nsqd"."""

    def __init__(self, kind: str = "pybroker", args: list[str] | None = None,
                 data_path: str | None = None, nsqd_path: str | None = None,
                 wait_http: bool | None = None, env: dict[str, str] | None = None) -> None:
        self.kind = kind
        self.extra_args = list(args or [])
        self._own_data = data_path is None
        self.data_path = data_path or tempfile.mkdtemp(prefix=f"{kind}-test-")
        self.nsqd_path = nsqd_path
        # both kinds log "HTTP: listening on ..."; pass wait_http=False when HTTP is off
        self.wait_http = True if wait_http is None else wait_http
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.stderr_lines: list[str] = []
        self.tcp_address: tuple[str, int] | None = None
        self.http_address: tuple[str, int] | None = None
        self._reader: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------
    def command(self) -> list[str]:
        common = ["--tcp-address=127.0.0.1:0", "--http-address=127.0.0.1:0",
                  f"--data-path={self.data_path}"]
        if self.kind == "nsqd":
            assert self.nsqd_path, "no nsqd binary"
            return [self.nsqd_path, *common, "--https-address=", *self.extra_args]
        # two loop threads unless a test says otherwise, so that every test also covers
        # the cross-loop paths (SUB moving a connection, messages posted between loops)
        loops = [] if any(a.startswith("--loop-threads") for a in self.extra_args) else [
            "--loop-threads=2"]
        return [sys.executable, "-m", "pybroker", "serve", *common, *loops, *self.extra_args]

    def start(self, timeout_s: float = 20.0) -> "BrokerProcess":
        env = dict(os.environ)
        if self.env:
            env.update(self.env)
        self.stderr_lines = []
        self.tcp_address = self.http_address = None
        self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     env=env)
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
            line = raw.decode("utf-8", "replace")
            self.stderr_lines.append(line)
            m = LISTEN_RE.search(line)
            if m:
                addr = _split_addr(m.group(2))
                if m.group(1) == "TCP":
                    self.tcp_address = addr
                else:
                    self.http_address = addr

    def stderr_text(self) -> str:
        return "".join(self.stderr_lines)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> int:
        """Signal the process by PID, wait with a deadline, SIGKILL only if needed."""
        proc = self.proc
        if proc is None:
            return 0
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
                raise AssertionError(f"{self.kind} did not exit within {timeout_s}s of "
                                     f"signal {sig}:\n" + self.stderr_text()) from None
        if self._reader is not None:
            self._reader.join(5)
        if proc.stderr is not None:
            proc.stderr.close()
        self.proc = None
        return proc.returncode

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        if self._reader is not None:
            self._reader.join(5)
        if self.proc is not None and self.proc.stderr is not None:
            self.proc.stderr.close()
        self.proc = None

    def cleanup(self) -> None:
        if self._own_data:
            shutil.rmtree(self.data_path, ignore_errors=True)

    # -- conveniences ----------------------------------------------------------------
    @property
    def tcp_hostport(self) -> str:
        assert self.tcp_address
        return f"{self.tcp_address[0]}:{self.tcp_address[1]}"

    @property
    def http_hostport(self) -> str:
        assert self.http_address
        return f"{self.http_address[0]}:{self.http_address[1]}"

    def connect(self, timeout_s: float = 5.0) -> socket.socket:
        assert self.tcp_address
        sock = socket.create_connection(self.tcp_address, timeout=timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock


_seq = 0


def rss_kb(pid: int) -> int:
    """VmRSS of a process, in kB (0 if unknown)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def unique_name(prefix: str = "t") -> str:
    """A topic/channel name unique within this test run (nsqd's tests add a timestamp)."""
    global _seq
    _seq += 1
    return f"{prefix}_{os.getpid()}_{int(time.time() * 1000) % 10_000_000}_{_seq}"


def project_root() -> Path:
    return Path(__file__).resolve().parents[2]
