"""The V2 session's state table (pybroker.protocol.session), sans-IO. The texts are
nsqd's; tests/integration/test_raw_tcp.py and test_fuzz_input.py compare them with a
real nsqd over sockets."""
from __future__ import annotations

import pytest

from pybroker.errors import Invalid
from pybroker.protocol.session import COMMANDS, Session, SessionError
from pybroker.protocol.wire import ClientState

VERBS = sorted(COMMANDS)


def _at(state: ClientState) -> Session:
    s = Session()
    path = {ClientState.INIT: [], ClientState.CONNECTED: ["subscribe"],
            ClientState.SUBSCRIBED: ["subscribe", "subscribed"],
            ClientState.CLOSING: ["subscribe", "subscribed", "close_wait"]}[state]
    for event in path:
        s.move(event)
    assert s.state == state
    return s


# what nsqd does with each verb in each state: run, ignore, or E_INVALID
EXPECTED = {
    ClientState.INIT: {b"IDENTIFY", b"AUTH", b"SUB", b"PUB", b"MPUB", b"DPUB", b"NOP"},
    ClientState.CONNECTED: {b"PUB", b"MPUB", b"DPUB", b"NOP"},
    ClientState.SUBSCRIBED: {b"RDY", b"FIN", b"REQ", b"TOUCH", b"CLS", b"PUB", b"MPUB",
                             b"DPUB", b"NOP"},
    ClientState.CLOSING: {b"FIN", b"REQ", b"TOUCH", b"PUB", b"MPUB", b"DPUB", b"NOP"},
}


@pytest.mark.parametrize("state", list(EXPECTED), ids=lambda s: s.name)
@pytest.mark.parametrize("verb", VERBS, ids=lambda v: v.decode())
def test_the_table(state: ClientState, verb: bytes) -> None:
    s = _at(state)
    if verb in EXPECTED[state]:
        assert s.check(verb) is True
    elif verb == b"RDY" and state == ClientState.CLOSING:
        assert s.check(verb) is False        # nsqd ignores RDY after CLS
    else:
        with pytest.raises(Invalid) as e:
            s.check(verb)
        assert e.value.payload() == f"E_INVALID cannot {verb.decode()} in current state".encode()
        assert e.value.fatal


def test_unknown_verb() -> None:
    with pytest.raises(Invalid) as e:
        Session().check(b"PUBX")
    assert e.value.payload() == b"E_INVALID invalid command PUBX"


def test_tls_required_refuses_all_but_identify_until_tls() -> None:
    s = Session(tls_required=True)
    assert s.check(b"IDENTIFY")
    for verb in (b"PUB", b"SUB", b"NOP", b"BOGUS"):
        with pytest.raises(Invalid) as e:
            s.check(verb)
        assert e.value.payload() == \
            f"E_INVALID cannot {verb.decode()} in current state (TLS required)".encode()
    s.tls = True
    assert s.check(b"PUB")


@pytest.mark.parametrize("event", ["subscribed", "close_wait"])
def test_moves_out_of_order_are_bugs(event: str) -> None:
    with pytest.raises(SessionError):
        Session().move(event)


def test_identify_only_in_init_and_hold_release_balance() -> None:
    s = Session()
    s.identify_done()
    assert s.identified
    s.hold()
    s.hold()
    s.release()
    assert s.upgrading == 1
    s.release()
    with pytest.raises(SessionError):
        s.release()
    s.move("subscribe")
    with pytest.raises(SessionError):
        s.identify_done()


def test_every_handled_verb_is_in_the_table() -> None:
    from pybroker.server.verbs import VERBS

    assert set(VERBS) == set(COMMANDS)
