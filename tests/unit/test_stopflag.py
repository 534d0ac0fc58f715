"""StopFlag: a stop event that signal handlers set without taking a lock."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from pybroker.stopflag import StopFlag
from tests.support.broker import project_root

pytestmark = pytest.mark.timeout(60)


def test_wait_times_out_false_and_returns_true_once_set() -> None:
    flag = StopFlag()
    started = time.monotonic()
    assert flag.wait(0.05) is False
    assert time.monotonic() - started >= 0.05
    assert not flag.is_set()
    flag.set()
    assert flag.is_set() and flag.wait(0) is True and flag.wait() is True


def test_set_from_another_thread_wakes_a_waiter_without_timeout() -> None:
    flag = StopFlag()
    woke: list[bool] = []
    waiter = threading.Thread(target=lambda: woke.append(flag.wait()))
    waiter.start()
    threading.Timer(0.05, flag.set).start()
    waiter.join(10)
    assert woke == [True]


def test_set_before_the_first_wait_is_seen() -> None:
    flag = StopFlag()
    flag.set()                      # no pipe yet: the flag alone carries it
    assert flag.wait(5) is True


def test_a_handler_sets_it_while_the_main_thread_holds_its_lock() -> None:
    # threading.Event.set() in a handler that interrupts Event.wait() (which holds the
    # event's lock) waits for its own thread forever; StopFlag.set() takes no lock
    flag = StopFlag()
    previous = signal.signal(signal.SIGUSR1, lambda *_: flag.set())
    try:
        with flag._make_lock:
            signal.raise_signal(signal.SIGUSR1)    # the handler runs here, in this thread
        assert flag.is_set() and flag.wait(0)
    finally:
        signal.signal(signal.SIGUSR1, previous)


CHILD = textwrap.dedent("""
    import os, random, signal, sys, threading, time
    from pybroker.stopflag import StopFlag
    flag = None
    signal.signal(signal.SIGUSR1, lambda *_: flag.set())
    for _ in range(int(sys.argv[1])):
        flag = StopFlag()
        kill = threading.Timer(random.random() * 0.002, os.kill,
                               (os.getpid(), signal.SIGUSR1))
        kill.start()
        while not flag.wait(0):         # the main thread is always inside wait()
            pass
        kill.join()
    print("stopped every time")
""")


def test_signals_landing_anywhere_in_wait_always_stop_it() -> None:
    # threading.Event in this loop wedges within a few hundred rounds on this machine
    env = {**os.environ, "PYTHONPATH": str(project_root())}
    r = subprocess.run([sys.executable, "-c", CHILD, "300"], capture_output=True,
                       timeout=40, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == b"stopped every time"


def test_sighup_while_the_hup_callbacks_lock_is_held_runs_it_from_wait() -> None:
    # to_file's hup takes the discoverer's lock, which its main thread holds while it
    # updates topics: the handler must only count, and wait() call hup on this thread
    from pybroker.tools._common import StopSignals
    lock = threading.Lock()
    hups: list[int] = []

    def hup() -> None:
        with lock:
            hups.append(1)

    with StopSignals(hup=hup) as signals:
        with lock:
            signal.raise_signal(signal.SIGHUP)     # the handler runs here, lock held
            signal.raise_signal(signal.SIGHUP)
        assert hups == []
        assert signals.wait(0.5) is False        # not a stop: hup ran, time ran out
        assert hups == [1]                        # two signals before one wait: one hup
        threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGTERM)).start()
        assert signals.wait(10) is True and signals.signal == signal.SIGTERM



FD_CHILD = textwrap.dedent("""
    import os, resource, sys, threading
    from pybroker.stopflag import StopFlag
    early, late = StopFlag(), StopFlag()
    if sys.argv[1] == "prepared":
        early.prepare()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
    held = []
    try:
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass                                    # every descriptor is taken
    threading.Timer(0.1, early.set).start()
    print("early", early.wait(10), early._fds is not None)
    print("late", late.wait(0.2), late._fds is None)
""")


@pytest.mark.parametrize("how", ["prepared", "lazy"])
def test_wait_with_every_descriptor_taken(how: str) -> None:
    # a flood of connections can take the last descriptor before the first wait():
    # a prepared flag waits on its pipe, an unprepared one looks at the flag instead
    # of raising EMFILE (which stopped the broker's main thread)
    env = {**os.environ, "PYTHONPATH": str(project_root())}
    r = subprocess.run([sys.executable, "-c", FD_CHILD, how], capture_output=True,
                       timeout=40, env=env, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == [
        f"early True {how == 'prepared'}", "late False True"]
