"""Publishes handed to the loop that owns their topic (server/publish.py, docs/ownership.md).

With two loop threads a topic belongs to loop ``crc32(topic) % 2``; a connection lives on
whichever loop accepted it. A client pipelining PUB, MPUB and DPUB to topics of both loops
in one write gets one answer per command, in its commands' order, and every message is
stored once, in the order its connection sent it; a big MPUB (appended in slices) to the
other loop's topic is answered once, after its last slice. With the fault seam failing
one topic's writes, pipelined publishes to the other topic before the failure are still
answered OK and the failing one gets nsqd's error, in order, then the connection closes.
"""
from __future__ import annotations

import socket
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.broker import BrokerProcess, rss_kb, unique_name
from tests.support.durability import bodies, consume, create_channel
from tests.support.wire import (
    FRAME_ERROR,
    FRAME_RESPONSE,
    ConnectionClosed,
    WireClient,
    dpub,
    mpub,
    pub,
)

MakeBroker = Callable[..., BrokerProcess]
SLICE = 20_000   # server/publish.py: bigger MPUBs are appended in slices


def owned_by(loop: int, prefix: str) -> str:
    for i in range(10_000):
        name = f"{prefix}{i}"
        if zlib.crc32(name.encode()) % 2 == loop:
            return name
    raise AssertionError("no name found")


def test_pipelined_publishes_to_both_loops_answer_in_order(make_broker: MakeBroker) -> None:
    b = make_broker("--loop-threads=2")
    prefix = unique_name("handoff")
    topics = [owned_by(0, prefix + "a"), owned_by(1, prefix + "b")]
    for t in topics:
        create_channel(b, t, "ch")
    sent: dict[str, list[bytes]] = {t: [] for t in topics}
    clients = [WireClient.connect(b.tcp_address) for _ in range(2)]  # type: ignore[arg-type]
    try:
        for k, c in enumerate(clients):             # one connection on each loop
            data = b""
            for i in range(300):
                t = topics[(i + k) % 2]
                body = f"c{k}-{i:04d}".encode()
                kind = i % 3
                if kind == 0:
                    data += pub(t, body)
                    sent[t].append(body)
                elif kind == 1:
                    many = [body + b"-%d" % j for j in range(4)]
                    data += mpub(t, many)
                    sent[t] += many
                else:
                    data += dpub(t, 0, body)
                    sent[t].append(body)
            c.send(data)
        for c in clients:
            answers = [c.read_frame(10.0) for _ in range(300)]
            assert answers == [(FRAME_RESPONSE, b"OK")] * 300
            c.assert_alive()
    finally:
        for c in clients:
            c.close()
    for t in topics:
        got = bodies(consume(b, t, "ch", expect=len(sent[t]), rdy_count=1000))
        assert sorted(got) == sorted(sent[t])
        for k in range(2):                          # each connection's order is kept
            mine = [m for m in got if m.startswith(f"c{k}-".encode())]
            assert mine == [m for m in sent[t] if m.startswith(f"c{k}-".encode())]


def test_big_mpub_to_the_other_loop_is_answered_once(make_broker: MakeBroker) -> None:
    b = make_broker("--loop-threads=2")
    prefix = unique_name("bigmpub")
    topics = [owned_by(0, prefix + "a"), owned_by(1, prefix + "b")]
    n = SLICE + 7                                   # two slices
    for t in topics:
        create_channel(b, t, "ch")
    with WireClient.connect(b.tcp_address) as c:  # type: ignore[arg-type]
        for t in topics:                            # one of them is the other loop's
            c.send(mpub(t, [b"%06d" % i for i in range(n)]) + pub(t, b"after"))
            assert c.read_frame(30.0) == (FRAME_RESPONSE, b"OK")
            assert c.read_frame(10.0) == (FRAME_RESPONSE, b"OK")
        c.assert_alive()
    for t in topics:
        got = bodies(consume(b, t, "ch", expect=n + 1, rdy_count=2500, timeout_s=60))
        assert got == [b"%06d" % i for i in range(n)] + [b"after"]


def test_a_failing_topic_fails_only_its_publish_in_a_pipeline(make_broker: MakeBroker,
                                                             tmp_path: Path) -> None:
    prefix = unique_name("pipefail")
    good, bad = owned_by(0, prefix + "g"), owned_by(1, prefix + "b")
    flag = tmp_path / "fail"
    flag.touch()
    b = make_broker("--loop-threads=2", env={
        "PYBROKER_FAULTS": f"op=pwrite kind=EIO count=0 while={flag} path=/topics/{bad}/"})
    create_channel(b, good, "ch")
    for _ in range(2):                              # a connection on each loop
        with WireClient.connect(b.tcp_address) as c:  # type: ignore[arg-type]
            c.send(pub(good, b"g1") + mpub(good, [b"g2", b"g3"]) + pub(bad, b"x")
                   + pub(good, b"never run"))
            assert c.read_frame(10.0) == (FRAME_RESPONSE, b"OK")
            assert c.read_frame(10.0) == (FRAME_RESPONSE, b"OK")
            ftype, text = c.read_frame(10.0)
            assert ftype == FRAME_ERROR and text.startswith(b"E_PUB_FAILED PUB failed "), text
            assert b"EIO" in text
            try:
                frame = c.read_frame(2.0)
            except (ConnectionClosed, OSError):
                frame = None
            assert frame is None, f"a command after the fatal error was answered: {frame}"
    flag.unlink()
    with WireClient.connect(b.tcp_address) as c:  # type: ignore[arg-type]
        c.pub(bad, b"works again")
    got = bodies(consume(b, good, "ch", expect=6))
    assert got == [b"g1", b"g2", b"g3"] * 2


@pytest.mark.parametrize("mode", ["memory", "fsync"])
def test_flood_of_handed_over_publishes_is_bounded(make_broker: MakeBroker,
                                                   mode: str) -> None:
    """A client streams PUBs to topics of both loops and never reads an answer: while a
    publish of it waits (handed over, or for its fsync), the broker stops reading it
    once commands wait behind it, so what it holds stays bounded; others are served."""
    b = make_broker("--loop-threads=2", f"--durability={mode}")
    assert b.proc is not None and b.tcp_address is not None
    prefix = unique_name("flood")
    topics = [owned_by(0, prefix + "a"), owned_by(1, prefix + "b")]
    chunk = b"".join(pub(topics[i % 2], b"spam") for i in range(5000))
    flood = socket.create_connection(b.tcp_address)
    flood.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    flood.sendall(b"  V2")
    flood.setblocking(False)
    rss0 = rss_kb(b.proc.pid)
    sent, rtts = 0, []
    left = memoryview(b"")
    deadline = time.monotonic() + 4
    with WireClient.connect(b.tcp_address) as probe:
        while time.monotonic() < deadline:
            if not left:
                left = memoryview(chunk)
            try:
                n = flood.send(left)
                sent += n
                left = left[n:]
            except BlockingIOError:
                pass
            t0 = time.perf_counter()
            probe.pub(prefix + "probe", b"p")
            rtts.append(time.perf_counter() - t0)
    grew = rss_kb(b.proc.pid) - rss0
    flood.close()
    print(f"{mode}: sent {sent / 1e6:.1f} MB unread; RSS grew {grew / 1024:.1f} MiB; "
          f"probe max {max(rtts) * 1e3:.0f} ms")
    assert grew < 60 * 1024, f"RSS grew by {grew / 1024:.0f} MiB"
    assert max(rtts) < 1.0
