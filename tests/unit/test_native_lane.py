"""The publish lane's scan (csrc/nsqframe.h nsqf_pub_lane): the C code agrees with the
pure-Python spec, and whatever it calls FAST is exactly what the general decoder would
have run as valid PUB/MPUB commands to one topic, with the same messages."""

from __future__ import annotations

import array
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pybroker import _native
from pybroker._native import _pure
from pybroker.core.flight import offset_of
from pybroker.errors import ClientError
from pybroker.protocol.decoder import CommandDecoder

MAX_LINE, MAX_MSG, MAX_BODY = 64, 40, 120
MAX_COUNT = (MAX_BODY - 4) // 5
F = _pure.LANE_FIELDS
SETTINGS = settings(max_examples=300, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def pub(topic: bytes, body: bytes, size: int | None = None) -> bytes:
    return b"PUB " + topic + b"\n" + struct.pack(">i", len(body) if size is None else size) + body


def mpub(topic: bytes, bodies: list[bytes], count: int | None = None) -> bytes:
    body = struct.pack(">i", len(bodies) if count is None else count)
    body += b"".join(struct.pack(">i", len(b)) + b for b in bodies)
    return b"MPUB " + topic + b"\n" + struct.pack(">i", len(body)) + body


def lay_out(chunks: list[bytes]) -> tuple[bytearray, array.array[int], array.array[int]]:
    buf = bytearray()
    starts, lens = array.array("I"), array.array("I")
    for c in chunks:
        starts.append(len(buf))
        lens.append(len(c))
        buf += c
    return buf, starts, lens


def c_scan(chunks: list[bytes], cap: int = 1024) -> tuple[list[int], list[bytes]]:
    buf, starts, lens = lay_out(chunks)
    lane = _native.PubLane(MAX_LINE, MAX_MSG, MAX_BODY, cap)
    res, offs, plens, n = lane.scan(buf, starts, lens, len(chunks))
    return list(res[:F * len(chunks)]), [bytes(buf[offs[i]:offs[i] + plens[i]])
                                         for i in range(n)]


def pure_scan(chunks: list[bytes], cap: int = 1024) -> tuple[list[int], list[bytes]]:
    buf, starts, lens = lay_out(chunks)
    res, offs, plens, n = _pure.pub_lane(buf, starts, lens, len(chunks), MAX_LINE, MAX_MSG,
                                         MAX_BODY, MAX_COUNT, cap)
    return res, [bytes(buf[o:o + ln]) for o, ln in zip(offs, plens)]


def general(data: bytes) -> tuple[bytes, int, list[bytes]] | None:
    """What the general path makes of one connection's bytes, when it is nothing but
    complete valid PUB/MPUB commands to one topic: (topic, commands, messages)."""
    d = CommandDecoder(MAX_MSG, MAX_BODY, MAX_LINE)
    d.receive(data)
    topics, msgs, cmds = set(), [], 0
    while True:
        try:
            cmd = d.next_command()
        except ClientError:
            return None
        if cmd is None:
            break
        if cmd.pending or cmd.body_error is not None or cmd.body is None:
            return None
        if len(cmd.params) != 2 or cmd.params[0] not in (b"PUB", b"MPUB"):
            return None
        topics.add(cmd.params[1])
        if cmd.params[0] == b"PUB":
            msgs.append(cmd.body)
        else:
            try:
                offs, lens = _native.mpub_parts(cmd.body, MAX_MSG, MAX_COUNT)
            except _native.ScanError:
                return None
            msgs += [cmd.body[o:o + ln] for o, ln in zip(offs, lens)]
        cmds += 1
    if d.buffered() or len(topics) != 1 or not cmds:
        return None
    return topics.pop(), cmds, msgs


def test_the_cases_by_hand() -> None:
    chunks = [pub(b"t", b"hello"),
              pub(b"t", b"a") + mpub(b"t", [b"x", b"yy"]),   # two commands, one topic
              b"NOP\n",                                      # another verb
              pub(b"t", b"abc")[:-1],                        # incomplete
              pub(b"a", b"1") + pub(b"b", b"2"),             # two topics
              mpub(b"zz", [b"q"]),
              b"PUB t\r\n" + struct.pack(">i", 1) + b"x",    # a '\r': the general path
              pub(b"t", b"", 0),                             # size 0: an error to answer
              pub(b"t", b"x" * (MAX_MSG + 1)),               # too big
              mpub(b"t", [b"x"], count=2),                   # count and parts disagree
              b"PUB t extra\n" + struct.pack(">i", 1) + b"x"]
    res, msgs = pure_scan(chunks)
    status = res[0::F]
    assert status == [0, 0, 1, 1, 1, 0, 1, 1, 1, 1, 1]
    assert res[3:5] == [1, 1] and res[F + 3:F + 5] == [2, 3]
    assert res[5 * F + 3:5 * F + 5] == [1, 1 | 1 << 31]      # first command MPUB: flagged
    # the same topic as an earlier FAST connection: its index; a new name: its own
    assert [res[F * i + 5] for i in (0, 1, 5)] == [0, 0, 5]
    assert msgs == [b"hello", b"a", b"x", b"yy", b"q"]
    if _native.c_backend is not None and _native.BACKEND == "c":
        assert c_scan(chunks) == (res, msgs)


def test_parts_past_the_capacity_send_the_connection_the_general_way() -> None:
    chunks = [mpub(b"t", [b"a", b"b", b"c"]), pub(b"t", b"d")]
    res, msgs = pure_scan(chunks, cap=2)
    assert res[0::F] == [1, 0] and msgs == [b"d"]


name_st = st.sampled_from([b"t", b"topic", b"a.b_c-d", b"x#ephemeral", b"", b"t t", b"t\r",
                           b"bad*name", b"t" * 70])
body_st = st.binary(max_size=MAX_MSG + 2)
command_st = st.one_of(
    st.builds(pub, name_st, body_st),
    st.builds(lambda n, b, s: pub(n, b, s), name_st, body_st, st.integers(-2, MAX_MSG + 3)),
    st.builds(mpub, name_st, st.lists(body_st, max_size=6)),
    st.builds(lambda n, bs, c: mpub(n, bs, c), name_st, st.lists(body_st, max_size=4),
              st.integers(-1, 8)),
    st.sampled_from([b"NOP\n", b"FIN 0000000000000000\n", b"RDY 1\n", b"\n"]),
    st.binary(max_size=30),
)
conn_st = st.lists(command_st, min_size=1, max_size=4).map(b"".join) | \
    st.lists(command_st, min_size=1, max_size=3).map(b"".join).flatmap(
        lambda b: st.integers(0, len(b)).map(lambda k: b[:k]))


@SETTINGS
@given(st.lists(conn_st, min_size=1, max_size=6))
def test_fast_means_exactly_what_the_general_path_would_publish(chunks: list[bytes]) -> None:
    res, msgs = pure_scan(chunks)
    at = 0
    for i, data in enumerate(chunks):
        want = general(data)
        status, name_off, name_len, cmds, flags, same = res[F * i:F * i + F]
        if status == _pure.LANE_SLOW:
            # SLOW is always safe; it must not miss the plain case with a valid name
            if (want is not None and want[0] and b"\r" not in data
                    and set(want[0]) <= _pure._LANE_NAME and len(want[0]) < MAX_LINE - 5):
                pytest.fail(f"valid publishes {data!r} sent the general way")
            continue
        assert want is not None, f"FAST for {data!r}, which the general path refuses"
        n = flags & ~(1 << 31)
        topic = bytes(bytearray(b"".join(chunks))[name_off:name_off + name_len])
        assert (topic, cmds, msgs[at:at + n]) == want
        # the first FAST connection with this topic name (itself when it is the first)
        firsts = [j for j in range(i + 1) if res[F * j] == _pure.LANE_FAST
                  and (g := general(chunks[j])) is not None and g[0] == topic]
        assert same == firsts[0]
        assert bool(flags >> 31) == data.startswith(b"MPUB ")
        at += n
    assert at == len(msgs)


@pytest.mark.skipif(_native.c_backend is None or _native.BACKEND != "c",
                    reason="C codec not built (or PYBROKER_PURE=1)")
@SETTINGS
@given(st.lists(conn_st, min_size=1, max_size=6), st.integers(1, 12))
def test_c_agrees_with_the_spec(chunks: list[bytes], cap: int) -> None:
    assert c_scan(chunks, cap) == pure_scan(chunks, cap)


# -- the FIN lane (nsqf_fin_lane): FIN and REQ lines ----------------------------------------
fin_st = st.one_of(
    st.builds(lambda v: b"FIN %016x\n" % v, st.integers(0, 2**64 - 1)),
    st.builds(lambda v, t: b"REQ %016x %s\n" % (v, t),
              st.integers(0, 2**64 - 1),
              st.one_of(st.integers(0, 10**19).map(lambda t: b"%d" % t),
                        st.sampled_from([b"007", b"", b"-1", b"1 ", b"+5", b"x"]))),
    st.sampled_from([b"FIN 000000000000000A\n", b"FIN 00000000000000 1\n", b"NOP\n",
                     b"FIN 0000000000000001", b"RDY 1\n", b"FIN 0000000000000001 \n",
                     b"REQ 000000000000000A 0\n", b"REQ 0000000000000001 0",
                     b"REQ 0000000000000001\n", b"REQ 0000000000000001 0 0\n",
                     b"REQ 0000000000000001  0\n", b"TOUCH 0000000000000001\n"]),
)
fin_conn_st = st.lists(fin_st, min_size=0, max_size=5).map(b"".join)


def fin_pure(chunks: list[bytes], cap: int) -> tuple[list[int], list[int], list[int]]:
    buf, starts, lens = lay_out(chunks)
    res, offs, ms, n = _pure.fin_lane(buf, starts, lens, len(chunks), cap)
    return list(res), list(offs[:n]), list(ms[:n])


def decoded_acks(data: bytes) -> list[tuple[int, int]] | None:
    """The general path's reading of one connection's bytes when they are nothing but
    complete FIN and REQ commands: (offset, REQ timeout or -1 for a FIN) in order."""
    d = CommandDecoder(MAX_MSG, MAX_BODY, MAX_LINE)
    d.receive(data)
    out: list[tuple[int, int]] = []
    while (cmd := d.next_command()) is not None:
        if cmd.fin_offsets is not None:
            out += [(off, -1) for off in cmd.fin_offsets]
        elif cmd.params[0] == b"REQ" and len(cmd.params) == 3:
            out.append((offset_of(cmd.params[1]), int(cmd.params[2])))
        else:
            return None
    return None if d.buffered() else out


def test_fin_lane_by_hand() -> None:
    fin, req = b"FIN %016x\n", b"REQ %016x %s\n"
    chunks = [fin % 1 + req % (2, b"0") + fin % 3, req % (4, b"000000000000000250"),
              req % (5, b"1000000000000000000"), req % (2**63, b"0"),
              req % (6, b"-1"), b"REQ 000000000000000A 0\n", b""]
    res, offs, ms = fin_pure(chunks, 100)
    slow = _pure.FIN_LANE_SLOW
    assert res == [3, 1, slow, slow, slow, slow, slow]
    assert offs == [1, 2, 3, 4] and ms == [-1, 0, -1, 250]
    assert fin_pure(chunks[:1], 2)[0] == [slow]          # 3 lines past the room of 2


@SETTINGS
@given(st.lists(fin_conn_st, min_size=1, max_size=6), st.integers(1, 12))
def test_fin_lane_is_the_decoders_fin_and_req_lines(chunks: list[bytes], cap: int) -> None:
    """A connection the lane takes is one the decoder reads as nothing but FINs and
    REQs, with the same offsets and timeouts; one of FINs alone is always taken (within
    the room); C agrees with the spec."""
    res, offs, ms = fin_pure(chunks, cap)
    at = 0
    for data, k in zip(chunks, res):
        if k == _pure.FIN_LANE_SLOW:
            d = CommandDecoder(MAX_MSG, MAX_BODY, MAX_LINE)
            d.receive(data)
            try:
                cmd = d.next_command() if data else None
                whole_fins = (cmd is not None and cmd.fin_offsets is not None
                              and d.next_command() is None and not d.buffered())
            except ClientError:
                whole_fins = False
            assert not whole_fins or cmd is not None and at + len(cmd.fin_offsets or ()) > cap
            continue
        assert decoded_acks(data) == list(zip(offs[at:at + k], ms[at:at + k]))
        at += k
    assert at == len(offs) <= cap
    if _native.c_backend is not None and _native.BACKEND == "c":
        buf, starts, lens = lay_out(chunks)
        cres, coffs, cms, n = _native.FinLane(cap).scan(buf, starts, lens, len(chunks))
        assert (list(cres[:len(chunks)]), list(coffs[:n]), list(cms[:n])) == (res, offs, ms)
