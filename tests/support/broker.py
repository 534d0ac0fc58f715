"""Start a real broker process (pybroker or nsqd) on ephemeral loopback ports.

The process handling is the pytest plugin's (pybroker.testing.BrokerProcess): the broker
reports the addresses it bound in a log line, as nsqd does ("TCP: listening on
127.0.0.1:41234"), so the same code drives both; processes are stopped by their PID.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path
from types import ModuleType

from pybroker.testing import LISTEN_RE, find_nsqd, split_addr, wait_until
from pybroker.testing import BrokerProcess as _PluginBrokerProcess

__all__ = ["LISTEN_RE", "BrokerProcess", "find_nsqd", "project_root", "rss_kb",
           "split_addr", "unique_name", "wait_until"]


class BrokerProcess(_PluginBrokerProcess):
    """The pytest plugin's broker process (pybroker.testing). pybroker runs with its
    default of one loop thread, as users run it; the modules about the cross-loop paths
    (SUB moving a connection, publishes handed between loops) ask for
    ``--loop-threads=2`` themselves (test_cross_loop.py, test_publish_handoff.py,
    test_loop_handover.py, test_fuzz_input.py, test_chaos.py)."""


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


def loadtest_module(name: str) -> ModuleType:
    """loadtest/<name>.py imported (the folder is not a package), as module
    ``<name>_under_test``."""
    path = project_root() / "loadtest" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod
