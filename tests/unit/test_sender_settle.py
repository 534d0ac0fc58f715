"""A dispatch pass's writes on the loop's sender thread (server/loop.py,
``EventLoop.deliver`` / ``settle_sends``), in process: a real Runtime with one event
loop, not started; the test thread runs its turns. C_FROM consumers at RDY 1 on
socket pairs whose send buffers are small, so each pass's frames are more than a
socket takes at once: the job's writes are partial, and what a socket did not take must
be owed and sent once the client reads, even when nothing else happens after the pass
(no FIN, no other pass: the first turn after its own that finds it done settles it)."""
from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from pybroker._native import batchio
from pybroker._native.batchio import C_FROM
from pybroker.testing import wait_until
from tests.support.inproc import close_runtime, read_frame, runtime, turn

pytestmark = pytest.mark.skipif(not batchio._SENDER,
                                reason="the sender thread needs the compiled codec")

BODY = 30_000           # a frame of about 30 KB: more than a small socket buffer


class Loop:
    """One loop of a real Runtime; clients on socket pairs, the loop's turns run here."""

    def __init__(self, tmp: Path, sender: str = "on") -> None:
        self.rt = runtime(tmp, loop_threads="1", loop_sender=sender)
        self.loop = self.rt.loops[0]
        self.clients: list[socket.socket] = []

    def connect(self, sndbuf: int = 0) -> socket.socket:
        client, server = socket.socketpair()
        if sndbuf:
            server.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        client.settimeout(5)
        self.loop.add_connection(server, f"test:{len(self.clients)}")
        self.clients.append(client)
        client.sendall(b"  V2")
        return client

    def turns(self, n: int) -> None:
        for _ in range(n):
            turn(self.loop)
            self.rt.storage.run_pending()

    def close(self) -> None:
        for c in self.clients:
            c.close()
        self.loop.settle_sends()
        close_runtime(self.rt)


@pytest.fixture(params=["on", "off"])
def wire(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Loop]:
    """The loop with its sender thread writing such passes (``loop_sender = "on"``),
    and without (``"off"``: the loop writes them itself, the same way as the end of a
    turn's batched writes)."""
    w = Loop(tmp_path, request.param)
    yield w
    w.close()


def test_partial_writes_of_a_job_are_sent_with_nothing_after_the_pass(wire: Loop) -> None:
    consumers = [wire.connect(sndbuf=4096) for _ in range(C_FROM)]
    for c in consumers:
        c.sendall(b"SUB t ch\n")
    wire.turns(2)
    bufs = [bytearray() for _ in consumers]
    for c, buf in zip(consumers, bufs):
        assert read_frame(c, buf, lambda: wire.turns(1)) == (0, b"OK")
    for c in consumers:
        c.sendall(b"RDY 1\n")
    wire.turns(2)
    producer = wire.connect()
    bodies = [bytes([65 + i]) * BODY for i in range(C_FROM)]
    mpub = (b"MPUB t\n" + struct.pack(">II", 4 + (4 + BODY) * len(bodies),
                                      len(bodies))
            + b"".join(struct.pack(">I", BODY) + b for b in bodies))
    # more than the socket pair holds: sent from a thread while the loop reads it
    sending = threading.Thread(target=producer.sendall, args=(mpub,))
    sending.start()
    wait_until(lambda: wire.turns(1) or not sending.is_alive(), timeout_s=5,
               what="the MPUB read")
    sending.join()
    # the publish, then one pass for all of them: its frames go to the sender, and each
    # socket takes only part of its frame; the producer's OK ends the pass's turn
    assert read_frame(producer, bytearray(), lambda: wire.turns(1)) == (0, b"OK")
    # settled by a turn after the pass, once the sender is done with it
    wait_until(lambda: wire.turns(1) or wire.loop._job is None, timeout_s=5,
               what="the job settled")
    # nothing else happens: no FIN, no publish. Each consumer reads its whole message
    # while the loop runs idle turns (the rest of its frame owed, sent as it drains)
    got = set()
    for c, buf in zip(consumers, bufs):
        ftype, data = read_frame(c, buf, lambda: wire.turns(1))
        assert ftype == 2
        got.add(data[26:])
    assert got == set(bodies)
    # the sender's thread starts at its first job: only "on" had one
    assert (wire.loop.sender._s is not None) == (wire.loop.send_choice.use_sender)
