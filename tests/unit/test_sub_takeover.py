"""A SUB that comes while this node builds the channels of a topic it took over
(pybroker.cluster.takeover) waits, its connection held: no answer, no later command
run, until the cluster says the channels are in place (then OK, and the commands after
it run) or that the leadership went first (then E_SUB_FAILED, and the connection
closes). A real Runtime in this process, its loops turned by the test, a real socket;
the cluster is a stand-in that only holds the SUB."""
from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pybroker.server.iostate import HELD, OPEN
from pybroker.runtime import Runtime
from tests.support.inproc import close_runtime, connect, read_frame, runtime, turn
from tests.support.wire import FRAME_ERROR, FRAME_RESPONSE, pub, rdy, sub


class _Cluster:
    """Leads every topic; a SUB to one in ``building`` waits for the test."""

    def __init__(self) -> None:
        self.building = {"t"}
        self.waiting: list[Callable[[bool], None]] = []

    def sub_refusal(self, name: str) -> str | None:
        return None

    def sub_after_takeover(self, name: str, then: Callable[[bool], None]) -> bool:
        if name not in self.building:
            return False
        self.waiting.append(then)
        return True

    def __getattr__(self, name: str) -> Any:
        # every other hook: this node leads, nothing is replicated
        return {"diverts": lambda *a: False, "refusal": lambda *a: None,
                "await_replicas": lambda *a: False, "registers": lambda *a: True}[name]


@pytest.fixture
def rt() -> Iterator[Runtime]:
    tmp = tempfile.mkdtemp(prefix="subtakeover-")
    r = runtime(Path(tmp))
    r.cluster = _Cluster()    # type: ignore[assignment]
    try:
        yield r
    finally:
        close_runtime(r)
        shutil.rmtree(tmp, ignore_errors=True)


def _turns(rt: Runtime) -> None:
    for _ in range(3):
        for loop in rt.loops:
            turn(loop)


def test_a_sub_waits_for_the_channels_then_goes_on(rt: Runtime) -> None:
    client, conn = connect(rt)
    got = bytearray()
    client.sendall(sub("t", "c") + rdy(1))
    _turns(rt)
    assert conn.io is HELD and conn.channel is None
    cluster: _Cluster = rt.cluster     # type: ignore[assignment]
    assert len(cluster.waiting) == 1
    client.setblocking(False)
    with pytest.raises(BlockingIOError):
        client.recv(1)                 # nothing answered while it waits
    client.setblocking(True)
    cluster.building.clear()
    cluster.waiting.pop()(True)
    assert read_frame(client, got, lambda: _turns(rt)) == (FRAME_RESPONSE, b"OK")
    assert conn.io is OPEN and conn.channel is not None and conn.channel.name == "c"
    # the RDY sent behind the SUB ran once it was subscribed: a message comes
    client.sendall(pub("t", b"hello"))
    ftype, data = read_frame(client, got, lambda: _turns(rt))
    frames = [(ftype, data)]
    while not any(f == 2 for f, _ in frames):
        frames.append(read_frame(client, got, lambda: _turns(rt)))
    assert any(f == 2 and d.endswith(b"hello") for f, d in frames), frames
    client.close()


def test_a_sub_whose_takeover_was_lost_fails_and_closes(rt: Runtime) -> None:
    client, conn = connect(rt)
    got = bytearray()
    client.sendall(sub("t", "c"))
    _turns(rt)
    assert conn.io is HELD
    cluster: _Cluster = rt.cluster     # type: ignore[assignment]
    cluster.waiting.pop()(False)
    ftype, data = read_frame(client, got, lambda: _turns(rt))
    assert ftype == FRAME_ERROR and data.startswith(b"E_SUB_FAILED SUB failed topic t is "
                                                    b"not led by this node"), data
    _turns(rt)
    assert conn.closed
    client.close()


def test_a_connection_closed_while_it_waits_is_left_alone(rt: Runtime) -> None:
    client, conn = connect(rt)
    client.sendall(sub("t", "c"))
    _turns(rt)
    assert conn.io is HELD
    conn.close("test closes it")
    cluster: _Cluster = rt.cluster     # type: ignore[assignment]
    cluster.waiting.pop()(True)
    _turns(rt)
    assert conn.closed and conn.channel is None
    client.close()
