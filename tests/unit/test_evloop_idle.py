"""SelectorLoop.when_idle: calls deferred to the loop's next idle moment. They run once a
look without sleeping finds no event, one per key (the last given), in a turn of their
own; a loop that never finds itself idle (a socket that always has bytes) still runs
them IDLE_MAX_NS after the first was deferred. A real loop thread and a real socket."""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from pybroker import evloop
from pybroker.evloop import SelectorLoop
from pybroker.testing import wait_until
from tests.support.inproc import watching


class Sipper:
    """Reads one byte a turn: a socket with bytes waiting stays readable for long."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reads = 0

    def on_readable(self) -> None:
        if self.sock.recv(1):
            self.reads += 1

    def on_writable(self) -> None:
        pass


class Recording(SelectorLoop):
    """Notes its ends of turns among the idle calls' records."""

    def __init__(self) -> None:
        super().__init__("test-idle", spin_ns=50_000)
        self.log: list[object] = []

    def end_of_turn(self) -> None:
        if self.log and self.log[-1] != "end":
            self.log.append("end")


@pytest.fixture
def setting() -> Iterator[tuple[Recording, Sipper, socket.socket]]:
    loop = Recording()
    with watching(loop, Sipper) as (sipper, b):
        yield loop, sipper, b


def test_an_idle_loop_runs_the_last_call_of_each_key_then_ends_the_turn(
        setting: tuple[Recording, Sipper, socket.socket],
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(evloop, "IDLE_MAX_NS", 10**12)    # (only idleness runs them)
    loop, _, _ = setting

    def broken() -> None:
        raise RuntimeError("a bug")

    def defer() -> None:
        loop.when_idle("k", loop.log.append, "first")
        loop.when_idle("j", broken)
        loop.when_idle("k", loop.log.append, "second")    # replaces "first", keeps k's place
        loop.when_idle("m", loop.log.append, "third")

    loop.call_soon_threadsafe(defer)
    wait_until(lambda: "end" in loop.log, timeout_s=5, what="the idle turn")
    assert loop.log == ["second", "third", "end"]
    assert "error in an idle call" in caplog.text


def test_a_loop_never_idle_runs_them_after_the_longest_deferral(
        setting: tuple[Recording, Sipper, socket.socket],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Bytes always waiting: every look finds an event, so only IDLE_MAX_NS runs the
    call, while the loop is still reading; with nothing waiting it runs at once."""
    longest = 50_000_000
    monkeypatch.setattr(evloop, "IDLE_MAX_NS", longest)
    loop, sipper, peer = setting
    peer.sendall(b"x" * 100_000)       # one byte a turn: readable for far longer
    wait_until(lambda: sipper.reads > 0, timeout_s=5, what="the first read")
    ran: list[tuple[int, int]] = []    # (when, reads then)
    deferred: list[int] = []

    def defer() -> None:
        deferred.append(time.monotonic_ns())
        loop.when_idle("k", lambda: ran.append((time.monotonic_ns(), sipper.reads)))

    loop.call_soon_threadsafe(defer)
    wait_until(lambda: bool(ran), timeout_s=10, what="the deferred call")
    waited = ran[0][0] - deferred[0]
    assert waited >= longest, waited
    assert ran[0][1] < 100_000                     # the bytes were still being read
    # nothing waiting any more: the next deferral runs at the first look
    monkeypatch.setattr(evloop, "IDLE_MAX_NS", 10**12)
    wait_until(lambda: sipper.reads == 100_000, timeout_s=30, what="every byte read")
    done = threading.Event()
    loop.call_soon_threadsafe(loop.when_idle, "k", done.set)
    assert done.wait(5)
