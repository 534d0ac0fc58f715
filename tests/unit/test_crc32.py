"""The records' CRC-32 (csrc/nsqframe.c ``crc32_of``): by carry-less multiplication
where the CPU has it, else by tables sliced by 8. Both agree with zlib.crc32 at every
length and alignment, a damaged record is found either way, and the folding
constants in the C source are derived here again from the polynomial."""
from __future__ import annotations

import os
import random
import re
import zlib
from collections.abc import Iterator

import pytest

from pybroker import _native
from tests.support.broker import project_root

pytestmark = pytest.mark.skipif(_native.BACKEND != "c", reason="the compiled module is not built")

P = 0x104C11DB7       # zlib's CRC-32 polynomial, x^32 included


def _xpow_mod(e: int) -> int:
    """x^e mod P over GF(2)."""
    r = 1
    for _ in range(e):
        r <<= 1
        if r >> 32:
            r ^= P
    return r


def _quotient(e: int) -> int:
    """floor(x^e / P) over GF(2)."""
    num, q = 1 << e, 0
    while num.bit_length() >= 33:
        shift = num.bit_length() - 33
        q |= 1 << shift
        num ^= P << shift
    return q


def _reflect(v: int, bits: int) -> int:
    return int(format(v, f"0{bits}b")[::-1], 2)


@pytest.fixture(params=[True, False], ids=["clmul", "tables"])
def way(request: pytest.FixtureRequest) -> Iterator[bool]:
    lib = _native._lib
    if request.param and not lib.nsqf_crc_clmul(-1):
        pytest.skip("this CPU has no PCLMULQDQ and SSE4.1 (or it is not x86-64)")
    lib.nsqf_crc_clmul(1 if request.param else 0)
    try:
        yield bool(request.param)
    finally:
        lib.nsqf_crc_clmul(1)


def test_the_folding_constants_follow_from_the_polynomial() -> None:
    src = (project_root() / "csrc" / "nsqframe.c").read_text()
    consts = {m.group(1): int(m.group(2), 16)
              for m in re.finditer(r"#define (FOLD_\w+|P_R|MU_R) 0x([0-9A-F]+)ull", src)}
    want = {"FOLD_512_PLUS_32": _reflect(_xpow_mod(4 * 128 + 32), 32) << 1,
            "FOLD_512_MINUS_32": _reflect(_xpow_mod(4 * 128 - 32), 32) << 1,
            "FOLD_128_PLUS_32": _reflect(_xpow_mod(128 + 32), 32) << 1,
            "FOLD_128_MINUS_32": _reflect(_xpow_mod(128 - 32), 32) << 1,
            "FOLD_64": _reflect(_xpow_mod(64), 32) << 1,
            "P_R": _reflect(P, 33),
            "MU_R": _reflect(_quotient(64), 33)}
    assert consts == want


def test_every_length_and_alignment_agrees_with_zlib(way: bool) -> None:
    lib, ffi = _native._lib, _native._ffi
    rnd = random.Random(7)
    lengths = list(range(0, 300)) + [511, 512, 513, 4096, 65_543]
    for n in lengths:
        for at in (0, 1, 5, 15):
            buf = bytes(rnd.getrandbits(8) for _ in range(n + at)) if n < 600 \
                else os.urandom(n + at)
            assert lib.nsqf_crc32(ffi.from_buffer(buf) + at, n) == zlib.crc32(buf[at:]), \
                (n, at)
    for fill in (b"\x00", b"\xff"):
        buf = fill * 1000
        assert lib.nsqf_crc32(ffi.from_buffer(buf), 1000) == zlib.crc32(buf)


def test_a_damaged_record_is_found_either_way(way: bool) -> None:
    """Records built and scanned (the checksums made and checked in C): each one
    byte flipped anywhere past the checksum is refused."""
    bodies = [os.urandom(n) for n in (0, 1, 47, 48, 200, 1000)]
    data = b"".join(_native.log_build(10 + i, 5, 0, b, (0,), (len(b),))[0]
                    for i, b in enumerate(bodies))
    starts, used, (status, _, _) = _native.log_scan(data, 10, True, 1 << 20, 1 << 30)
    assert len(starts) == len(bodies) and used == len(data) and status >= 0
    for k, start in enumerate(starts):
        end = starts[k + 1] if k + 1 < len(starts) else len(data)
        for pos in (start + 4, (start + end) // 2, end - 1):
            bad = bytearray(data)
            bad[pos] ^= 0x20
            got, _, (status, _, _) = _native.log_scan(bytes(bad), 10, True, 1 << 20,
                                                      1 << 30)
            assert len(got) == k and status < 0, (k, pos)
