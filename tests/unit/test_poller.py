"""pybroker.poller.Poller: the selector API the loops use, on real socket pairs, with
the errors and masks selectors.DefaultSelector gives (the loops' callers rely on them)."""
from __future__ import annotations

import select
import selectors
import socket
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from pybroker.poller import EVENT_READ, EVENT_WRITE, Poller


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    yield a, b
    a.close()
    b.close()


def _fallback() -> Poller[str]:
    """A Poller on a platform without epoll: it wraps selectors.DefaultSelector."""
    with pytest.MonkeyPatch.context() as m:
        m.delattr(select, "epoll")
        p: Poller[str] = Poller()
    assert p._ep is None
    return p


MAKERS = [Poller, _fallback, selectors.DefaultSelector]


def _ready(p: Poller[str] | selectors.BaseSelector, timeout: float
           ) -> list[tuple[object, int]]:
    """The ready (data, mask) pairs from either: both must give the same answers."""
    if isinstance(p, Poller):
        return list(p.poll(timeout))
    return [(k.data, m) for k, m in p.select(timeout)]


@pytest.mark.parametrize("make", MAKERS)
def test_ready_objects_and_masks(make: Callable[[], Any], pair: tuple[socket.socket, socket.socket]
                                 ) -> None:
    a, b = pair
    p = make()
    try:
        p.register(a, EVENT_READ, "a")
        assert _ready(p, 0) == []
        b.send(b"x")
        assert _ready(p, 1) == [("a", EVENT_READ)]
        p.modify(a, EVENT_READ | EVENT_WRITE, "a2")
        assert _ready(p, 1) == [("a2", EVENT_READ | EVENT_WRITE)]
        p.modify(a, EVENT_WRITE, "a3")
        assert _ready(p, 1) == [("a3", EVENT_WRITE)]   # readable too, but not asked for
        b.close()       # hang-up: reported in the directions registered
        p.modify(a, EVENT_READ, "a4")
        assert _ready(p, 1) == [("a4", EVENT_READ)]
        p.unregister(a)
        assert _ready(p, 0) == []
    finally:
        p.close()


@pytest.mark.parametrize("make", MAKERS)
def test_errors_match_selectors(make: Callable[[], Any], pair: tuple[socket.socket, socket.socket]
                                ) -> None:
    a, b = pair
    p = make()
    try:
        with pytest.raises(KeyError):
            p.modify(a, EVENT_READ, None)
        with pytest.raises(KeyError):
            p.unregister(a)
        with pytest.raises(ValueError):
            p.register(a, 0, None)
        with pytest.raises(ValueError):
            p.register(-1, EVENT_READ, None)
        p.register(a, EVENT_READ, None)
        with pytest.raises(KeyError):
            p.register(a, EVENT_READ, None)
        with pytest.raises(KeyError):
            p.register(a.fileno(), EVENT_WRITE, None)   # the same descriptor
        # a socket closed while registered is still found (by identity) and forgotten
        a.close()
        p.unregister(a)
        with pytest.raises(ValueError):
            p.unregister(a)
    finally:
        p.close()


def test_timeout_waits_at_least_as_long_as_asked(
        pair: tuple[socket.socket, socket.socket]) -> None:
    import time
    a, _ = pair
    p: Poller[str] = Poller()
    p.register(a, EVENT_READ, "a")
    try:
        for timeout in (0.0004, 0.003):   # epoll counts in ms: rounded up, never early
            t0 = time.monotonic()
            assert p.poll(timeout) == []
            assert time.monotonic() - t0 >= timeout
    finally:
        p.close()
