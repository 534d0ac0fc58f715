"""The C codec agrees with the pure-Python spec on random and structured input."""

from __future__ import annotations

import os
import re
import struct
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pybroker import _native
from pybroker._native import _pure

C = _native.c_backend
needs_c = pytest.mark.skipif(C is None, reason="C codec not built")

HEADER = os.path.join(os.path.dirname(__file__), "..", "..", "csrc", "nsqframe.h")

SETTINGS = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

VERBS = [b"PUB", b"DPUB", b"MPUB", b"IDENTIFY", b"AUTH", b"FIN", b"RDY", b"NOP",
         b"PUBX", b"PU", b"", b"SUB", b"pub"]
EDGE_SIZES = [0, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, -1, -(2**31), 2**31 - 1]

limits_st = st.tuples(
    st.integers(0, 40) | st.sampled_from([0, 2**32 - 1]),
    st.integers(0, 20) | st.sampled_from([2**32 - 1]),
    st.integers(0, 40) | st.sampled_from([2**32 - 1]),
)


@st.composite
def command(draw: st.DrawFn) -> bytes:
    """One command, usually well formed, sometimes with a wrong size or cut."""
    verb = draw(st.sampled_from(VERBS))
    params = draw(st.lists(st.binary(max_size=6).filter(lambda b: b"\n" not in b), max_size=3))
    line = b" ".join([verb, *params]) if params else verb
    end = draw(st.sampled_from([b"\n", b"\r\n", b"\r\r\n"]))
    out = line + end
    if verb in (b"PUB", b"DPUB", b"MPUB", b"IDENTIFY", b"AUTH"):
        body = draw(st.binary(max_size=24))
        size = draw(st.sampled_from([len(body)] * 4 + EDGE_SIZES))
        out += struct.pack(">i", size) + body
    return out


stream_st = st.lists(command(), max_size=8).map(b"".join)


def scan_both(limits: tuple[int, int, int], buf: bytes) -> Any:
    assert C is not None
    want = _pure.Scanner(*limits).scan(buf)
    got = C.Scanner(*limits).scan(buf)
    assert got == want
    return want


@needs_c
class TestScanParity:
    @SETTINGS
    @given(limits=limits_st, buf=st.binary(max_size=200))
    def test_random_bytes(self, limits: tuple[int, int, int], buf: bytes) -> None:
        scan_both(limits, buf)

    @SETTINGS
    @given(limits=limits_st, buf=stream_st, cut=st.integers(0, 400))
    def test_command_streams(self, limits: tuple[int, int, int], buf: bytes, cut: int) -> None:
        scan_both(limits, buf)
        scan_both(limits, buf[:cut])

    @SETTINGS
    @given(buf=stream_st, cap=st.integers(1, 4))
    def test_small_caps_compose(self, buf: bytes, cap: int) -> None:
        """Calling nsqf_scan again from *used after NSQF_FULL gives the same spans."""
        assert C is not None
        ffi, lib = C.ffi, C.lib
        limits = (40, 20, 40)
        want_spans, want_used, want_stop = _pure.Scanner(*limits).scan(buf)
        lim = ffi.new("nsqf_limits *", limits)
        out = ffi.new("nsqf_span[]", cap)
        used = ffi.new("size_t *")
        stop = ffi.new("nsqf_stop *")
        spans: list[tuple[int, int, int, int]] = []
        base = 0
        while True:
            rest = buf[base:]
            n = lib.nsqf_scan(rest, len(rest), lim, out, cap, used, stop)
            for o in out[0:n]:
                spans.append((o.line_off + base, o.line_len,
                              o.body_off + base if o.body_len else 0, o.body_len))
            assert stop.line_off == used[0]
            base += used[0]
            if stop.status != _pure.FULL:
                break
            assert n == cap
        assert (spans, base) == (want_spans, want_used)
        assert (stop.status, stop.line_len, stop.value) == (
            want_stop[0], want_stop[2], want_stop[3])


@st.composite
def mpub_body(draw: st.DrawFn) -> bytes:
    parts = draw(st.lists(st.binary(min_size=1, max_size=12), max_size=6))
    count = draw(st.sampled_from([len(parts)] * 4 + [0, -1, len(parts) + 1, 2**31 - 1]))
    out = bytearray(struct.pack(">i", count))
    for p in parts:
        size = draw(st.sampled_from([len(p)] * 6 + EDGE_SIZES))
        out += struct.pack(">i", size) + p
    mutation = draw(st.sampled_from(["none", "none", "cut", "extend"]))
    if mutation == "cut":
        del out[draw(st.integers(0, len(out))):]
    elif mutation == "extend":
        out += draw(st.binary(min_size=1, max_size=5))
    return bytes(out)


def split_result(backend: Any, body: Any, max_msg: int, max_count: int) -> Any:
    try:
        return backend.mpub_split(body, max_msg, max_count)
    except _native.ScanError as err:
        return ("error", err.code, err.index, err.value)


@needs_c
class TestMpubParity:
    @SETTINGS
    @given(body=mpub_body() | st.binary(max_size=60), max_msg=st.integers(0, 16),
           max_count=st.integers(0, 8) | st.just(2**32 - 1))
    def test_bodies(self, body: bytes, max_msg: int, max_count: int) -> None:
        want = split_result(_pure, body, max_msg, max_count)
        assert split_result(C, body, max_msg, max_count) == want
        assert split_result(C, bytearray(body), max_msg, max_count) == want
        assert split_result(C, memoryview(body), max_msg, max_count) == want


@st.composite
def log_input(draw: st.DrawFn) -> tuple[int, int, int, bytes, list[int], list[int]]:
    """Bodies inside a source buffer, with an offset, a publish time and a due time."""
    src = draw(st.binary(max_size=200))
    parts = draw(st.lists(st.tuples(st.integers(0, len(src)), st.integers(0, 40)), max_size=8))
    offs = [min(o, len(src)) for o, _ in parts]
    lens = [min(n, len(src) - o) for o, (_, n) in zip(offs, parts)]
    first = draw(st.integers(0, 2**63 - 64))
    ts = draw(st.integers(-(2**63), 2**63 - 1))
    due = draw(st.sampled_from([0, 1, ts]))
    return first, ts, due, src, offs, lens


@needs_c
class TestLogParity:
    @SETTINGS
    @given(log_input(), st.integers(-1, 70000))
    def test_build_scan_frames(self, args: Any, attempts: int) -> None:
        assert C is not None
        first, ts, due, src, offs, lens = args
        c_recs, c_pos = C.log_build(first, ts, due, src, offs, lens)
        p_recs, p_pos = _pure.log_build(first, ts, due, src, offs, lens)
        assert c_recs == p_recs and list(c_pos) == p_pos
        for check in (True, False):
            cs = C.log_scan(c_recs, first, check, 1000, 100)
            ps = _pure.log_scan(p_recs, first, check, 1000, 100)
            assert (list(cs[0]), cs[1], cs[2]) == (ps[0], ps[1], ps[2])
        a = min(attempts, 65535) if attempts >= 0 else -1
        assert C.log_frames(c_recs, c_pos, a) == _pure.log_frames(p_recs, p_pos, a)
        adds = [(attempts + k) % 70000 for k in range(len(p_pos))]
        assert C.log_frames_each(c_recs, c_pos, adds) == \
            _pure.log_frames_each(p_recs, p_pos, adds)

    @SETTINGS
    @given(st.binary(max_size=300), st.integers(0, 5), st.booleans())
    def test_scan_of_any_bytes(self, buf: bytes, first: int, check: bool) -> None:
        assert C is not None
        cs = C.log_scan(buf, first, check, 200, 50)
        ps = _pure.log_scan(buf, first, check, 200, 50)
        assert (list(cs[0]), cs[1], cs[2]) == (ps[0], ps[1], ps[2])


def test_header_constants_match_pure() -> None:
    """The header (the contract) and the pure spec define the same codes."""
    with open(HEADER, encoding="utf-8") as f:
        defines = dict(re.findall(r"#define\s+NSQF_(\w+)\s+(-?\d+)", f.read()))
    assert defines, "no constants found in nsqframe.h"
    for name, value in defines.items():
        assert getattr(_pure, name) == int(value), name
    for name in ("NEED_MORE", "E_LINE_TOO_LONG", "E_MSG_SIZE", "E_BODY_SIZE",
                 "E_MPUB_COUNT_READ", "E_MPUB_COUNT", "E_MPUB_PART_READ",
                 "E_MPUB_PART_SIZE", "E_MPUB_PART_BIG", "E_MPUB_PART_SHORT",
                 "E_MPUB_TRAILING"):
        assert getattr(_native, name) == int(defines[name]), name


@needs_c
def test_compiled_constants_match_header() -> None:
    assert C is not None
    with open(HEADER, encoding="utf-8") as f:
        defines = dict(re.findall(r"#define\s+(NSQF_\w+)\s+(-?\d+)", f.read()))
    for name, value in defines.items():
        assert getattr(C.lib, name) == int(value), name


def test_backend_selection() -> None:
    forced = os.environ.get("PYBROKER_PURE", "") not in ("", "0")
    assert _native.BACKEND == ("pure" if forced else "c")
    impl = _pure if forced else C
    assert impl is not None
    assert _native.mpub_split is impl.mpub_split
    assert _native.log_frames is impl.log_frames
    assert _native.log_frames_each is impl.log_frames_each
    assert _native.Scanner(10, 10, 10).scan(b"NOP\n") == ([(0, 3, 0, 0)], 4, (0, 4, 0, 0))


BLOCK_COMPILED = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "pybroker._native._nsqframe":
            raise ImportError("blocked for the test")
        return None
sys.meta_path.insert(0, Block())
try:
    import pybroker._native as n
except ImportError as exc:
    print("ImportError:", exc)
else:
    print("backend:", n.BACKEND, n.c_backend)
"""


@pytest.mark.parametrize(("pure", "warned"), [("", True), ("0", True), ("1", False)])
def test_missing_compiled_module(pure: str, warned: bool) -> None:
    """Without the compiled module the pure codec runs; never silently: one warning
    line, unless PYBROKER_PURE=1 asked for it."""
    env = {k: v for k, v in os.environ.items() if k != "PYBROKER_PURE"}
    if pure:
        env["PYBROKER_PURE"] = pure
    proc = subprocess.run([sys.executable, "-c", BLOCK_COMPILED], env=env,
                          capture_output=True, text=True, timeout=60, check=True)
    assert proc.stdout.startswith("backend: pure None"), proc.stdout + proc.stderr
    lines = proc.stderr.splitlines()
    if warned:
        assert len(lines) == 1 and lines[0].startswith("pybroker: warning: the C codec"), lines
    else:
        assert lines == []


@st.composite
def fin_run(draw: st.DrawFn) -> bytes:
    """FIN lines with ids that are lowercase hex, other bytes, or of other lengths,
    sometimes followed by another command or cut short."""
    lines = []
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(["hex", "hex", "upper", "binary", "short", "spaced"]))
        if kind == "hex":
            mid = b"%016x" % draw(st.integers(0, 2**64 - 1))
        elif kind == "upper":
            mid = b"%016X" % draw(st.integers(0, 2**64 - 1))
        elif kind == "binary":
            mid = draw(st.binary(min_size=16, max_size=16))
        elif kind == "short":
            mid = draw(st.binary(max_size=15))
        else:
            mid = b"0123456 89abcdef"
        lines.append(b"FIN " + mid + b"\n")
    tail = draw(st.sampled_from([b"", b"RDY 5\n", b"FIN 01", b"NOP\n"]))
    return b"".join(lines) + tail


@needs_c
@SETTINGS
@given(fin_run())
def test_scan_fins_parity(buf: bytes) -> None:
    assert C is not None
    offs, used = _native.Scanner(1024, 1024, 1024).fins(buf)
    want_offs, want_used = _pure.scan_fins(buf)
    assert (list(offs), used) == (want_offs, want_used)
