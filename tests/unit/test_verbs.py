"""The table of verbs (pybroker.server.verbs.VERBS), in process: a real
Runtime with one event loop, not started; the test thread runs the loop's turns and
talks to a real ClientConn over a socketpair. A command whose line arrives before its
body has its line step run once, when the line arrives, and its act once, when the body
does; the replies are those of the wire tests (tests/integration/test_raw_tcp.py)."""
from __future__ import annotations

import socket
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from pybroker.protocol.session import COMMANDS
from pybroker.server import verbs
from tests.support.inproc import close_runtime, read_frame, runtime, turn


def test_every_verb_of_the_state_table_has_a_row() -> None:
    assert set(verbs.VERBS) == set(COMMANDS)


def test_auth_gates_where_nsqd_checks() -> None:
    """nsqd's CheckAuth: SUB after its line, MPUB before it reads the body, PUB and DPUB
    after the body; no other verb asks for a grant."""
    gates = {verb: row.grant for verb, row in verbs.VERBS.items()}
    assert gates == {b"SUB": verbs.AFTER_LINE, b"MPUB": verbs.AFTER_LINE,
                     b"PUB": verbs.AFTER_BODY, b"DPUB": verbs.AFTER_BODY,
                     **{v: verbs.NO_GRANT for v in (b"IDENTIFY", b"AUTH", b"RDY",
                                                       b"FIN", b"REQ", b"TOUCH", b"CLS",
                                                       b"NOP")}}


class Wire:
    """One loop of a real Runtime and a client socket to a ClientConn on it."""

    def __init__(self, tmp: Path) -> None:
        self.rt = runtime(tmp, loop_threads="1")
        self.loop = self.rt.loops[0]
        self.client, server = socket.socketpair()
        self.client.settimeout(5)
        self.loop.add_connection(server, "test:1")
        self.got = bytearray()

    def send(self, data: bytes) -> None:
        self.client.sendall(data)
        turn(self.loop)
        self.rt.storage.run_pending()
        turn(self.loop)

    def frame(self) -> tuple[int, bytes]:
        return read_frame(self.client, self.got)

    def close(self) -> None:
        self.client.close()
        close_runtime(self.rt)


@pytest.fixture
def wire(tmp_path: Path) -> Iterator[Wire]:
    w = Wire(tmp_path)
    try:
        yield w
    finally:
        w.close()


@pytest.fixture
def line_runs(monkeypatch: pytest.MonkeyPatch) -> dict[bytes, int]:
    """Counts of each verb's line step (the real one runs; it is counted on the way)."""
    runs: dict[bytes, int] = {}
    for verb, row in list(verbs.VERBS.items()):
        def counted(c, cmd, _real=row.line, _verb=verb):  # type: ignore[no-untyped-def]
            runs[_verb] = runs.get(_verb, 0) + 1
            return _real(c, cmd)
        monkeypatch.setitem(verbs.VERBS, verb, row._replace(line=counted))
    return runs


def test_a_pub_whose_body_comes_later_runs_its_line_once(wire: Wire,
                                                          line_runs: dict[bytes, int]) -> None:
    wire.send(b"  V2PUB split\n")
    assert line_runs == {b"PUB": 1}
    assert wire.rt.broker.topics.get("split") is None    # nothing published yet
    body = b"hello"
    wire.send(struct.pack(">I", len(body)) + body[:2])
    wire.send(body[2:])
    assert wire.frame() == (0, b"OK")
    assert line_runs == {b"PUB": 1}
    log = wire.rt.broker.topics["split"].log
    assert log.written - log.oldest == 1


def test_a_bad_line_is_refused_before_the_body(wire: Wire,
                                               line_runs: dict[bytes, int]) -> None:
    """nsqd checks the topic name before it reads the body: E_BAD_TOPIC at once."""
    wire.send(b"  V2PUB bad/name\n")
    assert wire.frame() == (1, b'E_BAD_TOPIC PUB topic name "bad/name" is not valid')
    assert line_runs == {b"PUB": 1}


def test_a_body_size_error_after_a_held_line(wire: Wire,
                                             line_runs: dict[bytes, int]) -> None:
    """The line ran when it came; the size that follows is refused at the body step
    (E_BAD_MESSAGE, nsqd's text) without the line running again."""
    wire.send(b"  V2PUB big\n")
    wire.send(struct.pack(">I", 1 << 30))
    ftype, data = wire.frame()
    assert ftype == 1 and data.startswith(b"E_BAD_MESSAGE PUB"), data
    assert line_runs == {b"PUB": 1}


def test_mpub_split_runs_its_line_once(wire: Wire, line_runs: dict[bytes, int]) -> None:
    parts = [b"a", b"bb", b"ccc"]
    body = struct.pack(">I", len(parts)) + b"".join(struct.pack(">I", len(p)) + p
                                                    for p in parts)
    wire.send(b"  V2MPUB m\n" + struct.pack(">I", len(body)) + body[:5])
    wire.send(body[5:])
    assert wire.frame() == (0, b"OK")
    assert line_runs == {b"MPUB": 1}
