"""pybroker.cluster.forward against a leader's replication address: the publish request
it sends (the message, or the MPUB body, in the blob; its id), and which answers send
the publish again to the next leader (``lost``) and which fail it. The forwarder and
its loop are real; the leader is a scripted peer on a loopback socket that reads one
request and answers it, as a pybroker leader's replication server would
(tests/unit/test_cluster_fetch.py has the server's side; the whole path, a paused
leader and a producer on a follower, is in tests/integration/test_replication.py)."""
from __future__ import annotations

import socket
import struct
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from pybroker.cluster.forward import ForwardError, Forwarders
from pybroker.cluster.ports import HANDED_OVER, LEADERSHIP_LOST, LEASE_EXPIRED, NOT_LEADER
from pybroker.cluster.wire import FrameReader, encode
from pybroker.evloop import SelectorLoop


def _leader_answering(answer: dict[str, Any] | bytes | None,
                      seen: list[tuple[dict[str, Any], bytes]]
                      ) -> tuple[socket.socket, threading.Thread]:
    """A peer that takes one connection, reads one request (kept in ``seen``) and
    answers it: with ``answer`` plus the request's id, or raw bytes, or (None) by
    closing the connection."""
    srv = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = srv.accept()
        with conn:
            conn.settimeout(5)
            reader = FrameReader()
            frame = None
            while frame is None:
                data = conn.recv(65536)
                if not data:
                    return
                reader.feed(data)
                frame = reader.next()
            head, blob = frame
            seen.append((dict(head), bytes(blob)))
            if isinstance(answer, bytes):
                conn.sendall(answer)
            elif answer is not None:
                conn.sendall(b"".join(encode({"id": head["id"], **answer})))

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return srv, t


def _forward_once(port: int, payload: Any, defer_ns: int) -> Exception | None:
    loop: Any = SelectorLoop("forward-test")
    node: Any = SimpleNamespace(id=3, nodes={2: {"repl": f"127.0.0.1:{port}"}})
    fw = Forwarders(node)
    answered = threading.Event()
    result: list[Exception | None] = []

    def done(err: Exception | None) -> None:
        result.append(err)
        answered.set()

    loop.start()
    try:
        loop.call_soon_threadsafe(fw.forward, loop, 2, "t", payload, defer_ns, done)
        assert answered.wait(10), "no answer from the forwarder"
    finally:
        loop.stop()
        loop.stopped.wait(5)
    return result[0]


def _run(answer: dict[str, Any] | bytes | None, payload: Any = None, defer_ns: int = 0
         ) -> tuple[Exception | None, list[tuple[dict[str, Any], bytes]]]:
    """Forward one publish (``payload``: a list of messages, or an MPUB body as a
    received (body, offsets, lengths); one message by default) to a scripted leader."""
    seen: list[tuple[dict[str, Any], bytes]] = []
    srv, t = _leader_answering(answer, seen)
    try:
        err = _forward_once(srv.getsockname()[1], payload or [b"x"], defer_ns)
    finally:
        t.join(5)
        srv.close()
    return err, seen


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
    err, _ = _run({"error": "E_PUB_FAILED PUB failed " + reason})
    assert isinstance(err, ForwardError), err
    assert err.lost is moved, (reason, str(err))
    assert reason in str(err)


def test_an_ok_is_passed_on_and_the_request_is_a_publish() -> None:
    err, seen = _run({})
    assert err is None
    assert seen == [({"op": "publish", "id": 1, "node": 3, "topic": "t", "kind": "pub"},
                     b"x")]


@pytest.mark.parametrize("payload,defer_ns,kind,blob", [
    ([b"later"], 5_000_000, "dpub", b"later"),
    ([b"a", b"bc"], 0, "mpub", struct.pack(">iI", 2, 1) + b"a" + struct.pack(">I", 2)
     + b"bc"),
    ((struct.pack(">iI", 1, 2) + b"hi", None, None), 0, "mpub",
     struct.pack(">iI", 1, 2) + b"hi"),
])
def test_deferred_and_multiple_messages_keep_their_kind(payload: Any, defer_ns: int,
                                                        kind: str, blob: bytes) -> None:
    err, seen = _run({}, payload, defer_ns)
    assert err is None
    head, got = seen[0]
    assert head["kind"] == kind and got == blob, (head, got)
    assert head.get("defer_ns", 0) == defer_ns


@pytest.mark.parametrize("answer", [
    None,                                                   # closed before answering
    b"".join(encode({"id": 99})),                           # an answer to no request
    b"\xff\xff\xff\xff" + b"\x00" * 8,                       # over the answer limit
], ids=["closed", "unknown-id", "oversize"])
def test_a_leader_that_goes_away_or_answers_nonsense_loses_the_publish(
        answer: bytes | None) -> None:
    err, _ = _run(answer)
    assert isinstance(err, ForwardError) and err.lost, err
