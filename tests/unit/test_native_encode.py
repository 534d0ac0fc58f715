"""encode_messages on both backends: exact bytes against struct.pack, and bad fields."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pytest

from pybroker import _native
from pybroker._native import _pure

BACKENDS = [
    pytest.param(_pure, id="pure"),
    pytest.param(
        _native.c_backend,
        id="c",
        marks=pytest.mark.skipif(_native.c_backend is None, reason="C codec not built"),
    ),
]


@dataclass(slots=True)
class Msg:
    id: bytes
    body: bytes
    ts_ns: int
    attempts: int


class PlainMsg:
    def __init__(self, id: bytes, body: bytes, ts_ns: int, attempts: int) -> None:
        self.id, self.body, self.ts_ns, self.attempts = id, body, ts_ns, attempts


def frame(m: Any) -> bytes:
    """A message frame, built independently of the code under test."""
    data = struct.pack(">qH", m.ts_ns, m.attempts) + m.id + m.body
    return struct.pack(">ii", len(data) + 4, 2) + data


def mid(i: int) -> bytes:
    return b"%016x" % i


@pytest.mark.parametrize("backend", BACKENDS)
class TestEncode:
    def test_empty_batch(self, backend: ModuleType) -> None:
        assert backend.encode_messages([]) == b""

    def test_one(self, backend: ModuleType) -> None:
        m = Msg(b"0123456789abcdef", b"hello", 1_700_000_000_123_456_789, 1)
        got = backend.encode_messages([m])
        assert type(got) is bytes
        assert got == (b"\x00\x00\x00\x23" b"\x00\x00\x00\x02"
                       + struct.pack(">q", 1_700_000_000_123_456_789)
                       + b"\x00\x01" b"0123456789abcdef" b"hello")

    def test_batch(self, backend: ModuleType) -> None:
        msgs = [Msg(mid(i), bytes(range(i % 256)) * (i % 3), i * 1_000_003, i) for i in range(300)]
        assert backend.encode_messages(msgs) == b"".join(map(frame, msgs))

    def test_plain_objects_tuple_input(self, backend: ModuleType) -> None:
        msgs = (PlainMsg(mid(1), b"a", 1, 2), PlainMsg(mid(2), b"bb", 3, 4))
        assert backend.encode_messages(msgs) == frame(msgs[0]) + frame(msgs[1])

    def test_empty_body(self, backend: ModuleType) -> None:
        m = Msg(mid(7), b"", 5, 0)
        assert backend.encode_messages([m]) == frame(m)
        assert len(frame(m)) == 34

    @pytest.mark.parametrize("ts_ns", [0, -1, 2**63 - 1, -(2**63)])
    @pytest.mark.parametrize("attempts", [0, 1, 65535])
    def test_field_extremes(self, backend: ModuleType, ts_ns: int, attempts: int) -> None:
        m = Msg(b"\xff" * 16, b"\x00\xff", ts_ns, attempts)
        assert backend.encode_messages([m, m]) == frame(m) * 2

    def test_large_body(self, backend: ModuleType) -> None:
        m = Msg(mid(9), b"z" * (1 << 20), 1, 1)
        assert backend.encode_messages([m]) == frame(m)

    @pytest.mark.parametrize("ids", [[b"short"], [mid(1)[:15], mid(2) + b"x"],
                                     [mid(1), b""], [mid(1) + b"x"]])
    def test_bad_id(self, backend: ModuleType, ids: list[bytes]) -> None:
        msgs = [Msg(i, b"body", 1, 1) for i in ids]
        with pytest.raises(ValueError):
            backend.encode_messages(msgs)

    @pytest.mark.parametrize("attempts", [-1, 65536, 2**70])
    def test_bad_attempts(self, backend: ModuleType, attempts: int) -> None:
        with pytest.raises(ValueError):
            backend.encode_messages([Msg(mid(1), b"x", 1, 1), Msg(mid(2), b"x", 1, attempts)])

    @pytest.mark.parametrize("ts_ns", [2**63, -(2**63) - 1])
    def test_bad_ts(self, backend: ModuleType, ts_ns: int) -> None:
        with pytest.raises(ValueError):
            backend.encode_messages([Msg(mid(1), b"x", ts_ns, 1)])


@pytest.mark.skipif(_native.c_backend is None, reason="C codec not built")
class TestCEncodeDirect:
    """nsqf_encode_messages's own contract: capacity and frame-size errors write nothing."""

    def test_capacity(self) -> None:
        assert _native.c_backend is not None
        ffi, lib = _native.c_backend.ffi, _native.c_backend.lib
        out = bytearray(b"\xaa" * 100)
        ids = mid(1) + mid(2)
        r = lib.nsqf_encode_messages(ffi.from_buffer(out), 69, 2, [1, 2], [1, 1], ids,
                                     b"ab", [1, 1])
        assert r == _pure.E_CAPACITY
        assert out == b"\xaa" * 100
        r = lib.nsqf_encode_messages(ffi.from_buffer(out), 70, 2, [1, 2], [1, 1], ids,
                                     b"ab", [1, 1])
        assert r == 70
        assert bytes(out[:70]) == frame(Msg(mid(1), b"a", 1, 1)) + frame(Msg(mid(2), b"b", 2, 1))

    def test_frame_size(self) -> None:
        assert _native.c_backend is not None
        ffi, lib = _native.c_backend.ffi, _native.c_backend.lib
        out = bytearray(64)
        # The length check comes before any read of the (short) body buffer.
        r = lib.nsqf_encode_messages(ffi.from_buffer(out), len(out), 1, [1], [1], mid(1),
                                     b"x", [_pure.MAX_BODY + 1])
        assert r == _pure.E_FRAME_SIZE
        assert out == bytes(64)

    def test_zero_messages(self) -> None:
        assert _native.c_backend is not None
        ffi, lib = _native.c_backend.ffi, _native.c_backend.lib
        out = ffi.new("uint8_t[]", 1)
        assert lib.nsqf_encode_messages(out, 0, 0, ffi.NULL, ffi.NULL, ffi.NULL,
                                        ffi.NULL, ffi.NULL) == 0
