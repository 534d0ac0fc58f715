"""pybroker.cluster.forward against a leader that answers with an error: which answers
send the publish again to the next leader (``lost``) and which fail it. The forwarder
and its loop are real; the leader is a scripted peer on a loopback socket that reads
the forwarded command and answers one frame, as a pybroker leader would. The whole
path (a paused leader, a producer on a follower) is in
tests/integration/test_replication.py."""
from __future__ import annotations

import socket
import struct
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from pybroker.cluster.forward import ForwardError, Forwarders
from pybroker.cluster.ports import HANDED_OVER, LEADERSHIP_LOST, LEASE_EXPIRED, NOT_LEADER
from pybroker.evloop import SelectorLoop


def _leader_answering(frame_type: int, body: bytes) -> tuple[socket.socket, threading.Thread]:
    """A peer that takes one connection, reads the magic and one PUB, answers one
    frame and closes (an error is fatal in NSQ)."""
    srv = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = srv.accept()
        with conn:
            conn.settimeout(5)
            got = b""
            while got.count(b"\n") < 1 or len(got) < 4 + len("PUB t\n") + 4 + 1:
                data = conn.recv(4096)
                if not data:
                    return
                got += data
            conn.sendall(struct.pack(">iI", 4 + len(body), frame_type) + body)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return srv, t


def _forward_once(port: int) -> Exception | None:
    loop: Any = SelectorLoop("forward-test")
    loop.options = SimpleNamespace(max_body_size=1 << 20)
    node: Any = SimpleNamespace(nodes={2: {"tcp": f"127.0.0.1:{port}"}})
    fw = Forwarders(node)
    answered = threading.Event()
    result: list[Exception | None] = []

    def done(err: Exception | None) -> None:
        result.append(err)
        answered.set()

    loop.start()
    try:
        loop.call_soon_threadsafe(fw.forward, loop, 2, "t", [b"x"], 0, done)
        assert answered.wait(10), "no answer from the forwarder"
    finally:
        loop.stop()
        loop.stopped.wait(5)
    return result[0]


@pytest.mark.parametrize("reason,moved", [
    (f"{LEASE_EXPIRED} (not acknowledging)", True),
    (f"{NOT_LEADER} t", True),
    (f"t: {LEADERSHIP_LOST}", True),
    (f"its log cannot be written on this node: {HANDED_OVER}", True),
    ("write /data/topics/t/0.log: [ENOSPC] No space left on device", False),
    ("not enough in-sync replicas (1 of 2 required)", False),
])
def test_an_error_from_a_leader_that_leads_no_more_is_sent_again(reason: str,
                                                                 moved: bool) -> None:
    srv, t = _leader_answering(1, b"E_PUB_FAILED PUB failed " + reason.encode())
    try:
        err = _forward_once(srv.getsockname()[1])
    finally:
        t.join(5)
        srv.close()
    assert isinstance(err, ForwardError), err
    assert err.lost is moved, (reason, str(err))
    assert reason in str(err)


def test_an_ok_is_passed_on() -> None:
    srv, t = _leader_answering(0, b"OK")
    try:
        assert _forward_once(srv.getsockname()[1]) is None
    finally:
        t.join(5)
        srv.close()
