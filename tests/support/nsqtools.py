"""NSQ's own daemons (nsqlookupd, nsqadmin) as subprocesses on ephemeral loopback ports.

Each prints the addresses it bound ("HTTP: listening on 127.0.0.1:41234"); ``start``
waits for them. Processes are stopped by their PID (SIGTERM, SIGKILL after a deadline).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import urllib.error
import urllib.request
from typing import Any

from pybroker.testing import LISTEN_RE, split_addr, wait_until


def find_binary(name: str) -> str | None:
    """$NSQLOOKUPD / $NSQADMIN (the name upper-cased), else the binary on PATH."""
    path = os.environ.get(name.upper()) or shutil.which(name)
    return path if path and os.access(path, os.X_OK) else None


class NsqDaemon:
    """One of NSQ's daemons; ``listens`` names the addresses to wait for."""

    def __init__(self, argv: list[str], listens: tuple[str, ...] = ("TCP", "HTTP")) -> None:
        self.argv = argv
        self.listens = listens
        self.addresses: dict[str, tuple[str, int]] = {}
        self.lines: list[str] = []
        self.proc: subprocess.Popen[bytes] | None = None
        self._reader: threading.Thread | None = None

    def start(self, timeout_s: float = 20.0) -> "NsqDaemon":
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self._reader = threading.Thread(target=self._read, args=(self.proc,), daemon=True,
                                        name=os.path.basename(self.argv[0]))
        self._reader.start()

        def ready() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.argv[0]} exited {self.proc.returncode}:\n"
                                     + self.text())
            return all(k in self.addresses for k in self.listens)

        wait_until(ready, timeout_s, what=f"{self.argv[0]} to listen")
        return self

    def _read(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stderr is not None
        for raw in proc.stderr:
            line = raw.decode("utf-8", "replace")
            self.lines.append(line)
            m = LISTEN_RE.search(line)
            if m:
                self.addresses[m.group(1)] = split_addr(m.group(2))

    def text(self) -> str:
        return "".join(self.lines)

    def hostport(self, kind: str = "HTTP") -> str:
        host, port = self.addresses[kind]
        return f"{'127.0.0.1' if host in ('', '::', '0.0.0.0') else host}:{port}"

    def stop(self, timeout_s: float = 10.0) -> int:
        proc = self.proc
        if proc is None:
            return 0
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        if self._reader is not None:
            self._reader.join(5)
        if proc.stderr is not None:
            proc.stderr.close()
        self.proc = None
        return proc.returncode


def http_json(method: str, url: str, body: Any = None,
              timeout_s: float = 10.0) -> tuple[int, Any]:
    """(status, decoded JSON body or text) of one request; HTTP errors are returned."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode("utf-8", "replace")
