"""mpub_split on both backends: nsqd's check order, error index/value, input types."""

from __future__ import annotations

import struct
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

MAX_MSG = 10
MAX_COUNT = 5


def i32(n: int) -> bytes:
    return struct.pack(">i", n)


def mpub_body(parts: list[bytes], count: int | None = None) -> bytes:
    head = i32(len(parts) if count is None else count)
    return head + b"".join(i32(len(p)) + p for p in parts)


def split_error(backend: Any, body: bytes, max_msg: int = MAX_MSG,
                max_count: int = MAX_COUNT) -> tuple[int, int, int]:
    with pytest.raises(backend.ScanError) as info:
        backend.mpub_split(body, max_msg, max_count)
    err = info.value
    assert isinstance(err, _native.ScanError)
    return err.code, err.index, err.value


@pytest.mark.parametrize("backend", BACKENDS)
class TestSplit:
    @pytest.mark.parametrize("kind", [bytes, bytearray, memoryview])
    def test_valid(self, backend: ModuleType, kind: Any) -> None:
        parts = [b"a", b"bb", b"\x00" * 10, b"\n\r\n"]
        got = backend.mpub_split(kind(mpub_body(parts)), MAX_MSG, MAX_COUNT)
        assert got == parts
        assert all(type(p) is bytes for p in got)

    def test_single_part(self, backend: ModuleType) -> None:
        assert backend.mpub_split(mpub_body([b"x"]), 1, 1) == [b"x"]

    def test_count_at_limit(self, backend: ModuleType) -> None:
        parts = [b"%d" % i for i in range(MAX_COUNT)]
        assert backend.mpub_split(mpub_body(parts), MAX_MSG, MAX_COUNT) == parts

    def test_nsqd_count_limit(self, backend: ModuleType) -> None:
        max_body = 5 * 1024 * 1024
        max_count = (max_body - 4) // 5
        body = mpub_body([b"x"] * 1000)
        assert len(backend.mpub_split(body, 1024 * 1024, max_count)) == 1000

    @pytest.mark.parametrize("body", [b"", b"\x00", b"\x00\x00\x00"])
    def test_count_read(self, backend: ModuleType, body: bytes) -> None:
        assert split_error(backend, body) == (_pure.E_MPUB_COUNT_READ, 0, 0)

    @pytest.mark.parametrize("count", [0, -1, -(2**31), MAX_COUNT + 1, 2**31 - 1])
    def test_bad_count(self, backend: ModuleType, count: int) -> None:
        body = mpub_body([b"x"], count=count)
        assert split_error(backend, body) == (_pure.E_MPUB_COUNT, 0, count)

    def test_count_checked_before_parts(self, backend: ModuleType) -> None:
        assert split_error(backend, i32(0) + b"junk") == (_pure.E_MPUB_COUNT, 0, 0)
        assert split_error(backend, i32(9)) == (_pure.E_MPUB_COUNT, 0, 9)

    @pytest.mark.parametrize("cut", [0, 1, 3])
    def test_part_header_cut(self, backend: ModuleType, cut: int) -> None:
        body = mpub_body([b"ab", b"cd"])[: 4 + 6 + cut]
        assert split_error(backend, body) == (_pure.E_MPUB_PART_READ, 1, 0)

    def test_more_count_than_parts(self, backend: ModuleType) -> None:
        body = mpub_body([b"ab", b"cd"], count=3)
        assert split_error(backend, body) == (_pure.E_MPUB_PART_READ, 2, 0)

    @pytest.mark.parametrize("bad", [0, -1, -(2**31)])
    def test_part_size_not_positive(self, backend: ModuleType, bad: int) -> None:
        body = i32(2) + i32(1) + b"a" + i32(bad) + b"rest"
        assert split_error(backend, body) == (_pure.E_MPUB_PART_SIZE, 1, bad)

    @pytest.mark.parametrize("bad", [MAX_MSG + 1, 2**31 - 1])
    def test_part_too_big(self, backend: ModuleType, bad: int) -> None:
        body = i32(1) + i32(bad) + b"x" * (MAX_MSG + 1)
        assert split_error(backend, body) == (_pure.E_MPUB_PART_BIG, 0, bad)

    def test_part_short(self, backend: ModuleType) -> None:
        body = mpub_body([b"a", b"bcdef"])[:-1]
        assert split_error(backend, body) == (_pure.E_MPUB_PART_SHORT, 1, 5)

    def test_size_checked_before_data(self, backend: ModuleType) -> None:
        # A too-big size with no data is PART_BIG, not PART_SHORT (nsqd's order).
        body = i32(1) + i32(MAX_MSG + 1)
        assert split_error(backend, body) == (_pure.E_MPUB_PART_BIG, 0, MAX_MSG + 1)

    @pytest.mark.parametrize("extra", [b"\x00", b"abc", b"\x00\x00\x00\x01x"])
    def test_trailing(self, backend: ModuleType, extra: bytes) -> None:
        body = mpub_body([b"a", b"b"]) + extra
        assert split_error(backend, body) == (_pure.E_MPUB_TRAILING, 2, len(extra))

    def test_first_error_wins(self, backend: ModuleType) -> None:
        # part 0 is short; a later bad size is never looked at.
        body = i32(2) + i32(8) + b"abc"
        assert split_error(backend, body) == (_pure.E_MPUB_PART_SHORT, 0, 8)

    @pytest.mark.parametrize("args", [(-1, 1), (1, -1), (2**32, 1), (1, 2**32)])
    def test_bad_limits(self, backend: ModuleType, args: tuple[int, int]) -> None:
        with pytest.raises(ValueError):
            backend.mpub_split(mpub_body([b"x"]), *args)

    def test_max_limits(self, backend: ModuleType) -> None:
        body = mpub_body([b"x" * 300] * 3)
        assert backend.mpub_split(body, 2**32 - 1, 2**32 - 1) == [b"x" * 300] * 3

    def test_memoryview_slice(self, backend: ModuleType) -> None:
        raw = b"HEAD" + mpub_body([b"one", b"two"]) + b"TAIL"
        view = memoryview(raw)[4:-4]
        assert backend.mpub_split(view, MAX_MSG, MAX_COUNT) == [b"one", b"two"]

    def test_error_str(self, backend: ModuleType) -> None:
        with pytest.raises(backend.ScanError, match="-11"):
            backend.mpub_split(i32(0), MAX_MSG, MAX_COUNT)


@pytest.mark.skipif(_native.c_backend is None, reason="C codec not built")
class TestCSplitDirect:
    """nsqf_mpub_split's own contract: NSQF_E_CAPACITY after full validation."""

    def call(self, body: bytes, cap: int) -> tuple[int, list[tuple[int, int]], tuple[int, int]]:
        assert _native.c_backend is not None
        ffi, lib = _native.c_backend.ffi, _native.c_backend.lib
        offs = ffi.new("uint32_t[]", max(cap, 1))
        lens = ffi.new("uint32_t[]", max(cap, 1))
        err = ffi.new("nsqf_stop *")
        n = lib.nsqf_mpub_split(body, len(body), MAX_MSG, MAX_COUNT, offs, lens, cap, err)
        stored = [(offs[i], lens[i]) for i in range(min(max(n, 0), cap))]
        return n, stored, (err.index, err.value)

    def test_capacity_reported_for_valid_body(self) -> None:
        body = mpub_body([b"a", b"bb", b"ccc"])
        n, _, detail = self.call(body, 2)
        assert n == _pure.E_CAPACITY and detail[1] == 3
        assert self.call(body, 3)[:2] == (3, [(8, 1), (13, 2), (19, 3)])

    def test_validation_before_capacity(self) -> None:
        body = mpub_body([b"a", b"bb", b"ccc"]) + b"!"
        assert self.call(body, 1)[0] == _pure.E_MPUB_TRAILING
        assert self.call(body, 0)[0] == _pure.E_MPUB_TRAILING
