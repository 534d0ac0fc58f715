"""Running pybroker's command-line tools from tests: ``python -m pybroker <tool> ...``.

Every process a test starts is recorded so that the ``reap_tools`` fixture can kill (by
its Popen handle) and reap whatever a failed test left running.
"""
from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.support.broker import project_root

TOOL = (sys.executable, "-m", "pybroker")
_SPAWNED: list[subprocess.Popen[bytes]] = []


@pytest.fixture(autouse=True)
def reap_tools() -> Iterator[None]:
    """Kill and reap the tools a test left running."""
    yield
    while _SPAWNED:
        proc = _SPAWNED.pop()
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)


def spawn(argv: list[str], stdin: int = subprocess.DEVNULL) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(argv, stdin=stdin, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=project_root())
    _SPAWNED.append(proc)
    return proc


def run_tool(*args: str, input: bytes | None = None, timeout_s: float = 20.0
             ) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([*TOOL, *args], input=input, capture_output=True,
                          timeout=timeout_s, cwd=project_root())


def start_tool(*args: str) -> subprocess.Popen[bytes]:
    return spawn([*TOOL, *args])
