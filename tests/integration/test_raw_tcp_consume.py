"""TCP protocol V2 on raw sockets: the consuming commands RDY, FIN, REQ, TOUCH and CLS,
with every error code and its fatality.

Every test runs against pybroker and, when the binary is found, a real nsqd 1.3.0, with
the same assertions: codes match exactly, texts by nsqd's prefix. Commands are encoded
with tests/support/wire.py, never with pybroker's own codec.
"""
from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.support import wire
from tests.support.broker import BrokerProcess, unique_name
from tests.support.wire import WireClient, subscribe

Connect = Callable[..., WireClient]
UNKNOWN_ID = b"0123456789abcdef"


# -- RDY -----------------------------------------------------------------------------------
def test_rdy_without_count_means_one(any_broker: BrokerProcess, connect: Connect) -> None:
    topic = unique_name()
    connect(any_broker).mpub(topic, [b"a", b"b", b"c"])
    c = subscribe(connect(any_broker), topic)
    c.send(b"RDY\n")
    first = c.read_message()
    c.expect_nothing(0.3)
    c.fin(first.id)
    second = c.read_message()
    assert first.body != second.body
    c.expect_nothing(0.2)


@pytest.mark.parametrize("count, text", [
    ("51", "E_INVALID RDY count 51 out of range 0-50"),
    ("-1", "E_INVALID RDY could not parse count -1"),
    ("many", "E_INVALID RDY could not parse count many"),
])
def test_rdy_bad_count_is_fatal(small_broker: BrokerProcess, connect: Connect, count: str,
                                text: str) -> None:
    c = subscribe(connect(small_broker), unique_name())
    c.send(wire.command("RDY", count))
    c.expect_error("E_INVALID", prefix=text)


def test_rdy_max_count_ok(small_broker: BrokerProcess, connect: Connect) -> None:
    c = subscribe(connect(small_broker), unique_name())
    c.rdy(50)
    c.assert_alive()


def test_rdy_before_sub_is_invalid(any_broker: BrokerProcess, connect: Connect) -> None:
    c = connect(any_broker)
    c.send(wire.rdy(1))
    c.expect_error("E_INVALID", prefix="E_INVALID cannot RDY in current state")


# -- FIN / REQ / TOUCH ---------------------------------------------------------------------
MSG_VERBS = {"FIN": ("E_FIN_FAILED", ()), "REQ": ("E_REQ_FAILED", ("0",)),
             "TOUCH": ("E_TOUCH_FAILED", ())}


@pytest.mark.parametrize("verb", MSG_VERBS)
@pytest.mark.parametrize("msg_id", [b"abc", UNKNOWN_ID + b"0", b""])
def test_wrong_id_length_is_fatal(any_broker: BrokerProcess, connect: Connect, verb: str,
                                  msg_id: bytes) -> None:
    c = subscribe(connect(any_broker), unique_name())
    c.send(wire.command(verb, msg_id, *MSG_VERBS[verb][1]))
    c.expect_error("E_INVALID", prefix="E_INVALID invalid message ID")


@pytest.mark.parametrize("verb", MSG_VERBS)
def test_unknown_id_is_not_fatal(any_broker: BrokerProcess, connect: Connect,
                                 verb: str) -> None:
    topic = unique_name()
    c = subscribe(connect(any_broker), topic, rdy=1)
    code, extra = MSG_VERBS[verb]
    c.send(wire.command(verb, UNKNOWN_ID, *extra))
    c.expect_error(code, prefix=f"{code} {verb} {UNKNOWN_ID.decode()} failed ID not in flight")
    # the connection keeps working as a consumer too
    c.pub(topic, b"after")
    msg = c.read_message()
    assert msg.body == b"after"
    c.fin(msg.id)
    c.fin(msg.id)
    c.expect_error("E_FIN_FAILED", prefix=f"E_FIN_FAILED FIN {msg.id.decode()} failed")


def test_fin_of_message_owned_by_another_client(any_broker: BrokerProcess,
                                                connect: Connect) -> None:
    topic = unique_name()
    owner = subscribe(connect(any_broker), topic, rdy=1)
    other = subscribe(connect(any_broker), topic)
    owner.pub(topic, b"mine")
    msg = owner.read_message()
    other.fin(msg.id)
    other.expect_error("E_FIN_FAILED", prefix=f"E_FIN_FAILED FIN {msg.id.decode()} failed "
                                              "client does not own message")
    owner.fin(msg.id)
    owner.assert_alive()


@pytest.mark.parametrize("verb", MSG_VERBS)
def test_msg_verbs_before_sub_are_invalid(any_broker: BrokerProcess, connect: Connect,
                                          verb: str) -> None:
    c = connect(any_broker)
    c.send(wire.command(verb, UNKNOWN_ID, *MSG_VERBS[verb][1]))
    c.expect_error("E_INVALID", prefix=f"E_INVALID cannot {verb} in current state")


@pytest.mark.parametrize("line, text", [
    (b"FIN\n", "E_INVALID FIN insufficient number of params"),
    (b"TOUCH\n", "E_INVALID TOUCH insufficient number of params"),
    (b"REQ " + UNKNOWN_ID + b"\n", "E_INVALID REQ insufficient number of params"),
    (b"REQ " + UNKNOWN_ID + b" x\n", "E_INVALID REQ could not parse timeout x"),
])
def test_msg_verbs_bad_params(any_broker: BrokerProcess, connect: Connect, line: bytes,
                              text: str) -> None:
    c = subscribe(connect(any_broker), unique_name())
    c.send(line)
    c.expect_error("E_INVALID", prefix=text)


def test_req_timeout_above_max_is_clamped(small_broker: BrokerProcess, connect: Connect) -> None:
    topic = unique_name()
    c = subscribe(connect(small_broker), topic, rdy=1)
    c.pub(topic, b"clamped")
    msg = c.read_message()
    c.req(msg.id, 999_999_999)
    c.assert_alive()  # clamped to max-req-timeout, not rejected
    c.expect_nothing(0.3)


# -- CLS -----------------------------------------------------------------------------------
def test_cls_then_fin_still_works(any_broker: BrokerProcess, connect: Connect) -> None:
    topic = unique_name()
    c = subscribe(connect(any_broker), topic, rdy=2)
    c.pub(topic, b"a")
    msg = c.read_message()
    c.cls()
    c.fin(msg.id)
    c.rdy(5)  # ignored while closing
    c.pub(topic, b"b")  # not delivered to a closing client
    c.expect_nothing(0.3)
    c.fin(msg.id)
    c.expect_error("E_FIN_FAILED")  # the first FIN after CLS succeeded


def test_cls_before_sub_is_invalid(any_broker: BrokerProcess, connect: Connect) -> None:
    c = connect(any_broker)
    c.send(wire.cls())
    c.expect_error("E_INVALID", prefix="E_INVALID cannot CLS in current state")
