"""The I/O life of a client connection (pybroker.server.iostate), in process.

The table on its own, then a Hypothesis state machine that drives a real ClientConn
over a socketpair on a real Runtime with two event loops, not started: the test thread
runs the loops' turns. Its rules are what a client and the broker do to a connection
(the magic, a bad magic, silence until client_timeout, a command, a fatal command, SUB
on this loop's channel or on the other loop's, a TLS slot held and given, the peer
closing, the broker exiting); after each step the connection's ``io`` must be the
model's state, and the moves it made (seen through a spy around the real
``iostate.move``) the ones the step implies."""
from __future__ import annotations

import shutil
import socket
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pybroker.server import connection
from pybroker.server.iostate import (AWAIT_MAGIC, CLOSED, DRAINING, HELD, MOVES, MOVING, OPEN,
                                     Io, IoStateError, move)
from pybroker.testing import wait_until
from tests.support.inproc import close_runtime, read_frame, runtime, turn


def test_every_move_outside_the_table_raises() -> None:
    for src in Io:
        for dst in Io:
            if dst in MOVES[src]:
                assert move(src, dst) is dst
            else:
                with pytest.raises(IoStateError):
                    move(src, dst)


def test_closed_is_the_end_and_every_state_leads_to_it() -> None:
    assert MOVES[CLOSED] == frozenset()
    assert MOVES[DRAINING] == {CLOSED}
    for src in Io:
        if src is not CLOSED:
            assert CLOSED in MOVES[src], src
    seen, todo = {AWAIT_MAGIC}, [AWAIT_MAGIC]
    while todo:
        for dst in MOVES[todo.pop()]:
            if dst not in seen:
                seen.add(dst)
                todo.append(dst)
    assert seen == set(Io)


def test_no_state_goes_back_to_awaiting_the_magic() -> None:
    assert not any(AWAIT_MAGIC in dsts for dsts in MOVES.values())


class ConnectionLife(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.mkdtemp(prefix="iostate-")
        # client_timeout is also the magic's deadline: at 300 ms a loaded machine (one CI
        # run here) let it pass between a rule's connect and its bad magic, and the close
        # with the magic unread reset the socket before the E_BAD_PROTOCOL was read
        self.rt = runtime(Path(self.tmp), loop_threads="2", client_timeout="1s")
        self.channels = 0
        self.clients: list[socket.socket] = []
        self.moves: list[tuple[Io, Io]] = []
        self._real_move = connection.move
        connection.move = self._spy
        self._connect()

    def _connect(self) -> None:
        """A new client on the first loop (the one before it is closed)."""
        self.client, server = socket.socketpair()
        self.clients.append(self.client)
        self.client.settimeout(5)
        first = self.rt.loops[0]
        first.add_connection(server, "test:1")
        (conn,) = first.connections
        assert isinstance(conn, connection.ClientConn)
        self.conn = conn
        self.model = AWAIT_MAGIC
        self.subscribed = False
        self.got = bytearray()

    def _spy(self, src: Io, dst: Io) -> Io:
        out = self._real_move(src, dst)   # the real table decides; a bad move raises
        self.moves.append((src, dst))
        return out

    def teardown(self) -> None:
        connection.move = self._real_move
        for c in self.clients:
            c.close()
        if not self.conn.closed:
            self.conn.close("test over")
        close_runtime(self.rt)
        shutil.rmtree(self.tmp, ignore_errors=True)

    # -- driving -------------------------------------------------------------------------
    def _turn(self, *loops: Any) -> None:
        for loop in loops or self.rt.loops:
            turn(loop)
        self.rt.storage.run_pending()

    def _send(self, data: bytes, *loops: Any) -> None:
        self.client.sendall(data)
        self._turn(*loops)
        self._turn(*loops)

    def _frame(self) -> bytes:
        return read_frame(self.client, self.got)[1]

    def _expect(self, *moves: tuple[Io, Io]) -> None:
        assert self.moves == list(moves), (self.moves, moves)
        self.moves.clear()

    def _channel(self, here: bool) -> str:
        """A new channel of topic t that the connection's loop owns (here) or not."""
        while True:
            self.channels += 1
            name = f"c{self.channels}"
            if (self.rt.broker.pick_owner("t", name) is self.conn.loop) == here:
                return name

    # -- the rules (one rule per way out of a state, so that walks go deep) -------------
    @precondition(lambda self: self.model is AWAIT_MAGIC)
    @rule()
    def magic(self) -> None:
        self._send(b"  V2")
        self.model = OPEN
        self._expect((AWAIT_MAGIC, OPEN))

    @precondition(lambda self: self.model is AWAIT_MAGIC)
    @rule(how=st.sampled_from(["bad magic", "silence", "peer closes", "broker exits"]))
    def no_magic(self, how: str) -> None:
        if how == "bad magic":
            self._send(b"GET ")
            assert self._frame() == b"E_BAD_PROTOCOL"
            self._expect((AWAIT_MAGIC, DRAINING), (DRAINING, CLOSED))
        elif how == "silence":   # until client_timeout
            def closed() -> bool:
                self._turn()
                return self.conn.closed
            wait_until(closed, timeout_s=5, what="the magic timeout")
            self._expect((AWAIT_MAGIC, CLOSED))
        else:
            self._end(how)
        self.model = CLOSED

    def _end(self, how: str) -> None:
        was = self.model
        if how == "peer closes":
            self.client.shutdown(socket.SHUT_WR)
            self._turn()
            self._turn()
        else:
            self.conn.close("broker exiting", flush=True)
        self.model = CLOSED
        self._expect((was, CLOSED))

    @precondition(lambda self: self.model is OPEN)
    @rule()
    def nop(self) -> None:
        self._send(b"NOP\n")
        self._expect()

    @precondition(lambda self: self.model is OPEN)
    @rule(how=st.sampled_from(["fatal command", "peer closes", "broker exits"]))
    def open_ends(self, how: str) -> None:
        if how == "fatal command":
            self._send(b"BOGUS\n")
            assert self._frame() == b"E_INVALID invalid command BOGUS"
            self.model = CLOSED
            self._expect((OPEN, DRAINING), (DRAINING, CLOSED))
        else:
            self._end(how)

    @precondition(lambda self: self.model is OPEN and not self.subscribed)
    @rule()
    def sub_on_this_loop(self) -> None:
        self._send(b"SUB t %s\n" % self._channel(True).encode())
        assert self._frame() == b"OK"
        self.subscribed = True
        self._expect()

    @precondition(lambda self: self.model is OPEN and not self.subscribed)
    @rule()
    def sub_on_the_other_loop(self) -> None:
        """Only the connection's loop runs: the connection waits, handed over."""
        self._send(b"SUB t %s\n" % self._channel(False).encode(), self.conn.loop)
        self.subscribed = True
        self.model = MOVING
        self._expect((OPEN, MOVING))

    @precondition(lambda self: self.model is MOVING)
    @rule()
    def bytes_while_moving(self) -> None:
        """Not read by the old loop; they travel with the connection."""
        loop = self.conn.loop
        self.client.sendall(b"NOP\n")
        self._turn(*(lp for lp in self.rt.loops if lp is not loop))
        self._expect()

    @precondition(lambda self: self.model is MOVING)
    @rule()
    def adopted(self) -> None:
        self._turn(self.conn.loop)
        assert self._frame() == b"OK"
        assert self.conn in self.conn.loop.connections
        self.model = OPEN
        self._expect((MOVING, OPEN))

    @precondition(lambda self: self.model is OPEN)
    @rule()
    def no_tls_slot(self) -> None:
        self.conn.hold_input()
        self.model = HELD
        self._expect((OPEN, HELD))

    @precondition(lambda self: self.model is HELD)
    @rule()
    def bytes_while_held(self) -> None:
        self._send(b"NOP\n")
        self._expect()

    @precondition(lambda self: self.model is HELD)
    @rule()
    def a_tls_slot(self) -> None:
        self.conn.release_input()
        self._turn()
        self.model = OPEN
        self._expect((HELD, OPEN))

    @precondition(lambda self: self.model is HELD or self.model is MOVING)
    @rule()
    def broker_exits(self) -> None:
        self._end("broker exits")

    @precondition(lambda self: self.model is CLOSED)
    @rule()
    def late_calls_then_a_new_client(self) -> None:
        """A late failure or answer on a closed connection changes nothing."""
        self.conn.close_after_flush()
        self.conn.send_frame(b"late")
        self.conn.close("again")
        self._turn()
        self._expect()
        assert self.conn.closed
        self._connect()

    @invariant()
    def the_state_is_the_models(self) -> None:
        assert self.conn.io is self.model, (self.conn.io, self.model)
        assert self.conn.closed == (self.model is CLOSED)
        if self.model is CLOSED:
            assert not any(self.conn in lp.connections for lp in self.rt.loops)


ConnectionLife.TestCase.settings = settings(
    max_examples=30, stateful_step_count=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_connection_life = ConnectionLife.TestCase
