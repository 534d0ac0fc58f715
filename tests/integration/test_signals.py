"""SIGTERM and SIGINT stop the broker (and the tools) cleanly whichever of its threads
the kernel hands the signal to.

A signal sent to a process goes to one of its threads; Linux picks another than the
main one when the main thread cannot take it at that moment. Python runs the handler
in the main thread only, and the main thread sleeps in poll() on the stop pipe: the
signal's C handler must wake it (``signal.set_wakeup_fd`` on that pipe), else SIGTERM
waited for anything else to wake the main thread (seen once in CI: a broker that had
just been traced by strace did not exit within 15 s of SIGTERM). Here the signal is
sent to a thread other than the main one directly with tgkill(2).
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from collections.abc import Callable

import pytest

from tests.support.broker import BrokerProcess, unique_name, wait_until
from tests.support.durability import ping
from tests.support.http import broker_json
from tests.support.tools import reap_tools, start_tool  # noqa: F401
from tests.support.wire import publish

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="tgkill(2)")]

SYS_TGKILL = {"x86_64": 234, "aarch64": 131}.get(os.uname().machine)


def tgkill(pid: int, tid: int, sig: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(SYS_TGKILL, pid, tid, sig) != 0:
        raise OSError(ctypes.get_errno(), f"tgkill {pid} {tid}")


def threads(pid: int) -> dict[int, str]:
    out = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{t}/comm") as f:
                out[int(t)] = f.read().strip()
        except FileNotFoundError:
            pass
    return out


@pytest.mark.skipif(SYS_TGKILL is None, reason="tgkill's number unknown on this machine")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_taken_by_another_thread_stops_the_broker(
        make_broker: Callable[..., BrokerProcess], sig: int) -> None:
    b = make_broker()
    wait_until(lambda: ping(b) == (200, "OK"), timeout_s=10, what="/ping")
    assert b.proc is not None
    pid = b.proc.pid
    others = {tid: name for tid, name in threads(pid).items() if tid != pid}
    assert others, "the broker runs loop, HTTP and storage threads"
    tid = next(iter(sorted(others)))      # the first one started: an event loop's
    started = time.monotonic()
    tgkill(pid, tid, sig)
    try:
        b.proc.wait(10)
    except Exception:
        raise AssertionError(f"the broker did not stop within 10 s of {sig!r} sent to its "
                             f"thread {others[tid]!r}") from None
    assert time.monotonic() - started < 5
    # reaped, its stderr read to the end by the reader thread (which may still be
    # reading the last lines when the process is gone)
    assert b.stop() == 0, b.stderr_text()
    assert any("bye" in ln for ln in b.stderr_lines), b.stderr_text()


@pytest.mark.skipif(SYS_TGKILL is None, reason="tgkill's number unknown on this machine")
@pytest.mark.usefixtures("reap_tools")
def test_a_tool_stops_on_sigterm_taken_by_another_thread(
        make_broker: Callable[..., BrokerProcess]) -> None:
    # pybroker tail: its main thread waits on the stop flag while the consumer's run
    b = make_broker()
    topic = unique_name("sig")
    publish(b.tcp_address, topic, [b"one", b"two"])   # type: ignore[arg-type]
    proc = start_tool("tail", f"--nsqd-tcp-address={b.tcp_hostport}", f"--topic={topic}")

    def subscribed() -> bool:
        _, d = broker_json(b, "GET", "/stats", format="json", topic=topic)
        return any(c["clients"] for t in d["topics"] for c in t["channels"])

    wait_until(subscribed, 15, what="tail subscribed")
    others = [tid for tid in threads(proc.pid) if tid != proc.pid]
    assert others
    tgkill(proc.pid, sorted(others)[0], signal.SIGTERM)
    out, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    assert b"Traceback" not in err, err
    assert out == b"one\ntwo\n"
