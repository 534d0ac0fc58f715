"""The topic log's record codec on both backends: exact bytes against struct.pack and
zlib, built independently of the code under test (docs/storage.md, "Records")."""

from __future__ import annotations

import struct
import zlib
from types import ModuleType

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


def record(off: int, ts: int, body: bytes, deliver_at: int = 0, attempts: int = 0) -> bytes:
    payload = struct.pack(">qqH", deliver_at, ts, attempts) + b"%016x" % off + body
    head = struct.pack(">IQ", len(payload), off)
    return struct.pack(">I", zlib.crc32(head + payload)) + head + payload


def frame(off: int, ts: int, attempts: int, body: bytes) -> bytes:
    data = struct.pack(">qH", ts, attempts) + b"%016x" % off + body
    return struct.pack(">ii", len(data) + 4, 2) + data


@pytest.mark.parametrize("backend", BACKENDS)
class TestLogCodec:
    def test_build_exact_bytes(self, backend: ModuleType) -> None:
        src = b"xxhelloworld"
        recs, pos = backend.log_build(41, 1234, 0, src, [2, 7], [5, 5])
        want = record(41, 1234, b"hello") + record(42, 1234, b"world")
        assert recs == want
        assert list(pos) == [0, len(record(41, 1234, b"hello"))]

    def test_build_deferred_and_empty(self, backend: ModuleType) -> None:
        recs, pos = backend.log_build(0, 5, 99, b"", [0], [0])
        assert recs == record(0, 5, b"", deliver_at=99) and list(pos) == [0]
        assert backend.log_build(0, 5, 0, b"", [], []) == (b"", [] if backend is _pure else pos[:0])

    def test_scan_reports_deferred_ts_and_stops(self, backend: ModuleType) -> None:
        buf = record(7, 10, b"a") + record(8, 30, b"b", deliver_at=5) + record(9, 20, b"c")
        pos, used, st = backend.log_scan(buf, 7, True, 1000, 10)
        assert list(pos) == [0, 51, 102] and used == len(buf) and st == (0, 1, 30)
        # cut short: the last record is incomplete
        pos, used, st = backend.log_scan(buf[:-3], 7, True, 1000, 10)
        assert list(pos) == [0, 51] and used == 102 and st[0] == _pure.LOG_PARTIAL
        # cap reached
        pos, used, st = backend.log_scan(buf, 7, True, 1000, 2)
        assert list(pos) == [0, 51] and st[0] == _pure.LOG_FULL
        # wrong first offset, bad checksum, impossible length
        assert backend.log_scan(buf, 6, True, 1000, 10)[2][0] == _pure.LOG_BAD_OFFSET
        bad = bytearray(buf)
        bad[51 + 40] ^= 0xFF     # inside the second record's payload
        pos, used, st = backend.log_scan(bytes(bad), 7, True, 1000, 10)
        assert list(pos) == [0] and st[0] == _pure.LOG_BAD_CRC
        pos, _, st = backend.log_scan(bytes(bad), 7, False, 1000, 10)
        assert len(pos) == 3 and st[0] == _pure.LOG_END
        assert backend.log_scan(buf, 7, True, 34, 10)[2][0] == _pure.LOG_BAD_LENGTH

    def test_frames(self, backend: ModuleType) -> None:
        buf = record(3, 11, b"one", attempts=2) + record(4, 12, b"two!")
        pos = [0, len(record(3, 11, b"one", attempts=2))]
        assert backend.log_frames(buf, pos, -1) == frame(3, 11, 3, b"one") + frame(4, 12, 1, b"two!")
        assert backend.log_frames(buf, pos[1:], 9) == frame(4, 12, 9, b"two!")
        assert backend.log_frames(buf, pos, 70000) == \
            frame(3, 11, 65535, b"one") + frame(4, 12, 65535, b"two!")
        assert backend.log_frames(buf, [], -1) == b""

    def test_frames_each(self, backend: ModuleType) -> None:
        # each record's attempts: its stored count plus its own add, in the order given
        one = record(3, 11, b"one", attempts=2)
        buf = one + record(4, 12, b"two!")
        pos = [0, len(one)]
        assert backend.log_frames_each(buf, pos, [1, 1]) == backend.log_frames(buf, pos, -1)
        assert backend.log_frames_each(buf, pos, [4, 0]) == \
            frame(3, 11, 6, b"one") + frame(4, 12, 0, b"two!")
        assert backend.log_frames_each(buf, pos[::-1], [7, 1]) == \
            frame(4, 12, 7, b"two!") + frame(3, 11, 3, b"one")
        assert backend.log_frames_each(buf, pos, [70000, 2 ** 32 - 1]) == \
            frame(3, 11, 65535, b"one") + frame(4, 12, 65535, b"two!")
        assert backend.log_frames_each(buf, [], []) == b""
        with pytest.raises(ValueError):
            backend.log_frames_each(buf, pos, [1])
