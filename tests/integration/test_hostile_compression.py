"""Hostile compressed streams against a real broker: pybroker and nsqd 1.3.0 side by side.

The rows of issue 21's table for snappy and deflate: a deflate bomb, a snappy chunk
header announcing 16 MiB on 20 connections, a stream without the stream identifier,
random bytes after the identifier, a corrupt deflate stream. Each is sent on raw
sockets (tests.support.hostile) while a Probe on another connection of the same loop
(pybroker runs one loop here) PUBs and times its round trips. Bounds are generous for
a shared machine (the real figures: loadtest/bench_hostile.py): the others' median round
trip within 50 ms and the worst within WORST_MS, RSS growth within 1 MB per hostile
connection (plus allocator slack), every malformed stream closed (by pybroker with an
E_INVALID frame and a log line), never a traceback (checked at teardown).
"""
from __future__ import annotations

import random
import zlib
from collections.abc import Callable

import pytest
import snappy

from tests.support import wire
from tests.support.broker import BrokerProcess, rss_kb, unique_name, wait_until
from tests.support.hostile import (SNAPPY_STREAM_ID, CompressedConn, deflate_bomb, probing,
                                   snappy_attack)

MEDIAN_MS = 50.0
WORST_MS = 300.0
SLACK_KB = 8 * 1024   # allocator and log-buffer noise of one broker process


@pytest.fixture
def target(make_broker: Callable[..., BrokerProcess], broker_kind: str) -> BrokerProcess:
    args = ["--loop-threads=1"] if broker_kind == "pybroker" else []
    return make_broker(*args, kind=broker_kind)


def _assert_fair(p: object, label: str) -> None:
    from tests.support.hostile import Probe

    assert isinstance(p, Probe)
    assert not p.errors, p.errors
    assert p.rtts, f"{label}: the probe got no answer at all"
    assert p.percentile_ms(0.5) <= MEDIAN_MS, f"{label}: {p.summary()}"
    assert p.worst_ms <= WORST_MS, f"{label}: {p.summary()}"


def _assert_refused(b: BrokerProcess, closed: bool, frames: list[tuple[int, bytes]],
                    reason: str) -> None:
    assert closed, f"{b.kind} kept the connection open"
    if b.kind == "pybroker":
        # nsqd closes without a frame and logs "failed to read command - <reason>"
        assert frames and frames[-1] == (
            wire.FRAME_ERROR, f"E_INVALID failed to read command - {reason}".encode()), frames
        line = f"failed to read command - {reason}"
        wait_until(lambda: line in b.stderr_text(), what="the log line")


def test_deflate_bomb(target: BrokerProcess) -> None:
    """16 KB that inflate to 16 MiB of NOP, then a PUB: answered, memory flat, others
    served throughout."""
    assert target.tcp_address is not None
    before = rss_kb(target.pid)
    with probing(target.tcp_address, unique_name("probe")) as p:
        seconds = deflate_bomb(target.tcp_address, unique_name("bomb"))
    grown = rss_kb(target.pid) - before
    print(f"{target.kind}: PUB after the bomb in {seconds:.2f}s; RSS +{grown} kB; "
          f"others: {p.summary()}")
    assert grown <= 1024 + SLACK_KB
    _assert_fair(p, "deflate bomb")


def test_snappy_chunk_announcing_16_mib(target: BrokerProcess) -> None:
    """A compressed-chunk header announcing 16 MiB - 1 bytes, then the bytes, on 20
    connections: refused at the header (Go: over the format's ~76 KB maximum)."""
    assert target.tcp_address is not None
    before = rss_kb(target.pid)
    header = SNAPPY_STREAM_ID + b"\x00\xff\xff\xff"
    with probing(target.tcp_address, unique_name("probe")) as p:
        for _ in range(20):
            closed, frames = snappy_attack(target.tcp_address, header + b"\0" * (4 << 20))
            _assert_refused(target, closed, frames, "snappy: unsupported input")
    grown = rss_kb(target.pid) - before
    print(f"{target.kind}: RSS +{grown} kB after 20 connections; others: {p.summary()}")
    assert grown <= 20 * 1024 + SLACK_KB
    _assert_fair(p, "16 MiB snappy chunks")


def test_snappy_without_stream_identifier(target: BrokerProcess) -> None:
    assert target.tcp_address is not None
    framed = bytes(snappy.StreamCompressor().compress(wire.pub(unique_name("t"), b"x")))
    assert framed.startswith(SNAPPY_STREAM_ID)
    closed, frames = snappy_attack(target.tcp_address, framed[len(SNAPPY_STREAM_ID):])
    _assert_refused(target, closed, frames, "snappy: corrupt input")


def test_random_bytes_after_the_stream_identifier(target: BrokerProcess) -> None:
    noise = random.Random(21).randbytes(2000)
    assert 0x02 <= noise[0] <= 0x7F  # a reserved unskippable chunk type: refused at once
    closed, frames = snappy_attack(target.tcp_address or ("", 0), SNAPPY_STREAM_ID + noise)
    _assert_refused(target, closed, frames, "snappy: unsupported input")


def test_corrupt_deflate_stream(target: BrokerProcess) -> None:
    assert target.tcp_address is not None
    c = CompressedConn(target.tcp_address, "deflate")
    try:
        c.send_raw(b"\xff" * 64)  # block type 3: reserved
        closed, frames = c.closing_frames(10)
    finally:
        c.close()
    _assert_refused(target, closed, frames, "flate: corrupt input before offset 0")


@pytest.mark.parametrize("kind", ["snappy", "deflate"])
def test_large_messages_still_flow(target: BrokerProcess, kind: str) -> None:
    """A well-behaved client's near-limit PUB and an MPUB cross the pieces and budgets."""
    assert target.tcp_address is not None
    topic = unique_name(kind)
    big = random.Random(1).randbytes(1024 * 1024 - 64)
    many = [b"m%d-" % i + b"y" * 300 for i in range(2000)]
    c = CompressedConn(target.tcp_address, kind)
    try:
        c.send(wire.pub(topic, big) + wire.mpub(topic, many))
        assert c.frame(20) == (wire.FRAME_RESPONSE, b"OK")
        assert c.frame(20) == (wire.FRAME_RESPONSE, b"OK")
        c.send(wire.sub(topic, "ch") + wire.rdy(2001))
        assert c.frame(20) == (wire.FRAME_RESPONSE, b"OK")
        bodies = []
        while len(bodies) < 2001:
            ftype, data = c.frame(20)
            if ftype == wire.FRAME_MESSAGE:
                msg = wire.parse_message(data)
                bodies.append(msg.body)
                c.send(wire.fin(msg.id))
        assert bodies[0] == big and bodies[1:] == many
    finally:
        c.close()


def test_deflate_level_stream_is_one_stream_across_writes(target: BrokerProcess) -> None:
    """Many small compressed writes of one DEFLATE stream, as go-nsq sends them."""
    assert target.tcp_address is not None
    topic = unique_name("small")
    c = CompressedConn(target.tcp_address, "deflate")
    z = zlib.compressobj(6, zlib.DEFLATED, -15)
    try:
        for i in range(300):
            c.send_raw(z.compress(wire.pub(topic, b"%d" % i)) + z.flush(zlib.Z_SYNC_FLUSH))
        # the broker answers with its own compressor (CompressedConn decodes it)
        for _ in range(300):
            assert c.frame(10) == (wire.FRAME_RESPONSE, b"OK")
    finally:
        c.close()
