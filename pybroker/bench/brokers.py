"""The broker under test: a pybroker or nsqd subprocess on ephemeral loopback ports.

Owns starting a broker (both log "TCP: listening on HOST:PORT"), reading its memory and
CPU time from /proc, and stopping it by its PID (SIGTERM, then SIGKILL after a deadline).
A broker given by address instead (``ExternalBroker``) is measured but never started or
stopped, and its RSS is read only when its PID is given.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections import deque

LISTEN_RE = re.compile(r"(TCP|HTTP): listening on (\S+)")
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def proc_status_kb(pid: int, field: str) -> int:
    """A ``kB`` field of /proc/PID/status (``VmRSS``, ``VmHWM``) in bytes; 0 if unknown."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds used so far by ``pid`` (all its threads)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / _CLK_TCK
    except (OSError, ValueError, IndexError):
        return 0.0


class Broker:
    """What the scenarios need from a broker: addresses and /proc readings."""

    name = "broker"
    tcp_address = ""
    http_address = ""
    pid: int | None = None

    def rss(self) -> int:
        return proc_status_kb(self.pid, "VmRSS") if self.pid else 0

    def peak_rss(self) -> int:
        return proc_status_kb(self.pid, "VmHWM") if self.pid else 0

    def cpu_s(self) -> float:
        return proc_cpu_s(self.pid) if self.pid else 0.0

    def start(self) -> Broker:
        return self

    def stop(self) -> int:
        return 0

    def describe(self) -> str:
        return self.name

    def drop_topic(self, topic: str) -> bool:
        """Delete a topic the bench made (only a broker that outlives the bench needs it)."""
        return True


class ExternalBroker(Broker):
    """A broker that is already running (``--tcp-address``); never started or stopped."""

    def __init__(self, name: str, tcp_address: str, http_address: str = "",
                 pid: int | None = None) -> None:
        self.name = name
        self.tcp_address = tcp_address
        self.http_address = http_address
        self.pid = pid

    def drop_topic(self, topic: str) -> bool:
        """POST /topic/delete, so no bench backlog stays behind; False without HTTP."""
        if not self.http_address:
            return False
        url = f"http://{self.http_address}/topic/delete?topic={urllib.parse.quote(topic)}"
        try:
            with urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=10):
                return True
        except OSError:
            return False


class BrokerProcess(Broker):
    """A broker subprocess. ``kind`` is "pybroker" or "nsqd" (then ``nsqd_path`` is used)."""

    def __init__(self, kind: str, extra_args: list[str] | None = None,
                 nsqd_path: str | None = None, env: dict[str, str] | None = None) -> None:
        self.name = kind
        self.kind = kind
        self.extra_args = list(extra_args or [])
        self.nsqd_path = nsqd_path
        self.env = env
        self.data_path = ""
        self.proc: subprocess.Popen[bytes] | None = None
        self.log: deque[str] = deque(maxlen=200)
        self._reader: threading.Thread | None = None

    def command(self) -> list[str]:
        common = ["--tcp-address=127.0.0.1:0", "--http-address=127.0.0.1:0",
                  f"--data-path={self.data_path}"]
        if self.kind == "nsqd":
            if not self.nsqd_path:
                raise ValueError("no nsqd binary given")
            return [self.nsqd_path, *common, *self.extra_args]
        return [sys.executable, "-m", "pybroker", "serve", *common, *self.extra_args]

    def start(self, timeout_s: float = 30.0) -> BrokerProcess:
        self.data_path = tempfile.mkdtemp(prefix=f"bench-{self.kind}-")
        self.tcp_address = self.http_address = ""
        self.log.clear()
        env = dict(os.environ)
        env.update(self.env or {})
        self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     env=env)
        self.pid = self.proc.pid
        self._reader = threading.Thread(target=self._read_log, args=(self.proc,),
                                        name=f"{self.kind}-log", daemon=True)
        self._reader.start()
        deadline = time.monotonic() + timeout_s
        # both log "HTTP: listening" unless the extra arguments turn HTTP off (the last
        # --http-address wins); pybroker may log it before or after TCP
        http_args = [a for a in self.command() if a.startswith("--http-address=")]
        want_http = http_args[-1] != "--http-address="
        while not self.tcp_address or (want_http and not self.http_address):
            if self.proc.poll() is not None:
                self._reader.join(2)
                raise RuntimeError(f"{self.kind} exited with {self.proc.returncode}:\n"
                                   + self.log_text())
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.kind} did not listen within {timeout_s}s:\n"
                                   + self.log_text())
            time.sleep(0.01)
        return self

    def _read_log(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stderr is not None
        for raw in proc.stderr:
            line = raw.decode("utf-8", "replace")
            self.log.append(line)
            m = LISTEN_RE.search(line)
            if m:
                if m.group(1) == "TCP":
                    self.tcp_address = m.group(2)
                else:
                    self.http_address = m.group(2)

    def log_text(self) -> str:
        return "".join(self.log)

    def stop(self, timeout_s: float = 20.0) -> int:
        """SIGTERM by PID, wait, SIGKILL only if needed; remove the data directory."""
        proc, self.proc = self.proc, None
        code = 0
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
            code = proc.returncode
            if self._reader is not None:
                self._reader.join(5)
            if proc.stderr is not None:
                proc.stderr.close()
        if self.data_path:
            shutil.rmtree(self.data_path, ignore_errors=True)
            self.data_path = ""
        self.pid = None
        return code

    def describe(self) -> str:
        if self.kind == "nsqd":
            return f"nsqd ({self.nsqd_path})"
        return "pybroker"


def nsqd_version(path: str) -> str:
    """``nsqd --version``'s first line, or "" if it cannot be run."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True,
                             timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return (out.stdout or out.stderr).strip().splitlines()[0] if (out.stdout or out.stderr) else ""
