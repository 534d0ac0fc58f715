"""TCP protocol V2 on raw sockets: framing, IDENTIFY, SUB and the publishing commands,
with every error code and its fatality (consuming commands: test_raw_tcp_consume.py).

Every test runs against pybroker and, when the binary is found, a real nsqd 1.3.0, with
the same assertions: codes match exactly, texts by nsqd's prefix. Commands are encoded
with tests/support/wire.py, never with pybroker's own codec.
"""
from __future__ import annotations

import json
import socket
import struct
import time
from collections.abc import Callable

import pytest

from tests.support import wire
from tests.support.broker import BrokerProcess, unique_name
from tests.support.wire import FRAME_ERROR, FRAME_RESPONSE, WireClient, subscribe

Connect = Callable[..., WireClient]


# -- framing -------------------------------------------------------------------------------
def test_bad_magic_gets_e_bad_protocol_and_close(any_broker: BrokerProcess,
                                                 connect: Connect) -> None:
    c = connect(any_broker, magic=False)
    c.send(b"  V1")
    c.expect_error("E_BAD_PROTOCOL")


def test_magic_and_commands_split_into_single_bytes(any_broker: BrokerProcess,
                                                    connect: Connect) -> None:
    topic = unique_name()
    c = connect(any_broker, magic=False)
    data = (wire.MAGIC_V2 + wire.identify(client_id="split") + wire.pub(topic, b"hello")
            + wire.sub(topic, "ch") + wire.rdy(1))
    for i in range(len(data)):
        c.send(data[i:i + 1])
    c.expect_response(b"OK")  # IDENTIFY
    c.expect_response(b"OK")  # PUB
    c.expect_response(b"OK")  # SUB
    msg = c.read_message()
    assert (msg.body, msg.attempts) == (b"hello", 1)


def test_pipelined_commands_in_one_send(any_broker: BrokerProcess, connect: Connect) -> None:
    topic = unique_name()
    c = connect(any_broker)
    bodies = [b"m%d" % i for i in range(50)]
    c.send(b"".join(wire.pub(topic, body) for body in bodies)
           + wire.sub(topic, "ch") + wire.rdy(100))
    for _ in range(51):
        c.expect_response(b"OK")
    msgs = c.read_messages(50)
    assert sorted(m.body for m in msgs) == sorted(bodies)
    c.send(b"".join(wire.fin(m.id) for m in msgs) + wire.nop())
    c.assert_alive()  # no E_FIN_FAILED came back


def test_crlf_line_endings(any_broker: BrokerProcess, connect: Connect) -> None:
    topic = unique_name()
    c = connect(any_broker)
    c.send(wire.command("PUB", topic, body=b"crlf", eol=b"\r\n"))
    c.expect_response(b"OK")
    c.send(wire.command("SUB", topic, "ch", eol=b"\r\n") + wire.command("RDY", 1, eol=b"\r\n"))
    c.expect_response(b"OK")
    msg = c.read_message()
    assert msg.body == b"crlf"
    c.send(wire.command("FIN", msg.id, eol=b"\r\n"))
    c.assert_alive()


@pytest.mark.parametrize("line, text", [
    (b"FOO\n", b"E_INVALID invalid command FOO"),
    (b"pub t\n", b"E_INVALID invalid command pub"),
    (b"\n", b"E_INVALID invalid command "),
])
def test_unknown_command_is_fatal(any_broker: BrokerProcess, connect: Connect,
                                  line: bytes, text: bytes) -> None:
    c = connect(any_broker)
    c.send(line)
    assert c.expect_error("E_INVALID") == text


def test_overlong_command_line_closes(any_broker: BrokerProcess, connect: Connect) -> None:
    """A line longer than any buffer closes the connection. nsqd closes without a frame
    (its line reader fails); an E_INVALID frame before the close is tolerated."""
    c = connect(any_broker)
    c.send(b"X" * 70_000)
    try:
        ftype, data = c.read_frame()
    except wire.ConnectionClosed:
        return
    assert ftype == FRAME_ERROR and data.startswith(b"E_INVALID"), (ftype, data)
    c.assert_closed()


def test_commands_after_a_fatal_error_are_not_executed(any_broker: BrokerProcess,
                                                       connect: Connect) -> None:
    topic = unique_name()
    consumer = subscribe(connect(any_broker), topic, rdy=5)
    c = connect(any_broker)
    c.send(wire.pub(topic, b"before") + b"FOO\n" + wire.pub(topic, b"after fatal"))
    c.expect_response(b"OK")
    c.expect_error("E_INVALID", prefix="E_INVALID invalid command FOO")
    connect(any_broker).pub(topic, b"marker")
    assert [m.body for m in consumer.read_messages(2)] == [b"before", b"marker"]
    consumer.expect_nothing(0.2)


def test_nop_has_no_response(any_broker: BrokerProcess, connect: Connect) -> None:
    c = connect(any_broker)
    c.send(wire.nop() + wire.nop())
    c.assert_alive()  # the first frame after the NOPs is the PUB's OK


# -- IDENTIFY ------------------------------------------------------------------------------
def test_identify_plain_ok_ignores_unknown_fields(any_broker: BrokerProcess,
                                                  connect: Connect) -> None:
    c = connect(any_broker)
    assert c.identify(client_id="c1", hostname="h", user_agent="wire/1.0", short_id="s",
                      long_id="l", some_future_field=[1, 2]) is None
    c.assert_alive()


NEGOTIATED_TYPES = {
    "max_rdy_count": int, "version": str, "max_msg_timeout": int, "msg_timeout": int,
    "tls_v1": bool, "deflate": bool, "deflate_level": int, "max_deflate_level": int,
    "snappy": bool, "sample_rate": int, "auth_required": bool, "output_buffer_size": int,
    "output_buffer_timeout": int,
}


def test_identify_feature_negotiation_defaults(any_broker: BrokerProcess,
                                               connect: Connect) -> None:
    data = connect(any_broker).identify(feature_negotiation=True)
    assert data is not None
    assert set(data) == set(NEGOTIATED_TYPES)
    for key, typ in NEGOTIATED_TYPES.items():
        assert type(data[key]) is typ, (key, data[key])
    assert data["version"].split(".")[0].isdigit()
    assert {k: v for k, v in data.items() if k != "version"} == {
        "max_rdy_count": 2500, "max_msg_timeout": 900000, "msg_timeout": 60000,
        "tls_v1": False, "deflate": False, "deflate_level": 6, "max_deflate_level": 6,
        "snappy": False, "sample_rate": 0, "auth_required": False,
        "output_buffer_size": 16384, "output_buffer_timeout": 250}


def test_identify_feature_negotiation_reflects_fields(any_broker: BrokerProcess,
                                                      connect: Connect) -> None:
    c = connect(any_broker)
    data = c.identify(feature_negotiation=True, heartbeat_interval=5000,
                      output_buffer_size=1024, output_buffer_timeout=100, sample_rate=50,
                      msg_timeout=5000)
    assert data is not None
    assert (data["output_buffer_size"], data["output_buffer_timeout"],
            data["sample_rate"], data["msg_timeout"]) == (1024, 100, 50, 5000)
    c.assert_alive()  # nothing follows the JSON when no upgrade was granted


def test_identify_tls_snappy_deflate_not_granted(make_any_broker: Callable[..., BrokerProcess],
                                                 connect: Connect) -> None:
    """Snappy and deflate disabled, no TLS certificate: nothing is granted (the granted
    upgrades are in test_tls_raw.py)."""
    b = make_any_broker("--deflate=false", "--snappy=false")
    asks: list[dict[str, object]] = [{"tls_v1": True}, {"snappy": True},
                                     {"deflate": True, "deflate_level": 3},
                                     {"snappy": True, "deflate": True}]
    for ask in asks:
        c = connect(b)
        data = c.identify(feature_negotiation=True, **ask)
        assert data is not None
        assert (data["tls_v1"], data["snappy"], data["deflate"]) == (False, False, False)
        assert data["deflate_level"] == 6
        c.assert_alive()  # still plaintext, no upgrade "OK" frame pending


@pytest.mark.parametrize("field, value, text", [
    ("heartbeat_interval", 999, "heartbeat interval (999) is invalid"),
    ("heartbeat_interval", 60001, "heartbeat interval (60001) is invalid"),
    ("heartbeat_interval", -2, "heartbeat interval (-2) is invalid"),
    ("output_buffer_size", 63, "output buffer size (63) is invalid"),
    ("output_buffer_size", 65537, "output buffer size (65537) is invalid"),
    ("output_buffer_timeout", 24, "output buffer timeout (24) is invalid"),
    ("output_buffer_timeout", 30001, "output buffer timeout (30001) is invalid"),
    ("sample_rate", -1, "sample rate (-1) is invalid"),
    ("sample_rate", 100, "sample rate (100) is invalid"),
    ("msg_timeout", 999, "msg timeout (999) is invalid"),
    ("msg_timeout", 900001, "msg timeout (900001) is invalid"),
])
def test_identify_field_out_of_range(any_broker: BrokerProcess, connect: Connect,
                                     field: str, value: int, text: str) -> None:
    c = connect(any_broker)
    c.send(wire.identify(**{field: value}))
    c.expect_error("E_BAD_BODY", prefix=f"E_BAD_BODY IDENTIFY {text}")


@pytest.mark.parametrize("fields", [
    {"heartbeat_interval": 1000}, {"heartbeat_interval": 60000}, {"heartbeat_interval": -1},
    {"output_buffer_size": 64}, {"output_buffer_size": 65536}, {"output_buffer_size": -1},
    {"output_buffer_timeout": 25}, {"output_buffer_timeout": 30000},
    {"output_buffer_timeout": -1}, {"sample_rate": 99}, {"msg_timeout": 1000},
    {"msg_timeout": 900000},
])
def test_identify_field_range_limits_accepted(any_broker: BrokerProcess, connect: Connect,
                                              fields: dict[str, int]) -> None:
    c = connect(any_broker)
    c.identify(**fields)
    c.assert_alive()


@pytest.mark.parametrize("fields, expected", [
    ({"output_buffer_size": -1}, (1, 0)),  # unbuffered: every write goes out at once
    ({"output_buffer_timeout": -1}, (16384, 0)),
    ({"output_buffer_size": -1, "output_buffer_timeout": 100}, (1, 0)),
    ({"output_buffer_size": 0, "output_buffer_timeout": 0, "msg_timeout": 0}, (16384, 250)),
])
def test_identify_output_buffer_special_values(any_broker: BrokerProcess, connect: Connect,
                                               fields: dict[str, int],
                                               expected: tuple[int, int]) -> None:
    data = connect(any_broker).identify(feature_negotiation=True, **fields)
    assert data is not None
    assert (data["output_buffer_size"], data["output_buffer_timeout"]) == expected
    assert data["msg_timeout"] == 60000


DECODE_FAILED = "E_BAD_BODY IDENTIFY failed to decode JSON body"


# nsqd decodes IDENTIFY into typed fields: a value of the wrong JSON type is an error.
@pytest.mark.parametrize("body, prefix", [
    (b"{not json", DECODE_FAILED),
    (b"[]", DECODE_FAILED),
    (b"{} trailing", DECODE_FAILED),
    (b'{"heartbeat_interval": "1000"}', DECODE_FAILED),
    (b'{"heartbeat_interval": 1000.0}', DECODE_FAILED),
    (b'{"heartbeat_interval": 99999999999999999999}', DECODE_FAILED),
    (b'{"sample_rate": true}', DECODE_FAILED),
    (b'{"client_id": 5}', DECODE_FAILED),
    (b'{"feature_negotiation": "yes"}', DECODE_FAILED),
    (b"", "E_BAD_BODY IDENTIFY invalid body size 0"),
])
def test_identify_bad_body(any_broker: BrokerProcess, connect: Connect, body: bytes,
                           prefix: str) -> None:
    c = connect(any_broker)
    c.send(wire.command("IDENTIFY", body=body))
    c.expect_error("E_BAD_BODY", prefix=prefix)


def test_identify_body_too_big(small_broker: BrokerProcess, connect: Connect) -> None:
    c = connect(small_broker)
    c.send(b"IDENTIFY\n" + struct.pack(">i", 4097))
    c.expect_error("E_BAD_BODY", prefix="E_BAD_BODY IDENTIFY body too big 4097 > 4096")


def test_identify_after_sub_is_invalid(any_broker: BrokerProcess, connect: Connect) -> None:
    c = subscribe(connect(any_broker), unique_name())
    c.send(wire.identify(client_id="late"))
    c.expect_error("E_INVALID", prefix="E_INVALID cannot IDENTIFY in current state")


def test_identify_twice_before_sub(any_broker: BrokerProcess, connect: Connect) -> None:
    """nsqd checks only the client state for IDENTIFY, and IDENTIFY leaves the state at
    init: a second IDENTIFY before SUB is answered OK again."""
    c = connect(any_broker)
    c.identify(client_id="first")
    c.identify(client_id="second")
    c.assert_alive()


# -- SUB -----------------------------------------------------------------------------------
BAD_NAMES = ["a*b", "x" * 65, "#ephemeral", "t#ephemeral#ephemeral", "t#other", "t:c", "ü"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_sub_bad_topic_name(any_broker: BrokerProcess, connect: Connect, name: str) -> None:
    c = connect(any_broker)
    c.send(wire.sub(name, "ch"))
    c.expect_error("E_BAD_TOPIC", prefix=f"E_BAD_TOPIC SUB topic name {json.dumps(name)}"
                   if name.isascii() else "E_BAD_TOPIC SUB topic name ")


@pytest.mark.parametrize("name", BAD_NAMES)
def test_sub_bad_channel_name(any_broker: BrokerProcess, connect: Connect, name: str) -> None:
    c = connect(any_broker)
    c.send(wire.sub(unique_name(), name))
    c.expect_error("E_BAD_CHANNEL", prefix="E_BAD_CHANNEL SUB channel name ")


def test_sub_empty_topic_is_bad_topic(any_broker: BrokerProcess, connect: Connect) -> None:
    c = connect(any_broker)
    c.send(b"SUB  ch\n")
    c.expect_error("E_BAD_TOPIC", prefix='E_BAD_TOPIC SUB topic name "" is not valid')


def test_sub_name_length_limits(any_broker: BrokerProcess, connect: Connect) -> None:
    base = unique_name("len")
    for topic, channel in [(base.ljust(64, "x"), "c" * 64),
                           (base.ljust(54, "e") + "#ephemeral", "c" * 54 + "#ephemeral")]:
        assert len(topic) == len(channel) == 64
        connect(any_broker).sub(topic, channel)
    c = connect(any_broker)
    c.send(wire.sub(base.ljust(55, "e") + "#ephemeral", "ch"))
    c.expect_error("E_BAD_TOPIC")
    c = connect(any_broker)
    c.send(wire.sub(base, "c" * 65))
    c.expect_error("E_BAD_CHANNEL")


def test_sub_ephemeral_names_ok(any_broker: BrokerProcess, connect: Connect) -> None:
    topic = unique_name() + "#ephemeral"
    c = connect(any_broker)
    c.sub(topic, "ch#ephemeral")
    c.rdy(1)
    c.pub(topic, b"eph")
    assert c.read_message().body == b"eph"


def test_sub_twice_is_invalid(any_broker: BrokerProcess, connect: Connect) -> None:
    topic = unique_name()
    c = subscribe(connect(any_broker), topic)
    c.send(wire.sub(topic, "other"))
    c.expect_error("E_INVALID", prefix="E_INVALID cannot SUB in current state")


def test_sub_with_heartbeats_disabled(any_broker: BrokerProcess, connect: Connect) -> None:
    c = connect(any_broker)
    c.identify(heartbeat_interval=-1)
    c.send(wire.sub(unique_name(), "ch"))
    c.expect_error("E_INVALID", prefix="E_INVALID cannot SUB with heartbeats disabled")


def test_sub_over_max_channel_consumers(small_broker: BrokerProcess, connect: Connect) -> None:
    topic = unique_name()
    first = subscribe(connect(small_broker), topic)
    c = connect(small_broker)
    c.send(wire.sub(topic, "ch"))
    c.expect_error("E_SUB_FAILED",
                   prefix=f"E_SUB_FAILED SUB failed consumers for {topic}:ch exceeds limit of 1")
    connect(small_broker).sub(topic, "other")  # the limit is per channel
    first.close()


@pytest.mark.parametrize("line", [b"SUB\n", b"SUB topic\n"])
def test_sub_missing_params(any_broker: BrokerProcess, connect: Connect, line: bytes) -> None:
    c = connect(any_broker)
    c.send(line)
    c.expect_error("E_INVALID", prefix="E_INVALID SUB insufficient number of parameters")


# -- PUB / MPUB / DPUB ---------------------------------------------------------------------
def test_pub_mpub_dpub_ok_and_delivered(any_broker: BrokerProcess, connect: Connect) -> None:
    topic = unique_name()
    c = connect(any_broker)
    c.pub(topic, b"one")
    c.mpub(topic, [b"two", b"three", b"\x00binary\xff"])
    c.dpub(topic, 0, b"four")  # delays are tested in test_behaviour
    s = subscribe(connect(any_broker), topic, rdy=10)
    msgs = s.read_messages(5)
    assert sorted(m.body for m in msgs) == sorted(
        [b"one", b"two", b"three", b"\x00binary\xff", b"four"])
    assert all(m.attempts == 1 for m in msgs)
    assert len({m.id for m in msgs}) == 5
    assert all(len(m.id) == 16 for m in msgs)
    now_ns = time.time_ns()
    assert all(abs(now_ns - m.ts_ns) < 60e9 for m in msgs), "timestamp is wall-clock ns"


def test_message_of_max_size_delivered_intact(any_broker: BrokerProcess,
                                              connect: Connect) -> None:
    topic = unique_name()
    body = bytes(range(256)) * 4096  # 1 MiB, nsqd's default max-msg-size
    consumer = subscribe(connect(any_broker), topic, rdy=3)
    c = connect(any_broker)
    c.pub(topic, body)
    c.mpub(topic, [body[:1000], body])
    got = consumer.read_messages(3, timeout=10)
    assert [len(m.body) for m in got] == [len(body), 1000, len(body)]
    assert got[0].body == body and got[2].body == body and got[1].body == body[:1000]


@pytest.mark.parametrize("verb", ["PUB", "MPUB", "DPUB"])
def test_pub_bad_topic(any_broker: BrokerProcess, connect: Connect, verb: str) -> None:
    c = connect(any_broker)
    params = ["a*b", "0"] if verb == "DPUB" else ["a*b"]
    body = wire.mpub_body([b"x"]) if verb == "MPUB" else b"x"
    c.send(wire.command(verb, *params, body=body))
    c.expect_error("E_BAD_TOPIC")


@pytest.mark.parametrize("line", [b"PUB\n", b"MPUB\n", b"DPUB\n", b"DPUB topic\n"])
def test_pub_missing_params(any_broker: BrokerProcess, connect: Connect, line: bytes) -> None:
    c = connect(any_broker)
    c.send(line)
    verb = line.split()[0].decode()
    c.expect_error("E_INVALID", prefix=f"E_INVALID {verb} insufficient number of parameters")


@pytest.mark.parametrize("verb, size, code, text", [
    ("PUB", 0, "E_BAD_MESSAGE", "PUB invalid message body size 0"),
    ("PUB", -1, "E_BAD_MESSAGE", "PUB invalid message body size -1"),
    ("PUB", 1025, "E_BAD_MESSAGE", "PUB message too big 1025 > 1024"),
    ("DPUB", 0, "E_BAD_MESSAGE", "DPUB invalid message body size 0"),
    ("DPUB", -5, "E_BAD_MESSAGE", "DPUB invalid message body size -5"),
    ("DPUB", 1025, "E_BAD_MESSAGE", "DPUB message too big 1025 > 1024"),
    ("MPUB", 0, "E_BAD_BODY", "MPUB invalid body size 0"),
    ("MPUB", -1, "E_BAD_BODY", "MPUB invalid body size -1"),
    ("MPUB", 4097, "E_BAD_BODY", "MPUB body too big 4097 > 4096"),
])
def test_pub_body_size_errors(small_broker: BrokerProcess, connect: Connect, verb: str, size: int,
                              code: str, text: str) -> None:
    c = connect(small_broker)
    params = [unique_name(), "10"] if verb == "DPUB" else [unique_name()]
    c.send(wire.command(verb, *params) + struct.pack(">i", size))
    c.expect_error(code, prefix=f"{code} {text}")


@pytest.mark.parametrize("parts, code, text", [
    (0, "E_BAD_BODY", "MPUB invalid message count 0"),
    (-1, "E_BAD_BODY", "MPUB invalid message count -1"),
    (819, "E_BAD_BODY", "MPUB invalid message count 819"),  # > (4096 - 4) / 5
    ([b"ok", b"x" * 1025], "E_BAD_MESSAGE", "MPUB message too big 1025 > 1024"),
    ([b"ok", b""], "E_BAD_MESSAGE", "MPUB invalid message(1) body size 0"),
])
def test_mpub_bad_parts_are_atomic(small_broker: BrokerProcess, connect: Connect,
                                   parts: int | list[bytes], code: str, text: str) -> None:
    topic = unique_name()
    consumer = subscribe(connect(small_broker), topic, rdy=10)
    if isinstance(parts, int):
        body = struct.pack(">i", parts)
    else:
        body = wire.mpub_body(parts)
    c = connect(small_broker)
    c.send(wire.command("MPUB", topic, body=body))
    c.expect_error(code, prefix=f"{code} {text}")
    connect(small_broker).pub(topic, b"marker")
    assert consumer.read_message().body == b"marker", "a rejected MPUB delivered a part"
    consumer.expect_nothing(0.2)


# A body whose size ends before its messages do: nsqd reads on past the size, into
# whatever follows (its answer depends on those bytes: the fuzz test found it answering
# E_BAD_MESSAGE); pybroker frames the body by its size and says the two disagree.
@pytest.mark.parametrize("body, where", [
    (b"\x00\x00\x00", "its 3 bytes end inside the message count"),
    (struct.pack(">i", 2) + struct.pack(">i", 1) + b"a" + b"\x00\x00",
     "its 11 bytes end inside message(1)'s size"),
    (struct.pack(">i", 1) + struct.pack(">i", 5) + b"abc",
     "its 11 bytes end inside message(0)'s body"),
])
def test_mpub_body_ending_inside_its_messages(broker: BrokerProcess, connect: Connect,
                                              body: bytes, where: str) -> None:
    topic = unique_name()
    consumer = subscribe(connect(broker), topic, rdy=10)
    c = connect(broker)
    c.send(wire.command("MPUB", topic, body=body) + wire.command("NOP"))
    c.expect_error("E_BAD_BODY",
                   prefix=f"E_BAD_BODY MPUB body size does not match its messages ({where})")
    connect(broker).pub(topic, b"marker")
    assert consumer.read_message().body == b"marker", "a rejected MPUB delivered a part"


# nsqd's error texts byte for byte where they echo what the client sent: names quoted
# as Go's %q (bytes that are not UTF-8 as \xNN, control characters escaped), other
# values echoed raw, and MPUB's text repeating its code (nsqd's own quirk)
@pytest.mark.parametrize("sent, text", [
    (b"\xb6\xb6z\xc0;REQ\n", b"E_INVALID invalid command \xb6\xb6z\xc0;REQ"),
    (b"DPUB t \tr\x08\xa9\x8b\n\x00\x00\x00\x01x",
     b"E_INVALID DPUB could not parse timeout \tr\x08\xa9\x8b"),
    (b"MPUB \xff\xfe\n", b'E_BAD_TOPIC E_BAD_TOPIC MPUB topic name "\\xff\\xfe" is not valid'),
    (b"PUB a\x15\xc3\xbc\xc2\xa0\n", b'E_BAD_TOPIC PUB topic name "a\\x15\xc3\xbc\\u00a0" '
                                     b"is not valid"),
    (b'SUB ok a"b\\c\n', b'E_BAD_CHANNEL SUB channel name "a\\"b\\\\c" is not valid'),
])
def test_error_texts_echo_what_was_sent_as_nsqd(any_broker: BrokerProcess, connect: Connect,
                                               sent: bytes, text: bytes) -> None:
    c = connect(any_broker)
    c.send(sent)
    assert c.expect_error(text.split(b" ", 1)[0]) == text


@pytest.mark.parametrize("verb, mid", [
    (b"FIN", b"\xff" * 16), (b"REQ", b"0123456789abcd\xc3\xa9"), (b"TOUCH", b"\x01" * 16),
])
def test_id_failures_echo_the_id_as_sent(any_broker: BrokerProcess, connect: Connect,
                                          verb: bytes, mid: bytes) -> None:
    # nsqd's "FIN %s failed %s" prints the 16 id bytes as they came
    c = subscribe(connect(any_broker), unique_name(), rdy=0)
    c.send(verb + b" " + mid + (b" 0" if verb == b"REQ" else b"") + b"\n")
    got = c.expect_error(b"E_" + verb + b"_FAILED")
    assert got.startswith(b"E_" + verb + b"_FAILED " + verb + b" " + mid + b" failed "), got


def test_mpub_body_longer_than_its_messages_then_the_stream_ends(
        broker: BrokerProcess, connect: Connect) -> None:
    # nsqd takes the messages (OK) and reads what follows as the next command; pybroker
    # waits for the size it was told, and when the stream ends says the two disagree
    c = connect(broker)
    messages = wire.mpub_body([b"a", b"bc"])
    c.send(wire.command("MPUB", unique_name()) + struct.pack(">i", len(messages) + 6)
           + messages)
    c.sock.shutdown(socket.SHUT_WR)
    c.expect_error("E_BAD_BODY", prefix="E_BAD_BODY MPUB body size does not match its "
                   f"messages (they end after {len(messages)} of its {len(messages) + 6} "
                   "bytes)")


@pytest.mark.parametrize("delay, text", [
    ("10001", "E_INVALID DPUB timeout 10001 out of range 0-10000"),
    ("-1", "E_INVALID DPUB could not parse timeout -1"),
    ("soon", "E_INVALID DPUB could not parse timeout soon"),
])
def test_dpub_timeout_out_of_range(small_broker: BrokerProcess, connect: Connect, delay: str,
                                   text: str) -> None:
    c = connect(small_broker)
    c.send(wire.command("DPUB", unique_name(), delay, body=b"x"))
    c.expect_error("E_INVALID", prefix=text)


def test_dpub_at_max_req_timeout_ok(small_broker: BrokerProcess, connect: Connect) -> None:
    connect(small_broker).dpub(unique_name(), 10000, b"later")


def test_frames_are_well_formed(any_broker: BrokerProcess) -> None:
    """Raw frame layout: size counts the type field; errors are type 1, replies type 0."""
    with any_broker.connect() as sock:
        sock.sendall(wire.MAGIC_V2 + wire.nop() + wire.pub(unique_name(), b"x") + b"BAD\n")
        sock.settimeout(5)
        data = b""
        while len(data) < 10 + 8 + len(b"E_INVALID invalid command BAD"):
            chunk = sock.recv(4096)
            assert chunk, f"closed early after {data!r}"
            data += chunk
        assert data == (wire.encode_frame(FRAME_RESPONSE, b"OK")
                        + wire.encode_frame(FRAME_ERROR, b"E_INVALID invalid command BAD"))
