"""Poller: the readiness selector under every SelectorLoop (pybroker.evloop).

The part of ``selectors.BaseSelector``'s API the loops use (``register``, ``modify``,
``unregister``, ``close``, with its errors: KeyError for a file registered twice or not
at all, ValueError for a bad descriptor), plus ``poll(timeout)``, which returns the ready
objects as ``(data, mask)`` pairs. On Linux it drives ``select.epoll`` itself: the
standard ``EpollSelector.select`` spends a Python function call, a key lookup and a tuple
per ready descriptor, and a broker turn with one small message per connection has a
ready descriptor per message (about 0.4 us each on the reference machine, measured with
``loadtest/bench_io.py --only rdy1``). Elsewhere it wraps ``selectors.DefaultSelector``.
Imports only the standard library.
"""
from __future__ import annotations

import math
import select
import selectors
from typing import Generic, Protocol, TypeVar, Union

EVENT_READ = selectors.EVENT_READ
EVENT_WRITE = selectors.EVENT_WRITE


class _HasFileno(Protocol):
    def fileno(self) -> int: ...


FileObj = Union[int, _HasFileno]
D = TypeVar("D")


def _fd_of(fileobj: FileObj) -> int:
    if isinstance(fileobj, int):
        fd = fileobj
    else:
        try:
            fd = int(fileobj.fileno())
        except (AttributeError, TypeError, ValueError):
            raise ValueError(f"invalid file object: {fileobj!r}") from None
    if fd < 0:
        raise ValueError(f"invalid file descriptor: {fd}")
    return fd


class Poller(Generic[D]):
    """One loop's readiness selector (owner thread only); D: what is registered with
    each file (``data``), handed back by ``poll``."""

    def __init__(self) -> None:
        self._ep = select.epoll() if hasattr(select, "epoll") else None
        self._sel = None if self._ep is not None else selectors.DefaultSelector()
        # fd -> (file object, registered mask, data)
        self._keys: dict[int, tuple[FileObj, int, D]] = {}

    def _lookup(self, fileobj: FileObj) -> int:
        """The registered fd of fileobj; a closed socket (fileno -1) is found by identity
        (not found: ValueError, as selectors says)."""
        try:
            return _fd_of(fileobj)
        except ValueError:
            for fd, key in self._keys.items():
                if key[0] is fileobj:
                    return fd
            raise

    def register(self, fileobj: FileObj, events: int, data: D) -> None:
        fd = _fd_of(fileobj)
        if fd in self._keys:
            raise KeyError(f"{fileobj!r} (fd {fd}) is already registered")
        self._tell(fd, events, data, new=True)
        self._keys[fd] = (fileobj, events, data)

    def modify(self, fileobj: FileObj, events: int, data: D) -> None:
        fd = self._lookup(fileobj)
        key = self._keys.get(fd)
        if key is None:
            raise KeyError(f"{fileobj!r} is not registered")
        if events != key[1] or (self._sel is not None and data is not key[2]):
            self._tell(fd, events, data, new=False)
        self._keys[fd] = (key[0], events, data)

    def _tell(self, fd: int, events: int, data: D, new: bool) -> None:
        """Register (new) or modify fd with the kernel's epoll or the fallback selector."""
        if not events or events & ~(EVENT_READ | EVENT_WRITE):
            raise ValueError(f"invalid events: {events!r}")
        if self._ep is not None:
            (self._ep.register if new else self._ep.modify)(fd, _epoll_mask(events))
        else:
            assert self._sel is not None
            (self._sel.register if new else self._sel.modify)(fd, events, data)

    def unregister(self, fileobj: FileObj) -> None:
        fd = self._lookup(fileobj)
        if self._keys.pop(fd, None) is None:
            raise KeyError(f"{fileobj!r} is not registered")
        try:
            if self._ep is not None:
                self._ep.unregister(fd)
            else:
                assert self._sel is not None
                self._sel.unregister(fd)
        except (OSError, KeyError, ValueError):
            pass     # closed already: the kernel forgot it (as selectors does)

    def poll(self, timeout: float | None) -> list[tuple[D, int]]:
        """Wait at most ``timeout`` seconds (None: until ready; 0: not at all); the ready
        registrations as (data, mask of EVENT_READ / EVENT_WRITE they asked for)."""
        if self._ep is None:
            assert self._sel is not None
            return [(key.data, mask) for key, mask in self._sel.select(timeout)]
        if timeout is None:
            t = -1.0
        elif timeout <= 0:
            t = 0.0
        else:
            t = math.ceil(timeout * 1e3) * 1e-3   # epoll counts in ms: never wake early
        keys = self._keys
        try:
            got = self._ep.poll(t, max(len(keys), 1))
        except InterruptedError:
            return []
        out: list[tuple[D, int]] = []
        for fd, ev in got:
            key = keys.get(fd)
            if key is not None:
                # an error or hang-up wakes both directions, as selectors reports it
                mask = ((EVENT_WRITE if ev & ~select.EPOLLIN else 0)
                        | (EVENT_READ if ev & ~select.EPOLLOUT else 0))
                out.append((key[2], mask & key[1]))
        return out

    def close(self) -> None:
        if self._ep is not None:
            self._ep.close()
        if self._sel is not None:
            self._sel.close()
        self._keys.clear()


def _epoll_mask(events: int) -> int:
    return ((select.EPOLLIN if events & EVENT_READ else 0)
            | (select.EPOLLOUT if events & EVENT_WRITE else 0))
