"""The client's sans-IO codec, config parsing and lookupd URL rules (no sockets)."""
from __future__ import annotations

import struct

import pytest

from pybroker.client import protocol as P
from pybroker.client.config import Config, parse_duration
from pybroker.client.errors import ProtocolError
from pybroker.client.lookupd import (build_lookup_url, producer_http_address,
                                     producer_tcp_address, producers_of)


def frame(ftype: int, data: bytes) -> bytes:
    return struct.pack(">ll", len(data) + 4, ftype) + data


# -- commands --------------------------------------------------------------------------
def test_command_bytes() -> None:
    assert P.sub("t", "c#ephemeral") == b"SUB t c#ephemeral\n"
    assert P.pub("t", b"hi") == b"PUB t\n\x00\x00\x00\x02hi"
    assert P.dpub("t", 1500, b"x") == b"DPUB t 1500\n\x00\x00\x00\x01x"
    assert P.rdy(25) == b"RDY 25\n"
    assert P.fin(b"0123456789abcdef") == b"FIN 0123456789abcdef\n"
    assert P.req(b"0123456789abcdef", 0) == b"REQ 0123456789abcdef 0\n"
    assert P.touch(b"0123456789abcdef") == b"TOUCH 0123456789abcdef\n"
    assert P.cls() == b"CLS\n" and P.nop() == b"NOP\n"
    assert P.auth("s3cret") == b"AUTH\n\x00\x00\x00\x06s3cret"
    assert P.identify({"a": 1}) == b'IDENTIFY\n\x00\x00\x00\x07{"a":1}'


def test_mpub_body_layout() -> None:
    cmd = P.mpub("t", [b"a", b"bc"])
    body = struct.pack(">l", 2) + struct.pack(">l", 1) + b"a" + struct.pack(">l", 2) + b"bc"
    assert cmd == b"MPUB t\n" + struct.pack(">l", len(body)) + body


@pytest.mark.parametrize("name,ok", [("t", True), ("a.b-c_d", True), ("x#ephemeral", True),
                                     ("a" * 64, True), ("a" * 65, False), ("", False),
                                     ("bad$", False), ("two words", False), ("#ephemeral", False)])
def test_name_rule(name: str, ok: bool) -> None:
    assert P.is_valid_topic_name(name) is ok


# -- frames ----------------------------------------------------------------------------
def test_frame_reader_whole_and_byte_by_byte() -> None:
    msg = struct.pack(">qH", 123456789, 3) + b"0123456789abcdef" + b"body"
    stream = frame(0, b"OK") + frame(0, P.HEARTBEAT) + frame(2, msg) + frame(1, b"E_X bad")
    want = [(P.FrameType.RESPONSE, b"OK"), (P.FrameType.RESPONSE, P.HEARTBEAT),
            (P.FrameType.MESSAGE, msg), (P.FrameType.ERROR, b"E_X bad")]
    whole = P.FrameReader()
    whole.feed(stream)
    got = []
    while (f := whole.next_frame()) is not None:
        got.append(f)
    assert got == want and whole.pending() == 0
    slow = P.FrameReader()
    got = []
    for i in range(len(stream)):
        slow.feed(stream[i:i + 1])
        while (f := slow.next_frame()) is not None:
            got.append(f)
    assert got == want
    raw = P.decode_message(msg)
    assert (raw.timestamp, raw.attempts, raw.id, raw.body) == (123456789, 3,
                                                                b"0123456789abcdef", b"body")


def test_frame_reader_rejects_garbage() -> None:
    r = P.FrameReader(max_frame_size=100)
    r.feed(struct.pack(">ll", 3, 0))
    with pytest.raises(P.FrameError):
        r.next_frame()
    r = P.FrameReader(max_frame_size=100)
    r.feed(struct.pack(">ll", 1000, 0))
    with pytest.raises(P.FrameError):
        r.next_frame()
    r = P.FrameReader()
    r.feed(frame(7, b"x"))
    with pytest.raises(P.FrameError):
        r.next_frame()
    with pytest.raises(P.FrameError):
        P.decode_message(b"short")


def test_protocol_error_fields() -> None:
    e = ProtocolError(b"E_FIN_FAILED FIN 123 failed ID not in flight")
    assert e.code == "E_FIN_FAILED" and not e.is_fatal
    assert e.description.startswith("FIN 123")
    assert ProtocolError(b"E_BAD_TOPIC x").is_fatal


# -- config ----------------------------------------------------------------------------
@pytest.mark.parametrize("text,seconds", [("0", 0.0), ("1s", 1.0), ("250ms", 0.25),
                                          ("1m30s", 90.0), ("1.5h", 5400.0), ("-1s", -1.0),
                                          ("100us", 1e-4), ("2m", 120.0)])
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "1", "s", "1x", "1s2"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)


def test_config_set_like_go_nsq_config_flag() -> None:
    c = Config()
    c.set_flag("max_in_flight,100")
    c.set_flag("msg_timeout,5s")
    c.set("lookupd-poll-interval", "250ms")
    c.set("backoff_multiplier", "0.5")
    c.set("client_id", "abc")
    assert (c.max_in_flight, c.msg_timeout, c.lookupd_poll_interval) == (100, 5.0, 0.25)
    assert c.backoff_multiplier == 0.5 and c.client_id == "abc"
    with pytest.raises(ValueError):
        c.set("no_such_option", "1")
    with pytest.raises(ValueError):
        Config(max_attempts=70000).validate()
    assert Config(backoff_multiplier=0.1).backoff_duration(3) == pytest.approx(0.8)
    jitter = Config(backoff_strategy="full_jitter", backoff_multiplier=1.0)
    assert all(0 <= jitter.backoff_duration(2) < 4 for _ in range(50))


# -- lookupd ---------------------------------------------------------------------------
def test_build_lookup_url() -> None:
    assert build_lookup_url("127.0.0.1:4161", "t") == "http://127.0.0.1:4161/lookup?topic=t"
    assert build_lookup_url("http://h:1/", "t") == "http://h:1/lookup?topic=t"
    assert build_lookup_url("https://h:1/custom?x=1", "a.b") == \
        "https://h:1/custom?x=1&topic=a.b"
    with pytest.raises(ValueError):
        build_lookup_url("localhost", "t")


def test_producer_addresses() -> None:
    p = {"broadcast_address": "::1", "tcp_port": 4150, "http_port": 4151}
    assert producer_tcp_address(p) == "[::1]:4150"
    assert producer_http_address(dict(p, broadcast_address="h")) == "h:4151"
    assert producer_tcp_address(dict(p, tcp_port="4150")) == "[::1]:4150"


@pytest.mark.parametrize("p", [
    {}, {"broadcast_address": "h"}, {"tcp_port": 4150},
    {"broadcast_address": "", "tcp_port": 4150},
    {"broadcast_address": ["h"], "tcp_port": 4150},
    {"broadcast_address": "h", "tcp_port": None},
    {"broadcast_address": "h", "tcp_port": "x" * 10_000},
    {"broadcast_address": "h", "tcp_port": 4.5e300},
    {"broadcast_address": "h", "tcp_port": 0}, {"broadcast_address": "h", "tcp_port": 65536},
    {"broadcast_address": "h", "tcp_port": 10 ** 400},
])
def test_bad_producer_is_a_value_error(p: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="^producer ") as e:
        producer_tcp_address(p)
    assert len(str(e.value)) < 300, "the error quotes a bounded part of the input"


def test_producers_of_a_lookup_answer() -> None:
    one = {"broadcast_address": "h", "tcp_port": 1, "http_port": 2}
    assert producers_of({"channels": [], "producers": [one]}) == [one]
    assert producers_of({"producers": None}) == [] == producers_of({})
    for bad in ([one], "producers", None, {"producers": {"a": 1}}, {"producers": [1]}):
        with pytest.raises(ValueError):
            producers_of(bad)


def test_identify_fields_and_response() -> None:
    fields = Config(heartbeat_interval=-1, output_buffer_timeout=0.1, msg_timeout=5.5,
                    client_id="cid", user_agent="ua/1").identify_fields()
    assert fields["heartbeat_interval"] == -1 and fields["output_buffer_timeout"] == 100
    assert fields["msg_timeout"] == 5500 and fields["feature_negotiation"] is True
    assert (fields["client_id"], fields["user_agent"]) == ("cid", "ua/1")
    resp = P.parse_identify_response(b'{"max_rdy_count":100,"msg_timeout":2000,'
                                     b'"auth_required":true,"version":"1.3.0"}')
    assert (resp.max_rdy_count, resp.msg_timeout_ms, resp.auth_required, resp.version) == \
        (100, 2000, True, "1.3.0")
    assert P.parse_identify_response(b"OK").max_rdy_count == 2500
    with pytest.raises(ValueError):
        P.parse_identify_response(b"{nope")
