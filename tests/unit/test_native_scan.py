"""Scanner.scan on both backends: every case whole, byte by byte, with trailing bytes."""

from __future__ import annotations

import struct
import threading
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

NEED_MORE = _pure.NEED_MORE
LIMITS = (64, 100, 1000)  # max_line, max_msg_size, max_body_size


def size(n: int) -> bytes:
    return struct.pack(">i", n)


def scan(backend: Any, buf: bytes, limits: tuple[int, int, int] = LIMITS) -> Any:
    return backend.Scanner(*limits).scan(buf)


def span_ends(spans: list[tuple[int, int, int, int]], used: int) -> list[int]:
    """Where each complete command ends: the next one's start, or used."""
    return [s[0] for s in spans[1:]] + ([used] if spans else [])


def check_incremental(
    backend: Any, buf: bytes, limits: tuple[int, int, int] = LIMITS
) -> tuple[Any, ...]:
    """Scan buf whole, then every prefix; return the whole result.

    Every prefix must report exactly the commands complete within it (none
    early, none late), an error only if the whole buffer has the same one,
    and the same result for bytes and bytearray.
    """
    scanner = backend.Scanner(*limits)
    spans, used, stop = scanner.scan(buf)
    assert scanner.scan(bytearray(buf)) == (spans, used, stop)
    assert used <= len(buf)
    assert stop[1] == used
    ends = span_ends(spans, used)
    for k in range(len(buf)):
        p_spans, p_used, p_stop = scanner.scan(buf[:k])
        complete = sum(1 for e in ends if e <= k)
        assert p_spans == spans[:complete], k
        assert p_used == (ends[complete - 1] if complete else 0), k
        if p_stop[0] < 0:
            assert p_stop == stop, k  # errors are final: more bytes never fix them
        else:
            assert p_stop[0] == NEED_MORE and p_stop[1] == p_used, k
            # A complete line is reported as soon as it is there.
            if p_stop[2] > 0:
                assert buf.find(b"\n", p_used, k) >= 0, k
    return spans, used, stop


def check_decoder_feed(backend: Any, buf: bytes, limits: tuple[int, int, int] = LIMITS) -> None:
    """Feed one byte at a time into a consuming buffer, as a decoder does."""
    scanner = backend.Scanner(*limits)
    spans, _, stop = scanner.scan(buf)
    want = [(buf[lo : lo + ll], buf[bo : bo + bl]) for lo, ll, bo, bl in spans]
    got: list[tuple[bytes, bytes]] = []
    pending = bytearray()
    last_stop: Any = None
    for i in range(len(buf)):
        pending += buf[i : i + 1]
        p_spans, p_used, last_stop = scanner.scan(pending)
        got += [(bytes(pending[lo : lo + ll]), bytes(pending[bo : bo + bl]))
                for lo, ll, bo, bl in p_spans]
        if last_stop[0] < 0:
            break
        del pending[:p_used]  # the buffer export must already be released
    assert got == want
    if stop[0] < 0:
        assert last_stop is not None and last_stop[0] == stop[0]
        assert last_stop[2:] == stop[2:]


def check_all(backend: Any, buf: bytes, limits: tuple[int, int, int] = LIMITS) -> Any:
    result = check_incremental(backend, buf, limits)
    check_decoder_feed(backend, buf, limits)
    spans, used, stop = result
    if stop[0] == NEED_MORE and stop[1] == len(buf):
        # Trailing bytes never change what came before them.
        for tail in (b"NOP\n", b"PU", b"PUB t\n\x00\x00", b"\n"):
            t_spans, t_used, _ = scan(backend, buf + tail, limits)
            assert t_spans[: len(spans)] == spans
            assert t_used >= used
    return result


@pytest.mark.parametrize("backend", BACKENDS)
class TestLines:
    def test_single_line(self, backend: ModuleType) -> None:
        buf = b"FIN 0123456789abcdef\n"
        assert check_all(backend, buf) == ([(0, 20, 0, 0)], 21, (NEED_MORE, 21, 0, 0))

    def test_empty_buffer(self, backend: ModuleType) -> None:
        assert scan(backend, b"") == ([], 0, (NEED_MORE, 0, 0, 0))

    def test_incomplete_line(self, backend: ModuleType) -> None:
        assert check_all(backend, b"NOP") == ([], 0, (NEED_MORE, 0, 0, 0))

    def test_crlf_strips_one_cr(self, backend: ModuleType) -> None:
        buf = b"NOP\r\n\r\n\r\r\nRDY 1\r\n"
        spans, used, stop = check_all(backend, buf)
        assert spans == [(0, 3, 0, 0), (5, 0, 0, 0), (7, 1, 0, 0), (10, 5, 0, 0)]
        assert (used, stop) == (len(buf), (NEED_MORE, len(buf), 0, 0))

    def test_empty_lines_are_commands(self, backend: ModuleType) -> None:
        spans, used, _ = check_all(backend, b"\n\nNOP\n")
        assert spans == [(0, 0, 0, 0), (1, 0, 0, 0), (2, 3, 0, 0)]
        assert used == 6

    def test_many_commands(self, backend: ModuleType) -> None:
        # More commands than a fresh C scanner's scratch holds in one call.
        buf = b"".join(b"FIN %016x\n" % i for i in range(5000))
        spans, used, stop = scan(backend, buf)
        assert spans == [(21 * i, 20, 0, 0) for i in range(5000)]
        assert (used, stop) == (len(buf), (NEED_MORE, len(buf), 0, 0))

    def test_many_commands_then_error(self, backend: ModuleType) -> None:
        buf = b"NOP\n" * 3000 + b"PUB t\n" + size(0)
        spans, used, stop = scan(backend, buf)
        assert len(spans) == 3000 and spans[-1] == (4 * 2999, 3, 0, 0)
        assert (used, stop) == (12000, (_pure.E_MSG_SIZE, 12000, 5, 0))

    def test_many_bodies_then_partial(self, backend: ModuleType) -> None:
        one = b"PUB t\n" + size(3) + b"abc"
        buf = one * 3000 + b"PUB t\n" + size(3) + b"a"
        spans, used, stop = scan(backend, buf)
        assert spans == [(13 * i, 5, 13 * i + 10, 3) for i in range(3000)]
        assert (used, stop) == (39000, (NEED_MORE, 39000, 5, 3))


@pytest.mark.parametrize("backend", BACKENDS)
class TestLineLength:
    def test_at_limit(self, backend: ModuleType) -> None:
        buf = b"x" * 10 + b"\n"
        assert check_all(backend, buf, (10, 1, 1))[0] == [(0, 10, 0, 0)]

    def test_cr_counts_toward_limit(self, backend: ModuleType) -> None:
        assert check_all(backend, b"x" * 9 + b"\r\n", (10, 1, 1))[0] == [(0, 9, 0, 0)]
        stop = check_all(backend, b"x" * 10 + b"\r\n", (10, 1, 1))[2]
        assert stop == (_pure.E_LINE_TOO_LONG, 0, 0, 0)

    def test_over_limit(self, backend: ModuleType) -> None:
        buf = b"NOP\n" + b"x" * 11 + b"\n"
        assert check_all(backend, buf, (10, 1, 1)) == (
            [(0, 3, 0, 0)], 4, (_pure.E_LINE_TOO_LONG, 4, 0, 0))

    def test_over_limit_without_newline(self, backend: ModuleType) -> None:
        assert scan(backend, b"x" * 10, (10, 1, 1)) == ([], 0, (NEED_MORE, 0, 0, 0))
        assert scan(backend, b"x" * 11, (10, 1, 1)) == (
            [], 0, (_pure.E_LINE_TOO_LONG, 0, 0, 0))

    def test_zero_max_line(self, backend: ModuleType) -> None:
        assert scan(backend, b"\n\n", (0, 1, 1))[0] == [(0, 0, 0, 0), (1, 0, 0, 0)]
        assert scan(backend, b"\nx", (0, 1, 1))[2] == (_pure.E_LINE_TOO_LONG, 1, 0, 0)


@pytest.mark.parametrize("backend", BACKENDS)
class TestBodies:
    @pytest.mark.parametrize("verb", [b"PUB", b"DPUB", b"MPUB", b"IDENTIFY", b"AUTH"])
    def test_body_verbs(self, backend: ModuleType, verb: bytes) -> None:
        line = verb + b" t 1"
        buf = line + b"\n" + size(4) + b"\n\nab" + b"NOP\n"
        n = len(line)
        spans, used, stop = check_all(backend, buf)
        assert spans == [(0, n, n + 5, 4), (n + 9, 3, 0, 0)]
        assert (used, stop) == (len(buf), (NEED_MORE, len(buf), 0, 0))

    @pytest.mark.parametrize("verb", [b"PUB", b"IDENTIFY"])
    def test_bare_verb_has_body(self, backend: ModuleType, verb: bytes) -> None:
        buf = verb + b"\r\n" + size(1) + b"x"
        n = len(verb)
        assert check_all(backend, buf)[0] == [(0, n, n + 6, 1)]

    @pytest.mark.parametrize(
        "line", [b"PUBX t", b"PU t", b"pub t", b" PUB t", b"XPUB t", b"PUB\tt", b"IDENTIFYX",
                 b"PUB\r\r", b"SUB t c", b"MPUBB"],
    )
    def test_only_whole_first_token_counts(self, backend: ModuleType, line: bytes) -> None:
        buf = line + b"\n" + b"NOP\n"
        n = len(line) - (1 if line.endswith(b"\r") else 0)
        spans = check_all(backend, buf)[0]
        assert spans == [(0, n, 0, 0), (len(line) + 1, 3, 0, 0)]

    def test_line_complete_body_missing(self, backend: ModuleType) -> None:
        assert scan(backend, b"NOP\nPUB t\n") == ([(0, 3, 0, 0)], 4, (NEED_MORE, 4, 5, 0))
        assert scan(backend, b"PUB t\n\x00\x00") == ([], 0, (NEED_MORE, 0, 5, 0))
        assert scan(backend, b"PUB t\n" + size(5) + b"abcd") == ([], 0, (NEED_MORE, 0, 5, 5))
        assert scan(backend, b"PUB t\r\n" + size(5)) == ([], 0, (NEED_MORE, 0, 5, 5))

    def test_limits_inclusive(self, backend: ModuleType) -> None:
        buf = b"PUB t\n" + size(100) + b"m" * 100 + b"MPUB t\n" + size(1000) + b"b" * 1000
        spans = check_incremental(backend, buf)[0]
        assert spans == [(0, 5, 10, 100), (110, 6, 121, 1000)]

    @pytest.mark.parametrize("verb", [b"PUB", b"DPUB"])
    @pytest.mark.parametrize("bad", [0, -1, -(2**31), 101, 2**31 - 1])
    def test_msg_size_errors(self, backend: ModuleType, verb: bytes, bad: int) -> None:
        line = verb + b" t"
        buf = b"NOP\n" + line + b"\n" + size(bad)
        result = check_all(backend, buf)
        assert result == ([(0, 3, 0, 0)], 4, (_pure.E_MSG_SIZE, 4, len(line), bad))
        # Reported without waiting for the body, and whatever follows.
        assert scan(backend, buf + b"x" * 200) == result

    @pytest.mark.parametrize("verb", [b"MPUB", b"IDENTIFY", b"AUTH"])
    @pytest.mark.parametrize("bad", [0, -1, -(2**31), 1001, 2**31 - 1])
    def test_body_size_errors(self, backend: ModuleType, verb: bytes, bad: int) -> None:
        buf = verb + b"\r\n" + size(bad)
        result = check_all(backend, buf)
        assert result == ([], 0, (_pure.E_BODY_SIZE, 0, len(verb), bad))

    def test_msg_limit_applies_to_pub_not_mpub(self, backend: ModuleType) -> None:
        ok = b"MPUB t\n" + size(500) + b"x" * 500
        assert scan(backend, ok)[0] == [(0, 6, 11, 500)]
        assert scan(backend, b"PUB t\n" + size(500))[2][0] == _pure.E_MSG_SIZE

    def test_body_may_contain_newlines(self, backend: ModuleType) -> None:
        buf = b"PUB t\n" + size(6) + b"\nNOP\n\n" + b"RDY 1\n"
        assert check_all(backend, buf)[0] == [(0, 5, 10, 6), (16, 5, 0, 0)]

    def test_body_verb_line_too_long(self, backend: ModuleType) -> None:
        buf = b"PUB " + b"t" * 70 + b"\n" + size(1) + b"x"
        assert scan(backend, buf) == ([], 0, (_pure.E_LINE_TOO_LONG, 0, 0, 0))


@pytest.mark.parametrize("backend", BACKENDS)
class TestScannerArgs:
    @pytest.mark.parametrize("limits", [(-1, 1, 1), (1, -1, 1), (1, 1, 2**32)])
    def test_bad_limits(self, backend: ModuleType, limits: tuple[int, int, int]) -> None:
        with pytest.raises(ValueError):
            backend.Scanner(*limits)

    def test_bad_limit_type(self, backend: ModuleType) -> None:
        with pytest.raises(TypeError):
            backend.Scanner(1.5, 1, 1)

    def test_max_limits(self, backend: ModuleType) -> None:
        s = backend.Scanner(2**32 - 1, 2**32 - 1, 2**32 - 1)
        buf = b"PUB t\n" + size(2**31 - 1)
        assert s.scan(buf) == ([], 0, (NEED_MORE, 0, 5, 2**31 - 1))

    def test_scanners_in_threads(self, backend: ModuleType) -> None:
        buf = b"".join(b"PUB t\n" + size(50) + bytes(50) + b"FIN %016x\n" % i
                       for i in range(300))
        want = scan(backend, buf)
        results: list[Any] = []

        def work() -> None:
            s = backend.Scanner(*LIMITS)
            results.append(all(s.scan(buf) == want for _ in range(30)))

        threads = [threading.Thread(target=work, name=f"scan-{i}") for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert results == [True] * 4


@pytest.mark.skipif(_native.c_backend is None, reason="C codec not built")
class TestCScanDirect:
    """nsqf_scan's own contract: small caps, NSQF_FULL, cap < 1."""

    def call(self, buf: bytes, cap: int) -> tuple[list[tuple[int, ...]], int, tuple[int, ...]]:
        assert _native.c_backend is not None
        ffi, lib = _native.c_backend.ffi, _native.c_backend.lib
        lim = ffi.new("nsqf_limits *", LIMITS)
        out = ffi.new("nsqf_span[]", max(cap, 1))
        used = ffi.new("size_t *", 12345)
        stop = ffi.new("nsqf_stop *")
        n = lib.nsqf_scan(buf, len(buf), lim, out, cap, used, stop)
        spans = [(o.line_off, o.line_len, o.body_off, o.body_len) for o in out[0:n]]
        return spans, used[0], (stop.status, stop.line_off, stop.line_len, stop.value)

    def test_full(self) -> None:
        buf = b"NOP\nPUB t\n" + size(1) + b"xRDY 1\n"
        assert self.call(buf, 1) == ([(0, 3, 0, 0)], 4, (_pure.FULL, 4, 0, 0))
        assert self.call(buf, 2) == ([(0, 3, 0, 0), (4, 5, 14, 1)], 15, (_pure.FULL, 15, 0, 0))
        assert self.call(buf, 3)[2] == (NEED_MORE, len(buf), 0, 0)

    def test_full_only_when_bytes_remain(self) -> None:
        assert self.call(b"NOP\n", 1) == ([(0, 3, 0, 0)], 4, (NEED_MORE, 4, 0, 0))

    def test_cap_below_one(self) -> None:
        for cap in (0, -5):
            assert self.call(b"NOP\n", cap) == ([], 0, (_pure.E_CAPACITY, 0, 0, 1))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("most", [1, 63, 64, 65, 200, 3000, 3001])
def test_the_first_most_commands(backend: ModuleType, most: int) -> None:
    """scan(buf, most): the first ``most`` spans of the whole scan, ``used`` where the
    next one starts, and FULL while bytes are left after them (what the decoder parses
    a batch at a time: pybroker.protocol.decoder.PARSE_BATCH); the whole scan's end
    once fewer than ``most`` are complete (with exactly ``most``, FULL too: bytes are
    left)."""
    one = b"PUB t\n" + size(3) + b"abc"
    buf = (one + b"NOP\n") * 1500 + b"PUB t\n" + size(3) + b"a"
    scanner = backend.Scanner(*LIMITS)
    spans, used, stop = scanner.scan(buf)
    got, got_used, got_stop = scanner.scan(buf, most)
    if most <= len(spans):
        ends = span_ends(spans, used)
        assert got == spans[:most]
        assert got_used == ends[most - 1]
        assert got_stop[0] == _pure.FULL
    else:
        assert (got, got_used, got_stop) == (spans, used, stop)
