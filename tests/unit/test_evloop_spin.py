"""SelectorLoop's spin (``loop_spin``): after a turn with events it looks again without
sleeping for a moment, so a peer that answers at once is read without a wake-up; it
still sleeps when nothing comes, never spins after an idle turn, and keeps its timers'
times. Real sockets and a real loop thread; the thread's CPU time from /proc."""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from pybroker.config import ConfigError, resolve
from pybroker.evloop import SelectorLoop
from pybroker.testing import wait_until
from tests.support.inproc import watching

SPIN_NS = 20_000_000       # 20 ms: a peer answers within it even on a loaded machine


class Echo:
    """Reads what comes and answers it at once; counts its reads."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reads = 0

    def on_readable(self) -> None:
        data = self.sock.recv(4096)
        if data:
            self.reads += 1
            self.sock.sendall(data)

    def on_writable(self) -> None:
        pass


def thread_cpu_s(t: threading.Thread) -> float:
    assert t.native_id is not None
    with open(f"/proc/self/task/{t.native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def echoing(spin_ns: int, before_start: Callable[[SelectorLoop], None] = lambda _: None
            ) -> Iterator[tuple[SelectorLoop, Echo, socket.socket]]:
    """A loop thread echoing one end of a socketpair; the other end for the test."""
    loop = SelectorLoop("test-spin", spin_ns=spin_ns)
    before_start(loop)
    with watching(loop, Echo) as (echo, b):
        yield loop, echo, b


@pytest.fixture(params=[SPIN_NS])
def echo_loop(request: pytest.FixtureRequest) -> Iterator[tuple[SelectorLoop, Echo,
                                                                 socket.socket]]:
    with echoing(int(request.param)) as got:
        yield got


PEER = """
import socket, sys
s = socket.socket(fileno=int(sys.argv[1]))
s.settimeout(5)
for i in range(int(sys.argv[2])):
    s.sendall(b"%d" % i)
    assert s.recv(64) == b"%d" % i
"""


@pytest.mark.parametrize("echo_loop", [0, SPIN_NS], indirect=True)
def test_round_trips_are_answered_and_an_idle_loop_sleeps(
        echo_loop: tuple[SelectorLoop, Echo, socket.socket]) -> None:
    loop, echo, peer = echo_loop
    assert loop.thread is not None
    # which poll found each request: a look without sleeping (0) or a sleep
    found: list[float | None] = []
    poll = loop.selector.poll

    def recording(timeout: float | None) -> list[tuple[object, int]]:
        events = poll(timeout)
        if any(obj is echo for obj, _ in events):
            found.append(timeout)
        return events  # type: ignore[return-value]

    loop.selector.poll = recording     # type: ignore[method-assign]
    peer.settimeout(5)
    peer.sendall(b"warm")
    assert peer.recv(64) == b"warm"
    # the peer in a process of its own (in this one it would trade the GIL with the
    # loop at every look)
    subprocess.run([sys.executable, "-c", PEER, str(peer.fileno()), "200"],
                   pass_fds=[peer.fileno()], check=True, timeout=30)
    assert echo.reads == 201
    if loop.spin_ns:
        # the peer answers within the spin: nearly every request is found by a look
        # that did not sleep (the first, and one after each miss, may sleep)
        looked = sum(1 for t in found if t == 0)
        assert looked > 120, found
    # after the last answer the loop spins at most SPIN_NS, then sleeps: over 0.6 s of
    # silence its thread uses a few ticks at most, not 0.6 s
    assert loop.thread is not None
    time.sleep(0.05)
    before = thread_cpu_s(loop.thread)
    time.sleep(0.6)
    assert thread_cpu_s(loop.thread) - before < 0.1


def test_timers_keep_their_time_while_spinning(
        echo_loop: tuple[SelectorLoop, Echo, socket.socket]) -> None:
    loop, _, peer = echo_loop
    peer.settimeout(5)
    fired: list[float] = []
    for k in range(20):
        peer.sendall(b"x")             # a turn with events: the next poll spins
        assert peer.recv(8) == b"x"
        t0 = time.monotonic()
        loop.call_soon_threadsafe(
            lambda t0=t0: loop.call_later(1_000_000, lambda: fired.append(
                time.monotonic() - t0)))
        wait_until(lambda k=k: len(fired) > k, 5, 0.001, what="the timer")
    # due 1 ms after it was set: never a spin's length late on top (CI machines are
    # noisy, so the median)
    fired.sort()
    assert fired[len(fired) // 2] < 0.001 + SPIN_NS / 1e9


def test_loop_spin_option() -> None:
    assert resolve({}, {}).loop_spin == 50_000
    assert resolve({}, {"loop_spin": "0"}).loop_spin == 0
    assert resolve({}, {"loop_spin": "200us"}).loop_spin == 200_000
    with pytest.raises(ConfigError, match="loop-spin"):
        resolve({}, {"loop_spin": "1s"})


SLOW_PEER = """
import socket, sys, time
s = socket.socket(fileno=int(sys.argv[1]))
s.settimeout(5)
for i in range(int(sys.argv[2])):
    time.sleep(0.005)                 # slower than the spin
    s.sendall(b"%d" % i)
    assert s.recv(64) == b"%d" % i
"""


def test_spinning_stops_for_a_peer_slower_than_the_spin() -> None:
    """A peer that answers after 5 ms never comes within a 200 us spin: after
    SPIN_MISSES misses in a row the loop sleeps at once, spinning again only to probe
    (one sleep in SPIN_PROBE), so a slow client costs a bounded few spins."""
    from pybroker.evloop import SPIN_MISSES, SPIN_PROBE

    spins = [0]

    def count_spins(loop: SelectorLoop) -> None:
        spin = loop._spin_or_sleep

        def counting(timeout: float | None) -> list[tuple[object, int]]:
            spins[0] += 1
            return spin(timeout)  # type: ignore[return-value]

        loop._spin_or_sleep = counting     # type: ignore[method-assign]

    with echoing(200_000, count_spins) as (_, echo, b):
        n = 100
        subprocess.run([sys.executable, "-c", SLOW_PEER, str(b.fileno()), str(n)],
                       pass_fds=[b.fileno()], check=True, timeout=30)
        assert echo.reads == n
        assert spins[0] <= SPIN_MISSES + n // SPIN_PROBE + 2, spins[0]


class Turns(SelectorLoop):
    """Counts its turns; nothing else to do."""

    def __init__(self) -> None:
        super().__init__("test-nap")
        self.turns = 0

    def end_of_turn(self) -> None:
        self.turns += 1


def test_a_nap_cap_wakes_a_loop_that_has_nothing_to_do() -> None:
    """``nap_cap``: no event, no timer, and yet the loop turns again within the cap
    (the event loop's way back to a sender's job that no pass settled)."""
    loop = Turns()
    loop.nap_cap = 0.005
    loop.start()
    try:
        wait_until(lambda: loop.turns >= 20, timeout_s=5, what="20 idle turns")
        loop.nap_cap = None
    finally:
        loop.stop()
        assert loop.stopped.wait(5)
        loop.close()


class Asker:
    """Sends a request after each reply and says a reply is coming (spin_for)."""

    def __init__(self, loop: SelectorLoop, sock: socket.socket, n: int,
                 expect_ns: int) -> None:
        self.loop, self.sock, self.left, self.expect_ns = loop, sock, n, expect_ns
        self.done = threading.Event()

    def ask(self) -> None:
        self.sock.sendall(b"?")
        self.loop.spin_for(self.expect_ns)

    def on_readable(self) -> None:
        if not self.sock.recv(64):
            return
        self.left -= 1
        if self.left:
            self.ask()
        else:
            self.done.set()

    def on_writable(self) -> None:
        pass


REPLYING_PEER = """
import socket, sys, time
s = socket.socket(fileno=int(sys.argv[1]))
s.settimeout(10)
for i in range(int(sys.argv[2])):
    assert s.recv(64) == b"?"
    time.sleep(float(sys.argv[3]))    # longer than the spin
    s.sendall(b"!")
"""


def _exchanges(spin_ns: int, expect_ns: int, n: int, delay_s: float
               ) -> list[tuple[int, bool]]:
    """n request/reply exchanges with a peer that replies after delay_s; each look
    the loop made before sleeping: (how long it might look, found something)."""
    loop = SelectorLoop("test-reply", spin_ns=spin_ns)
    looks: list[tuple[int, bool]] = []
    spin = loop._spin

    def recording(timeout: float | None, ns: int) -> list[tuple[object, int]]:
        got = spin(timeout, ns)
        looks.append((ns, bool(got)))
        return got  # type: ignore[return-value]

    loop._spin = recording     # type: ignore[method-assign]
    with watching(loop, lambda a: Asker(loop, a, n, expect_ns)) as (asker, b):
        peer = subprocess.Popen([sys.executable, "-c", REPLYING_PEER, str(b.fileno()),
                                 str(n), str(delay_s)], pass_fds=[b.fileno()])
        loop.call_soon_threadsafe(asker.ask)
        assert asker.done.wait(30)
        assert peer.wait(10) == 0
    return looks


def test_a_reply_said_to_be_coming_is_looked_for_past_the_spin() -> None:
    """spin_for(ns): a reply that comes 20 ms after the request, far past the spin
    (200 us), is found by a look without sleeping when one is expected within 2 s."""
    n = 10
    looks = _exchanges(200_000, 2_000_000_000, n, 0.02)
    waits = [found for ns, found in looks if ns == 2_000_000_000]
    assert len(waits) == n and all(waits), looks


def test_replies_that_keep_coming_late_stop_the_long_looks() -> None:
    """Replies 50 ms late to looks of 1 ms: after SPIN_MISSES misses in a row the loop
    sleeps at once, looking again only to probe (one sleep in SPIN_PROBE)."""
    from pybroker.evloop import SPIN_MISSES, SPIN_PROBE

    n = 30
    looks = _exchanges(200_000, 1_000_000, n, 0.05)
    long_looks = [found for ns, found in looks if ns == 1_000_000]
    assert not any(long_looks)
    assert SPIN_MISSES <= len(long_looks) <= SPIN_MISSES + n // SPIN_PROBE + 1, looks


def test_a_loop_without_a_spin_never_looks() -> None:
    assert _exchanges(0, 2_000_000_000, 5, 0.001) == []
