"""A real Runtime in the test's own process, its loops not started: the test thread runs
their turns (``turn``) and reads what they wrote to its sockets (``read_frame``). For
tests that watch a loop's state between turns."""
from __future__ import annotations

import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from pybroker.config import resolve
from pybroker.evloop import Pollable, SelectorLoop
from pybroker.poller import EVENT_READ
from pybroker.runtime import Runtime
from pybroker.testing import wait_until

P = TypeVar("P", bound=Pollable)


def runtime(tmp: Path, **options: str) -> Runtime:
    """A Runtime on data path ``tmp`` with these options (nsqd's key names), its
    storage prepared."""
    rt = Runtime(resolve({}, {"data_path": str(tmp), **options}))
    rt.storage.prepare()
    return rt


def close_runtime(rt: Runtime) -> None:
    """Close what ``runtime`` opened: the topics' logs, the data path's lock, the loops
    (and their sender threads)."""
    for t in rt.broker.all_topics():
        t.log.close()
    rt.storage.lock.release()
    for loop in rt.loops:
        loop.close()


@contextmanager
def temp_runtime(prefix: str, **options: str) -> Iterator[Runtime]:
    """``runtime`` on a new temporary data path, closed and removed after."""
    tmp = tempfile.mkdtemp(prefix=prefix)
    r = runtime(Path(tmp), **options)
    try:
        yield r
    finally:
        close_runtime(r)
        shutil.rmtree(tmp, ignore_errors=True)


def connect(rt: Runtime) -> tuple[socket.socket, Any]:
    """A client socket on the first loop, past the protocol magic: (the test's end, the
    broker's connection)."""
    client, server = socket.socketpair()
    client.settimeout(5)
    loop = rt.loops[0]
    loop.add_connection(server, "test:1")
    (conn,) = loop.connections
    client.sendall(b"  V2")
    turn(loop)
    return client, conn


def attach(loop: Any, sent: bytes, n: int, name: str = "test") -> list[socket.socket]:
    """n clients of ``loop`` (socketpairs whose broker ends are its connections), each
    having sent ``sent`` (no turn is run): their ends, for the test to close."""
    clients = []
    for i in range(n):
        client, server = socket.socketpair()
        client.settimeout(5)
        loop.add_connection(server, f"{name}:{i}")
        client.sendall(sent)
        clients.append(client)
    return clients


def turn(loop: SelectorLoop) -> None:
    """One turn of a loop that is not started, one that does not sleep in poll."""
    loop.call_soon_threadsafe(lambda: None)
    loop.run_once()


def read_frame(sock: socket.socket, got: bytearray,
               on_idle: Callable[[], None] | None = None) -> tuple[int, bytes]:
    """The next frame sock receives: its bytes so far are kept in ``got`` (what follows
    the frame stays there); between looks ``on_idle`` runs (the loop's turns, when they
    must run for the frame to come)."""
    def whole() -> bool:
        sock.setblocking(False)
        try:
            got.extend(sock.recv(1 << 20))
        except BlockingIOError:
            pass
        finally:
            sock.setblocking(True)
        if len(got) >= 4 and len(got) >= 4 + int.from_bytes(got[:4], "big"):
            return True
        if on_idle is not None:
            on_idle()
        return False
    wait_until(whole, timeout_s=5, what="a frame from the broker")
    size = int.from_bytes(got[:4], "big")
    ftype, data = int.from_bytes(got[4:8], "big"), bytes(got[8:4 + size])
    del got[:4 + size]
    return ftype, data


@contextmanager
def watching(loop: SelectorLoop, handler_of: Callable[[socket.socket], P]
             ) -> Iterator[tuple[P, socket.socket]]:
    """loop started, its thread reading one end of a socketpair (non-blocking) through
    ``handler_of(end)``: (the handler, the other end, for the test); the loop stopped
    and closed, and both ends, after."""
    a, b = socket.socketpair()
    a.setblocking(False)
    handler = handler_of(a)
    loop.selector.register(a, EVENT_READ, handler)
    loop.start()
    try:
        yield handler, b
    finally:
        loop.stop()
        assert loop.stopped.wait(5)
        loop.close()
        a.close()
        b.close()
