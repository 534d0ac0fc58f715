"""A connection's commands run within the loop's turn budget (``Connection._run``,
TURN_BUDGET_NS): what is left of a piece runs next turn, before anything more is read.
64 KB of NOPs are 16,384 commands, and ran 25-38 ms in one turn before
(loadtest/bench_hostile.py ``nopflood``). A real Runtime in this process, its loop
turned by the test, a real socket; the budget set to nothing, so that each turn runs
RUN_CHECK commands, whatever this machine's speed."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

import pybroker.server.connection as connection
from pybroker.runtime import Runtime
from tests.support.inproc import connect, read_frame, temp_runtime, turn
from tests.support.wire import FRAME_RESPONSE, pub


@pytest.fixture
def rt() -> Iterator[Runtime]:
    with temp_runtime("runbudget-") as r:
        yield r


def test_a_flood_of_commands_runs_a_budget_a_turn(rt: Runtime,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(connection, "TURN_BUDGET_NS", 0)
    client, conn = connect(rt)
    loop = rt.loops[0]
    n = 4096
    client.sendall(b"NOP\n" * n + pub("t", b"after the flood"))
    turns = 0
    seen: list[int] = []
    while True:
        turn(loop)
        turns += 1
        seen.append(conn.decoder.buffered())
        if not conn.run_left:
            break
        assert turns < n, "the flood never ends"
    # every turn ran at most RUN_CHECK commands, and nothing more was read meanwhile:
    # the bytes it holds unparsed only went down
    assert turns >= n // (connection.RUN_CHECK + 1)
    assert all(a >= b for a, b in zip(seen, seen[1:]))
    got = bytearray()
    assert read_frame(client, got, lambda: turn(loop)) == (FRAME_RESPONSE, b"OK")
    # the connection goes on as before: the next commands run in the turn they come
    monkeypatch.setattr(connection, "TURN_BUDGET_NS", 2_000_000)
    client.sendall(pub("t", b"again"))
    turn(loop)
    assert not conn.run_left
    assert read_frame(client, got, lambda: turn(loop)) == (FRAME_RESPONSE, b"OK")
    client.close()
