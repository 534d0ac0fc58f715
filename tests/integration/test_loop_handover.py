"""A SUB moves the connection to the loop that owns its channel. With two loops, commands
a client pipelined around the SUB in the same write must be answered exactly once each,
in order, by whichever loop owns the connection at that moment (nsqd answers them in
order on the connection's one goroutine). Raw sockets, many clients at once."""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

import pytest

from tests.support.broker import BrokerProcess, unique_name
from tests.support.wire import (FRAME_ERROR, FRAME_MESSAGE, FRAME_RESPONSE, HEARTBEAT,
                                MAGIC_V2, fin, nop, parse_message, pub, rdy, read_frame,
                                sub)

MakeBroker = Callable[..., BrokerProcess]
CLIENTS = 64
ROUNDS = 4
NOT_IN_FLIGHT = b"0" * 16
TAIL = 300


def _pipelined(topic: str, other: str, i: int) -> bytes:
    """Everything in one write: a PUB before the SUB (its OK is still unconfirmed when
    the SUB runs), then SUB, RDY, NOP, a FIN of no message, PUBs to both topics."""
    return b"".join([
        MAGIC_V2,
        pub(other, b"before-%d" % i),
        sub(topic, "ch"),
        rdy(5),
        nop(),
        pub(other, b"after-%d" % i),
        fin(NOT_IN_FLIGHT),
        pub(topic, b"self-%d" % i),
        # long enough that running it outlasts a GIL switch interval: the loop the
        # connection moves to runs meanwhile
        *[pub(other, b"tail-%d-%d" % (i, k)) for k in range(TAIL)],
    ])


# the answers, in order; the one message (self-i) may come anywhere after the SUB's OK
EXPECTED = [(FRAME_RESPONSE, b"OK"),   # PUB before
            (FRAME_RESPONSE, b"OK"),   # SUB
            (FRAME_RESPONSE, b"OK"),   # PUB after
            (FRAME_ERROR, b"E_FIN_FAILED"),
            (FRAME_RESPONSE, b"OK"),   # PUB self
            *[(FRAME_RESPONSE, b"OK")] * TAIL]


def _client(address: tuple[str, int], topic: str, other: str, i: int,
            problems: list[str]) -> None:
    try:
        with socket.create_connection(address, timeout=10) as s:
            s.sendall(_pipelined(topic, other, i))
            answers: list[tuple[int, bytes]] = []
            messages: list[bytes] = []
            deadline = time.monotonic() + 15
            while len(answers) < len(EXPECTED) or not messages:
                ftype, data = read_frame(s, max(0.1, deadline - time.monotonic()))
                if ftype == FRAME_RESPONSE and data == HEARTBEAT:
                    continue
                if ftype == FRAME_MESSAGE:
                    if len(answers) < 2:
                        problems.append(f"client {i}: a message before the SUB's OK")
                    messages.append(parse_message(data).body)
                    continue
                code = data.split(b" ", 1)[0] if ftype == FRAME_ERROR else data
                answers.append((ftype, code))
            if answers != EXPECTED or messages != [b"self-%d" % i]:
                problems.append(f"client {i}: answers {answers}, messages {messages}")
            # nothing else may follow: no answer run twice on the other loop
            s.settimeout(0.3)
            try:
                extra = s.recv(4096)
            except TimeoutError:
                extra = b""
            while extra:
                ftype, data = _split_first(extra)
                if not (ftype == FRAME_RESPONSE and data == HEARTBEAT):
                    problems.append(f"client {i}: unexpected extra bytes {extra[:80]!r}")
                    break
                extra = extra[8 + len(data):]
    except Exception as e:   # collected, reported by the test thread
        problems.append(f"client {i}: {type(e).__name__}: {e}")


def _split_first(buf: bytes) -> tuple[int, bytes]:
    size = int.from_bytes(buf[:4], "big")
    return int.from_bytes(buf[4:8], "big"), buf[8:4 + size]


@pytest.mark.parametrize("loops", [1, 2])
def test_pipelined_commands_around_sub_are_answered_once_in_order(
        make_broker: MakeBroker, loops: int) -> None:
    b = make_broker(f"--loop-threads={loops}")
    assert b.tcp_address is not None
    other = unique_name("hand-other")
    for rnd in range(ROUNDS):
        problems: list[str] = []
        threads = [threading.Thread(
            target=_client, args=(b.tcp_address, unique_name(f"hand{rnd}-{i}"), other, i,
                                  problems)) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not problems, "\n".join(problems[:20])
    assert "Traceback" not in b.stderr_text()
