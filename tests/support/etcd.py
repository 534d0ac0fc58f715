"""A real etcd (Debian's ``etcd-server``: ``/usr/bin/etcd``, or ``$ETCD``) for the
replication tests: one member on ephemeral loopback ports in a temporary directory,
started by a fixture and stopped by its PID.

The ports: etcd cannot be told to pick its own (it needs its peer URL before it
listens), so two free loopback ports are found by binding port 0 and closing, and the
start is retried with new ones if etcd loses the race for them.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from typing import Any

from tests.support.programs import require_program


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EtcdProcess:
    def __init__(self) -> None:
        self.path = require_program("etcd", "to coordinate a replicated cluster (apt "
                                    "install etcd-server)")
        self.dir = tempfile.mkdtemp(prefix="etcd-test-")
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.log_path = os.path.join(self.dir, "etcd.log")
        self.args: list[str] = []

    def start(self, timeout_s: float = 20.0) -> EtcdProcess:
        for _ in range(5):
            client, peer = _free_port(), _free_port()
            self.url = f"http://127.0.0.1:{client}"
            purl = f"http://127.0.0.1:{peer}"
            self.args = [self.path, "--name", "test", "--data-dir",
                         os.path.join(self.dir, "data"),
                         "--listen-client-urls", self.url, "--advertise-client-urls",
                         self.url, "--listen-peer-urls", purl,
                         "--initial-advertise-peer-urls", purl,
                         "--initial-cluster", f"test={purl}", "--log-level", "warn"]
            if self._run(timeout_s):
                return self
            self.stop()
        text = self.log_text()
        self.cleanup()
        raise AssertionError("etcd did not start:\n" + text)

    def _run(self, timeout_s: float) -> bool:
        """Start etcd with ``self.args``; True once it answers."""
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(self.args, stdin=subprocess.DEVNULL, stdout=logf,
                                         stderr=logf)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            if self._healthy():
                return True
            time.sleep(0.05)
        return False

    def kill(self) -> None:
        """SIGKILL (a crash): its data directory stays, for ``restart``."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def restart(self, timeout_s: float = 20.0) -> None:
        """Start it again on the same addresses and data (after ``kill``)."""
        assert self.proc is None or self.proc.poll() is not None, "etcd is running"
        if not self._run(timeout_s):
            raise AssertionError("etcd did not start again:\n" + self.log_text())

    def _healthy(self) -> bool:
        try:
            self.call("/kv/range", {"key": "AA=="}, timeout_s=1.0)
            return True
        except OSError:
            return False

    def call(self, path: str, body: dict[str, Any], timeout_s: float = 5.0) -> Any:
        req = urllib.request.Request(self.url + "/v3" + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.loads(r.read())

    def log_text(self) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def stop(self) -> None:
        proc = self.proc
        self.proc = None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
