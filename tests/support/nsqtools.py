"""NSQ's own daemons (nsqlookupd, nsqadmin) as subprocesses on ephemeral loopback ports.

Each prints the addresses it bound ("HTTP: listening on 127.0.0.1:41234"); ``start``
waits for them. ``start_nsqlookupd`` and ``start_nsqadmin`` find the program (a skip, or a
failure in strict mode, when it is missing: tests/support/programs.py) and start it. Processes are stopped by their PID (SIGTERM, SIGKILL after a deadline).
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading

from pybroker.testing import LISTEN_RE, split_addr, wait_until
from tests.support.http import http_json
from tests.support.programs import find_program as find_binary
from tests.support.programs import require_program

__all__ = ["NsqDaemon", "find_binary", "http_json", "start_nsqadmin", "start_nsqlookupd"]


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


def start_nsqlookupd(*extra: str) -> NsqDaemon:
    """A real nsqlookupd on ephemeral loopback ports (stop it with ``.stop()``);
    ``.hostport("TCP")`` is what a broker's --lookupd-tcp-address takes."""
    path = require_program("nsqlookupd")
    return NsqDaemon([path, "--tcp-address=127.0.0.1:0", "--http-address=127.0.0.1:0",
                      "--broadcast-address=127.0.0.1", *extra]).start()


def start_nsqadmin(*extra: str) -> NsqDaemon:
    """A real nsqadmin on an ephemeral loopback port, given its source of nodes in
    ``extra`` (--nsqd-http-address or --lookupd-http-address)."""
    path = require_program("nsqadmin")
    return NsqDaemon([path, "--http-address=127.0.0.1:0", *extra], listens=("HTTP",)).start()
