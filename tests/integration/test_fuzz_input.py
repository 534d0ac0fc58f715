"""Random and mutated V2 input against the live server, with one and two loop threads.

Each example is one connection: the magic, a few commands drawn from the V2 verbs (and
some that are not), with names, numbers and bodies that may be valid, invalid or lie
about their size, then optionally mutated (bytes flipped, dropped, repeated, inserted).
The client sends it, half-closes, and reads to the end. Every answer must be a well
formed frame; every error must carry an nsqd error code; the server must log no
traceback, keep answering another client, and stay within a bounded RSS. A sample of
inputs is also sent to the real nsqd: the answers' frame types and error texts (code and
description, byte for byte) must be the same (but for MPUB bodies whose size disagrees
with their messages: see KNOWN_DIFFERENCE). PYBROKER_FUZZ_EXAMPLES raises the example count for a longer run.
"""
from __future__ import annotations

import json
import os
import re
import socket
import struct
import time
from collections.abc import Callable, Iterator

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.support.broker import BrokerProcess, rss_kb, unique_name
from tests.support.wire import MAGIC_V2, WireClient

EXAMPLES = int(os.environ.get("PYBROKER_FUZZ_EXAMPLES", "300"))
COMPARE_EXAMPLES = max(40, EXAMPLES // 3)
RSS_GROWTH_KB = 150 * 1024
# small limits (the same for nsqd) keep inputs that pass them small
MAX_MSG, MAX_BODY = 64, 512
LIMITS = [f"--max-msg-size={MAX_MSG}", f"--max-body-size={MAX_BODY}"]

ERROR_CODES = frozenset({
    b"E_INVALID", b"E_BAD_PROTOCOL", b"E_BAD_BODY", b"E_BAD_TOPIC", b"E_BAD_CHANNEL",
    b"E_BAD_MESSAGE", b"E_IDENTIFY_FAILED", b"E_PUB_FAILED", b"E_MPUB_FAILED",
    b"E_DPUB_FAILED", b"E_FIN_FAILED", b"E_REQ_FAILED", b"E_TOUCH_FAILED",
    b"E_SUB_FAILED", b"E_AUTH_DISABLED", b"E_AUTH_FAILED", b"E_UNAUTHORIZED"})
RESPONSES = frozenset({b"OK", b"_heartbeat_", b"CLOSE_WAIT"})
ERROR_RE = re.compile(rb"^(E_[A-Z_]+)(?: |$)")
PREFIX = unique_name("fz")

# -- the input grammar --------------------------------------------------------------------
names = st.sampled_from([f"{PREFIX}a", f"{PREFIX}b", f"{PREFIX}c#ephemeral", "ch",
                         "ch#ephemeral"]).map(str.encode)
bad_names = st.sampled_from([b"", b"a" * 65, b"bad!name", b"sp ace", b"#ephemeral",
                             b"\xff\xfe", b".", b"a..b"])
numbers = st.sampled_from([b"0", b"1", b"-1", b"2500", b"3600000", b"3600001", b"", b"x",
                           b"18446744073709551616", b"9" * 30, b"1e3", b" 1"])
ids = st.sampled_from([b"0" * 16, b"f" * 16, b"0" * 15, b"0" * 17, b"zzzzzzzzzzzzzzzz", b""])
junk = st.binary(max_size=12).map(lambda b: b.replace(b"\n", b"").replace(b" ", b""))
param = st.one_of(names, bad_names, numbers, ids, junk)
params = st.lists(param, max_size=4)

identify_keys = st.sampled_from([
    "client_id", "hostname", "heartbeat_interval", "output_buffer_size",
    "output_buffer_timeout", "feature_negotiation", "sample_rate", "msg_timeout",
    "user_agent", "long_id", "short_id", "tls_v1", "snappy", "deflate", "deflate_level"])
json_values = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64),
                        st.sampled_from([-1, 0, 1, 999, 1000, 60000, 100, 9, 10]),
                        st.text(max_size=8), st.lists(st.integers(), max_size=2))
# upgrading the stream is not fuzzed here (the bytes after it would be plain text)
UPGRADES = ("tls_v1", "snappy", "deflate")


@st.composite
def identify_body(draw: st.DrawFn) -> bytes:
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=40))
    data = draw(st.dictionaries(identify_keys, json_values, max_size=5))
    for k in UPGRADES:
        if data.get(k):
            data[k] = False
    return json.dumps(data).encode()


@st.composite
def message_body(draw: st.DrawFn) -> bytes:
    return draw(st.one_of(st.binary(max_size=20), st.just(b""),
                          st.just(b"x" * (MAX_MSG + 1))))   # past --max-msg-size


@st.composite
def mpub_body(draw: st.DrawFn) -> bytes:
    bodies = draw(st.lists(message_body(), max_size=4))
    count = draw(st.one_of(st.just(len(bodies)), st.integers(0, 5),
                           st.just(0xFFFFFFFF)))
    out = struct.pack(">I", count)
    for b in bodies:
        size = draw(st.one_of(st.just(len(b)), st.integers(0, 30), st.just(0xFFFFFFFF)))
        out += struct.pack(">I", size) + b
    return out


@st.composite
def sized(draw: st.DrawFn, body: bytes) -> bytes:
    """A size prefix that is honest, or lies (short, long, huge, negative)."""
    size = draw(st.one_of(st.just(len(body)), st.just(len(body)), st.integers(0, 64),
                          st.sampled_from([0, 0x7FFFFFFF, 0xFFFFFFFF, MAX_BODY + 1])))
    return struct.pack(">I", size) + body


@st.composite
def command(draw: st.DrawFn) -> tuple[bytes, bool]:
    """One command's bytes, and whether it asks for a stream upgrade (never here)."""
    verb = draw(st.sampled_from([b"IDENTIFY", b"SUB", b"PUB", b"MPUB", b"DPUB", b"RDY",
                                 b"FIN", b"REQ", b"TOUCH", b"NOP", b"CLS", b"AUTH",
                                 b"pub", b"PUBX", b"", b"\x00"]))
    if verb == b"SUB":
        p = draw(st.one_of(st.tuples(names, names).map(list), params))
    elif verb in (b"PUB", b"MPUB"):
        p = draw(st.one_of(names.map(lambda n: [n]), params))
    elif verb == b"DPUB":
        p = draw(st.one_of(st.tuples(names, numbers).map(list), params))
    elif verb in (b"FIN", b"TOUCH"):
        p = draw(st.one_of(ids.map(lambda i: [i]), params))
    elif verb == b"REQ":
        p = draw(st.one_of(st.tuples(ids, numbers).map(list), params))
    elif verb == b"RDY":
        p = draw(st.one_of(numbers.map(lambda n: [n]), params))
    else:
        p = draw(params)
    sep = draw(st.sampled_from([b"\n", b"\n", b"\n", b"\r\n"]))
    line = b" ".join([verb, *p]) + sep
    if verb == b"IDENTIFY":
        line += draw(sized(draw(identify_body())))
    elif verb in (b"PUB", b"DPUB"):
        line += draw(sized(draw(message_body())))
    elif verb == b"MPUB":
        line += draw(sized(draw(mpub_body())))
    elif verb == b"AUTH":
        line += draw(sized(draw(st.binary(max_size=10))))
    return line, False


@st.composite
def mutated(draw: st.DrawFn, data: bytes) -> bytes:
    buf = bytearray(data)
    for _ in range(draw(st.integers(0, 3))):
        if not buf:
            break
        i = draw(st.integers(0, len(buf) - 1))
        op = draw(st.sampled_from(["flip", "drop", "repeat", "insert", "cut"]))
        if op == "flip":
            buf[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "drop":
            del buf[i:i + draw(st.integers(1, 8))]
        elif op == "repeat":
            buf[i:i] = buf[i:i + draw(st.integers(1, 16))]
        elif op == "insert":
            buf[i:i] = draw(st.binary(min_size=1, max_size=8))
        else:
            del buf[i:]
    return bytes(buf)


@st.composite
def session(draw: st.DrawFn, mutate: bool = True) -> bytes:
    """The bytes of one connection (starting with the magic, which is never mutated)."""
    cmds = draw(st.lists(command(), min_size=1, max_size=6))
    data = b"".join(c for c, _ in cmds)
    if mutate and draw(st.booleans()):
        data = draw(mutated(data))
    return MAGIC_V2 + data


# -- running an input ---------------------------------------------------------------------
def exchange(address: tuple[str, int], data: bytes, timeout: float = 10.0) -> bytes:
    """Send data, half-close, and read everything until the server closes."""
    with socket.create_connection(address, timeout=timeout) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass    # closed after an early fatal error: what it sent is still readable
        chunks = []
        deadline = time.monotonic() + timeout
        while True:
            s.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                chunk = s.recv(1 << 20)
            except ConnectionResetError:
                break
            except TimeoutError:
                raise AssertionError(f"no close within {timeout}s after {data[:200]!r}; "
                                     f"got {b''.join(chunks)[:200]!r}") from None
            if not chunk:
                break
            chunks.append(chunk)
    return b"".join(chunks)


def frames(raw: bytes, sent: bytes) -> list[tuple[int, bytes]]:
    """Split the answer into frames, asserting each is well formed; returns
    (type, OK / the whole error text / "JSON" / "MSG") per frame."""
    out = []
    i = 0
    while i < len(raw):
        assert len(raw) - i >= 8, f"a torn frame header at the end: {raw[i:]!r} for {sent!r}"
        size, ftype = struct.unpack(">iI", raw[i:i + 8])
        assert size >= 4 and i + 4 + size <= len(raw), \
            f"bad frame size {size} in {raw[i:i + 40]!r} for {sent[:200]!r}"
        data = raw[i + 8:i + 4 + size]
        i += 4 + size
        if ftype == 0:
            if data not in RESPONSES:
                assert isinstance(json.loads(data), dict), data
                data = b"JSON"
        elif ftype == 1:
            m = ERROR_RE.match(data)
            assert m and m.group(1) in ERROR_CODES, f"not an nsqd error: {data!r} for {sent!r}"
        elif ftype == 2:
            assert len(data) >= 26, f"short message frame {data!r}"
            data = b"MSG"
        else:
            raise AssertionError(f"unknown frame type {ftype}: {data!r} for {sent!r}")
        out.append((ftype, data))
    return out


def alive(b: BrokerProcess) -> None:
    """Another client still gets a PUB round trip."""
    with WireClient.connect(b.tcp_address, timeout=5.0) as c:  # type: ignore[arg-type]
        c.pub(f"{PREFIX}probe", b"p")


# -- the tests ------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["1", "2"], ids=["1-loop", "2-loops"])
def fuzz_broker(request: pytest.FixtureRequest) -> Iterator[BrokerProcess]:
    b = BrokerProcess("pybroker", [f"--loop-threads={request.param}", *LIMITS]).start()
    try:
        yield b
    finally:
        b.stop()
        b.cleanup()
        assert "Traceback" not in b.stderr_text(), b.stderr_text()[-5000:]


FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])


def test_random_input_gets_valid_frames_only(fuzz_broker: BrokerProcess) -> None:
    b = fuzz_broker
    assert b.tcp_address is not None and b.proc is not None
    alive(b)
    rss0 = rss_kb(b.proc.pid)
    count = [0]

    @FUZZ
    @given(data=session())
    def run(data: bytes) -> None:
        frames(exchange(b.tcp_address, data), data)  # type: ignore[arg-type]
        count[0] += 1
        if count[0] % 25 == 0:
            alive(b)

    run()
    alive(b)
    assert "Traceback" not in b.stderr_text(), b.stderr_text()[-5000:]
    assert rss_kb(b.proc.pid) - rss0 < RSS_GROWTH_KB


def _comparable(fr: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
    # deliveries depend on what earlier examples published and on timing: not compared
    return [f for f in fr if f[0] != 2 and f[1] != b"_heartbeat_"]


# nsqd reads an MPUB's messages from the stream whatever its body size says (bytes left
# over are read as the next command; a size too small swallows the next command's bytes);
# pybroker frames the body by its size and refuses a body its messages do not fill
# exactly, or that ends inside them (the count, a size or a body), with this text
KNOWN_DIFFERENCE = b"body size does not match its messages"


def test_answers_match_nsqd(make_broker: Callable[..., BrokerProcess]) -> None:
    nsqd = make_broker(*LIMITS, kind="nsqd")       # first: no nsqd, no pybroker started
    ours = make_broker(*LIMITS)
    mismatches: list[str] = []

    @settings(max_examples=COMPARE_EXAMPLES, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(data=session())
    # found by this test: a 3-byte MPUB body, whose count nsqd reads from the next bytes
    @example(data=b"  V2MPUB fz_example#ephemeral  0000000000000000 \xff\xfe\r\n"
                  b"\x00\x00\x00\x03\x00\x00\x00\x04\xff\xff\xff\xff\xff\xff\xff\xff"
                  b"\x00\x00\x00\x01 \x00\x00\x00\r\x0e")
    def run(data: bytes) -> None:
        raw = exchange(ours.tcp_address, data)  # type: ignore[arg-type]
        if KNOWN_DIFFERENCE in raw:
            return
        got = _comparable(frames(raw, data))
        want = _comparable(frames(exchange(nsqd.tcp_address, data), data))  # type: ignore
        if got != want:
            mismatches.append(f"{data[:300]!r}\n  nsqd:     {want}\n  pybroker: {got}")

    run()
    assert not mismatches, f"{len(mismatches)} inputs answered differently:\n" + \
        "\n".join(mismatches[:10])


# inputs the fuzzer found answered differently from nsqd, now pinned: exact texts
CUT_SHORT = [
    b"PUB t\n\x00\x00",                                  # in the body size
    b"PUB t\n\x00\x00\x00\x05ab",                         # in the body
    b"DPUB t 10\n\x00\x00\x00\x05ab",
    b"IDENTIFY\n\x00\x00\x00",
    b"IDENTIFY\n\x00\x00\x00\x10{}",
    b"AUTH\n\x00\x00\x00\x05ab",
    b"MPUB t\n\x00\x00",
    b"MPUB t\n\x00\x00\x00\x20\x00\x00",                   # in the count
    b"MPUB t\n\x00\x00\x00\x20\x00\x00\x00\x00",           # a count nsqd refuses
    b"MPUB t\n\x00\x00\x00\x20\x00\x00\x00\x02\x00\x00\x00\x01a",   # in part 1's size
    b"MPUB t\n\x00\x00\x00\x20\x00\x00\x00\x02\x00\x00\x00\x05ab",  # in part 0
    b"PUB t",                                               # a cut line: no answer
    b"IDENTIFY\n\x00\x00\x00\x1c{\"user_ag\xe6nt\": \"x\", \"a\": 1}NOP\n",
]


@pytest.mark.parametrize("data", CUT_SHORT, ids=range(len(CUT_SHORT)))
def test_answers_pinned_against_nsqd(make_broker: Callable[..., BrokerProcess],
                                     data: bytes) -> None:
    nsqd = make_broker(*LIMITS, kind="nsqd")
    ours = make_broker(*LIMITS)
    want = exchange(nsqd.tcp_address, MAGIC_V2 + data)  # type: ignore[arg-type]
    got = exchange(ours.tcp_address, MAGIC_V2 + data)  # type: ignore[arg-type]
    frames(got, data)
    assert got == want
