"""The C frame codec's Python boundary: the only importer of _nsqframe.

Exposes Scanner, mpub_split/mpub_parts and the topic log codec (log_build, log_scan,
log_frames) backed by csrc/nsqframe.c,
or by the pure-Python spec in _pure when PYBROKER_PURE=1 (BACKEND says which).
Without PYBROKER_PURE, a missing compiled module (no C compiler at install,
or a source checkout) falls back to the pure-Python codec with one warning
line on stderr; FALLBACK_REASON says why, and the broker logs and reports it. Each function crosses into C once per call; scratch
arrays belong to a Scanner, never to this module (cffi releases the GIL, so
several threads may be inside C at once).
"""

from __future__ import annotations

import array
import importlib
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from pybroker._native import _pure
from pybroker._native._pure import (
    E_BODY_SIZE,
    E_LINE_TOO_LONG,
    E_MPUB_COUNT,
    E_MPUB_COUNT_READ,
    E_MPUB_PART_BIG,
    E_MPUB_PART_READ,
    E_MPUB_PART_SHORT,
    E_MPUB_PART_SIZE,
    E_MPUB_TRAILING,
    E_MSG_SIZE,
    FIN_LANE_SLOW,
    LANE_FAST,
    LANE_FIELDS,
    LANE_SLOW,
    FULL,
    NEED_MORE,
    ScanError,
    Span,
    Stop,
    check_u32,
)

__all__ = [
    "BACKEND",
    "E_BODY_SIZE",
    "E_LINE_TOO_LONG",
    "E_MPUB_COUNT",
    "E_MPUB_COUNT_READ",
    "E_MPUB_PART_BIG",
    "E_MPUB_PART_READ",
    "E_MPUB_PART_SHORT",
    "E_MPUB_PART_SIZE",
    "E_MPUB_TRAILING",
    "E_MSG_SIZE",
    "NEED_MORE",
    "FULL",
    "FIN_LANE_SLOW",
    "FinLane",
    "LANE_FAST",
    "LANE_FIELDS",
    "LANE_SLOW",
    "PubLane",
    "ScanError",
    "ScanResult",
    "Scanner",
    "Span",
    "Stop",
    "c_backend",
    "log_build",
    "log_frames",
    "log_frames_each",
    "log_scan",
    "mpub_parts",
    "mpub_split",
]

ScanResult = tuple[list[Span], int, Stop]

_ffi: Any = None
_lib: Any = None
_import_error: ImportError | None = None
try:
    _compiled = importlib.import_module("pybroker._native._nsqframe")
except ImportError as exc:
    _import_error = exc
else:
    _ffi, _lib = _compiled.ffi, _compiled.lib

_U32_MAX = 0xFFFFFFFF
_SPAN_WORDS = 4  # uint32 fields per nsqf_span
_SCAN_CAP_MIN = 64  # spans a fresh Scanner can return per C call
_SCAN_CAP_MAX = 16384  # grown by doubling on NSQF_FULL, kept afterwards
_FIN_CAP = 65536  # FIN lines parsed per nsqf_scan_fins call
_NO_FINS: "array.array[int]" = array.array("q")
_ZERO_U32 = array.array("I", [0])


def _check_header() -> None:
    """Refuse a compiled module built from a different header than _pure's."""
    names = [
        "NEED_MORE", "FULL", "E_LINE_TOO_LONG", "E_MSG_SIZE", "E_BODY_SIZE",
        "E_MPUB_COUNT_READ", "E_MPUB_COUNT", "E_MPUB_PART_READ", "E_MPUB_PART_SIZE",
        "E_MPUB_PART_BIG", "E_MPUB_PART_SHORT", "E_MPUB_TRAILING", "E_CAPACITY",
        "E_FRAME_SIZE", "REC_HEADER", "PAYLOAD_HEAD", "LOG_END", "LOG_PARTIAL", "LOG_FULL",
        "LOG_BAD_LENGTH", "LOG_BAD_CRC", "LOG_BAD_OFFSET", "LANE_FAST", "LANE_SLOW",
        "LANE_FIELDS", "LANE_NAMES", "FIN_LANE_SLOW",
    ]
    pairs = [(n, getattr(_lib, "NSQF_" + n, None), getattr(_pure, n)) for n in names]
    pairs.append(("MAX_BODY", getattr(_lib, "NSQF_MAX_BODY", None), _pure.MAX_BODY))
    bad = [f"{n}: C {c!r} != Python {p!r}" for n, c, p in pairs if c != p]
    if bad:
        raise ImportError(
            "pybroker._native._nsqframe does not match csrc/nsqframe.h "
            f"({'; '.join(bad)}); rebuild it with `pip install -e .`"
        )


class CScanner:
    """Scanner backed by nsqf_scan. Owned by one connection decoder.

    Holds its own limits and span scratch array, so different Scanners may
    be used by different threads at the same time, but one Scanner may not.
    """

    __slots__ = ("_cap", "_fins", "_lim", "_out", "_out_buf", "_stop", "_used", "_words")

    def __init__(self, max_line: int, max_msg_size: int, max_body_size: int) -> None:
        limits = (
            check_u32("max_line", max_line),
            check_u32("max_msg_size", max_msg_size),
            check_u32("max_body_size", max_body_size),
        )
        self._lim = _ffi.new("nsqf_limits *", limits)
        self._used = _ffi.new("size_t *")
        self._fins = array.array("q", bytes(8 * 256))
        self._stop = _ffi.new("nsqf_stop *")
        self._grow(_SCAN_CAP_MIN)

    def _grow(self, cap: int) -> None:
        # An array('I') read back with one slice is the cheapest way found to
        # turn C spans into tuples (cdata field reads cost ~4x more).
        self._cap = cap
        self._words = array.array("I", bytes(4 * _SPAN_WORDS * cap))
        self._out_buf = _ffi.from_buffer(self._words)  # keeps the export alive
        self._out = _ffi.cast("nsqf_span *", self._out_buf)

    def fins(self, buf: bytes | bytearray) -> tuple[array.array[int], int]:
        """The run of FIN lines at the start of buf; see _pure.scan_fins."""
        cap = min(len(buf) // 21, _FIN_CAP)
        if cap == 0:
            return _NO_FINS, 0
        if len(self._fins) < cap:
            self._fins = array.array("q", bytes(8 * max(cap, 256)))
        with _ffi.from_buffer("uint8_t[]", buf) as ptr, \
                _ffi.from_buffer("int64_t[]", self._fins) as offs:
            n = _lib.nsqf_scan_fins(ptr, len(buf), offs, cap, self._used)
        return self._fins[:n], self._used[0]

    def scan(self, buf: bytes | bytearray, most: int = 0) -> ScanResult:
        """Find every complete command in buf (at most ``most`` when > 0); see
        _pure.Scanner.scan."""
        length = min(len(buf), _U32_MAX)
        stop = self._stop
        used = self._used
        # Release the buffer export before returning, so that the caller may
        # resize a bytearray right after (del buf[:used]).
        with _ffi.from_buffer("uint8_t[]", buf) as ptr:
            cap = min(self._cap, most) if most > 0 else self._cap
            n = _lib.nsqf_scan(ptr, length, self._lim, self._out, cap, used, stop)
            it = iter(self._words[: _SPAN_WORDS * n])
            spans: list[Span] = list(zip(it, it, it, it))
            base = 0
            while stop.status == _pure.FULL and not (0 < most <= len(spans)):
                base += used[0]
                if self._cap < _SCAN_CAP_MAX:
                    self._grow(self._cap * 2)
                cap = min(self._cap, most - len(spans)) if most > 0 else self._cap
                n = _lib.nsqf_scan(
                    ptr + base, length - base, self._lim, self._out, cap, used, stop
                )
                it = iter(self._words[: _SPAN_WORDS * n])
                spans.extend(
                    (lo + base, ll, bo + base if bl else 0, bl)
                    for lo, ll, bo, bl in zip(it, it, it, it)
                )
        return spans, base + used[0], (
            stop.status,
            base + stop.line_off,
            stop.line_len,
            stop.value,
        )


def c_mpub_split(
    body: bytes | bytearray | memoryview, max_msg_size: int, max_count: int
) -> list[bytes]:
    """nsqf_mpub_split; same contract as _pure.mpub_split."""
    src: bytes | memoryview = body if type(body) is bytes else memoryview(body).cast("B")
    offs, lens = c_mpub_parts(src, max_msg_size, max_count)
    pairs = zip(offs, lens, strict=True)
    if isinstance(src, memoryview):
        return [src[o : o + s].tobytes() for o, s in pairs]
    return [src[o : o + s] for o, s in pairs]


def c_mpub_parts(
    body: bytes | bytearray | memoryview, max_msg_size: int, max_count: int
) -> "tuple[array.array[int], array.array[int]]":
    """nsqf_mpub_split's checks; the parts as arrays of offsets and lengths into body."""
    check_u32("max_msg_size", max_msg_size)
    check_u32("max_count", max_count)
    src: bytes | memoryview = body if type(body) is bytes else memoryview(body).cast("B")
    length = min(len(src), _U32_MAX)
    # A valid body has count parts of >= 5 bytes each, so this cap always
    # suffices for it; C validates everything before reporting capacity.
    cap = 1
    if length >= 4:
        count = int.from_bytes(src[:4], "big", signed=True)
        cap = max(1, min(count, (length - 4) // 5))
    offs = _ZERO_U32 * cap
    lens = _ZERO_U32 * cap
    err = _ffi.new("nsqf_stop *")
    with _ffi.from_buffer("uint8_t[]", src) as ptr:
        n = _lib.nsqf_mpub_split(
            ptr,
            length,
            max_msg_size,
            max_count,
            _ffi.from_buffer("uint32_t[]", offs),
            _ffi.from_buffer("uint32_t[]", lens),
            cap,
            err,
        )
    if n < 0:
        if n == _pure.E_CAPACITY:  # cannot happen: cap covers any valid body
            raise RuntimeError(f"nsqf_mpub_split needs {err.value} slots, had {cap}")
        raise ScanError(n, err.index, err.value)
    if n == cap:
        return offs, lens
    return offs[:n], lens[:n]


def c_log_build(first: int, ts_ns: int, deliver_at_ns: int, src: bytes | bytearray | memoryview,
                offs: Sequence[int], lens: Sequence[int]) -> tuple[bytearray, "array.array[int]"]:
    """nsqf_log_build; same contract as _pure.log_build (positions as an array)."""
    n = len(lens)
    offs_a = offs if isinstance(offs, array.array) else array.array("I", offs)
    lens_a = lens if isinstance(lens, array.array) else array.array("I", lens)
    total = 50 * n + sum(lens_a)
    out = bytearray(total)
    pos = array.array("I", bytes(4 * n))
    with _ffi.from_buffer("uint8_t[]", src) as sp, \
            _ffi.from_buffer("uint8_t[]", out) as op, \
            _ffi.from_buffer("uint32_t[]", offs_a) as o, \
            _ffi.from_buffer("uint32_t[]", lens_a) as ln, \
            _ffi.from_buffer("uint32_t[]", pos) as pp:
        r = _lib.nsqf_log_build(op, total, first, ts_ns, deliver_at_ns, sp, o, ln, n, pp)
    if r < 0:
        raise ValueError(f"message body too large for a log record (code {r})")
    return out, pos    # a bytearray, never written again: no copy to bytes


def c_log_scan(buf: bytes | memoryview, first: int, check_crc: bool, max_payload: int,
               cap: int) -> tuple["array.array[int]", int, tuple[int, int, int]]:
    """nsqf_log_scan; same contract as _pure.log_scan (positions as an array)."""
    cap = max(1, min(cap, len(buf) // 50 + 1))
    pos = array.array("I", bytes(4 * cap))
    used = _ffi.new("size_t *")
    st = _ffi.new("nsqf_logscan *")
    with _ffi.from_buffer("uint8_t[]", buf) as bp, _ffi.from_buffer("uint32_t[]", pos) as pp:
        n = _lib.nsqf_log_scan(bp, len(buf), first, 1 if check_crc else 0, max_payload, pp,
                               cap, used, st)
    return pos[:n], used[0], (st.status, st.deferred, st.max_ts_ns)


def c_log_frames(buf: bytes | memoryview, pos: Sequence[int],
                 attempts: int) -> bytes | bytearray:
    """nsqf_log_frames; same contract as _pure.log_frames."""
    return _frames(buf, pos, attempts, None)


def c_log_frames_each(buf: bytes | memoryview, pos: Sequence[int],
                      adds: Sequence[int]) -> bytes | bytearray:
    """nsqf_log_frames_each; same contract as _pure.log_frames_each."""
    if len(adds) != len(pos):
        raise ValueError("log_frames_each: one add a record")
    return _frames(buf, pos, 0, adds)


def _frames(buf: bytes | memoryview, pos: Sequence[int], attempts: int,
            adds: Sequence[int] | None) -> bytes | bytearray:
    n = len(pos)
    if n == 0:
        return b""
    pos_a = pos if isinstance(pos, array.array) else array.array("I", pos)
    last = pos_a[n - 1]
    # frames are never longer than their records: an upper bound without a Python loop
    # (for records in offset order; otherwise sum them)
    total = last + 16 + int.from_bytes(buf[last + 4:last + 8], "big") - pos_a[0]
    if total <= 0 or n > 1 and pos_a[0] > last:
        total = sum(16 + int.from_bytes(buf[p + 4:p + 8], "big") for p in pos_a)
    out = bytearray(total)
    with _ffi.from_buffer("uint8_t[]", buf) as bp, \
            _ffi.from_buffer("uint8_t[]", out) as op, \
            _ffi.from_buffer("uint32_t[]", pos_a) as pp:
        if adds is None:
            r = _lib.nsqf_log_frames(op, total, bp, pp, n, attempts)
        else:
            adds_a = adds if isinstance(adds, array.array) and adds.typecode == "I" \
                else array.array("I", adds)
            with _ffi.from_buffer("uint32_t[]", adds_a) as ap:
                r = _lib.nsqf_log_frames_each(op, total, bp, pp, ap, n)
    if r < 0:
        raise ValueError(f"cannot frame log records (code {r})")
    if r != total:
        del out[r:]
    return out         # a bytearray handed to the socket as it is: no copy


class CBackend:
    """The C-backed functions under the same names as the _pure module."""

    name = "c"
    Scanner = CScanner
    ScanError = ScanError
    mpub_split = staticmethod(c_mpub_split)
    log_build = staticmethod(c_log_build)
    log_scan = staticmethod(c_log_scan)
    log_frames = staticmethod(c_log_frames)
    log_frames_each = staticmethod(c_log_frames_each)
    ffi: Any = _ffi
    lib: Any = _lib


c_backend: CBackend | None = None
if _lib is not None:
    _check_header()
    c_backend = CBackend()

_force_pure = os.environ.get("PYBROKER_PURE", "") not in ("", "0")
# why the pure-Python codec runs, when it was not asked for ("" otherwise)
FALLBACK_REASON = ""
if c_backend is None and not _force_pure:
    # never silently slower: one line now, and the broker's log and /stats say it too
    _tree = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if os.path.isfile(os.path.join(_tree, "setup.py")) and \
            os.path.isdir(os.path.join(_tree, "csrc")):
        # `python -m pybroker` in a clone imports the clone's sources, not what
        # `pip install .` built and installed
        _advice = (f"pybroker was imported from its source tree {_tree}, where it is not "
                   "built: run the installed `pybroker` command (or `python -m pybroker` "
                   "outside the tree), or build the tree in place with `pip install -e .`")
    else:
        _advice = "install with a C compiler (pip install .) for the C one"
    FALLBACK_REASON = (f"the C codec (pybroker._native._nsqframe) is not built "
                       f"({_import_error}); using the pure-Python codec, which is slower: "
                       + _advice)
    if logging.getLogger("pybroker").hasHandlers():   # the broker's log is set up
        logging.getLogger("pybroker").warning("%s", FALLBACK_REASON)
    else:
        sys.stderr.write(f"pybroker: warning: {FALLBACK_REASON}\n")

BACKEND: str = "pure" if _force_pure or c_backend is None else "c"


class _LaneViews:
    """The C views a lane scanner hands to its C call each turn: of its kept arrays,
    made once (again when the results array must grow: a view would stop it from
    growing), and of the last input buffer (which must not change size while the
    scanner reads it, as BatchIO's does not). A turn's call then sets up only its two
    small input arrays."""

    __slots__ = ("_kept", "_res", "_ptrs", "_buf", "_bufp")

    def __init__(self, res: "array.array[int]", *kept: "tuple[str, array.array[int]]"
                 ) -> None:
        self._kept = kept          # (C type, array) of the arrays that never grow
        self._res = res            # the results: grown to what a call needs
        self._ptrs: Any = None
        self._buf: bytearray | None = None
        self._bufp: Any = None

    def arrays(self, need: int) -> Any:
        """The kept arrays' views then the results' (at least ``need`` long)."""
        res = self._res
        if len(res) < need or self._ptrs is None:
            self._ptrs = None
            if len(res) < need:
                res.extend([0] * (need - len(res)))
            self._ptrs = (*(_ffi.from_buffer(t, a) for t, a in self._kept),
                          _ffi.from_buffer("uint32_t[]", res))
        return self._ptrs

    def buffer(self, buf: bytearray) -> Any:
        if buf is not self._buf:
            self._buf, self._bufp = buf, _ffi.from_buffer("uint8_t[]", buf)
        return self._bufp


class PubLane:
    """The publish lane's scan (nsqf_pub_lane; csrc/nsqframe.h): one call per loop turn
    over the bytes every publishing connection sent. Owned by one event loop (its
    scratch arrays are not shared). ``scan(buf, starts, lens, n)`` returns (res, offs,
    lens, parts): res[6 i:6 i + 6] = status (LANE_FAST or LANE_SLOW), name offset, name
    length, commands, messages (| 1 << 31 when the first command is MPUB), the first
    FAST connection of the call with the same topic name (i: none before); the messages
    of FAST connections, in order, at offs/lens[0, parts) (offsets into buf)."""

    __slots__ = ("_lim", "_max_count", "_offs", "_lens", "_res", "_max_line",
                 "_max_msg", "_max_body", "_views")

    def __init__(self, max_line: int, max_msg_size: int, max_body_size: int,
                 parts_cap: int) -> None:
        self._max_line = check_u32("max_line", max_line)
        self._max_msg = check_u32("max_msg_size", max_msg_size)
        self._max_body = check_u32("max_body_size", max_body_size)
        self._max_count = max(0, (self._max_body - 4) // 5)
        self._offs = array.array("I", bytes(4 * parts_cap))
        self._lens = array.array("I", bytes(4 * parts_cap))
        self._res = array.array("I")
        self._lim: Any = None
        self._views = _LaneViews(self._res, ("uint32_t[]", self._offs),
                                 ("uint32_t[]", self._lens))
        if BACKEND == "c":
            self._lim = _ffi.new("nsqf_limits *", (self._max_line, self._max_msg,
                                                   self._max_body))

    def scan(self, buf: bytearray, starts: "array.array[int]", lens: "array.array[int]",
             n: int) -> "tuple[Sequence[int], Sequence[int], Sequence[int], int]":
        """The buffer must not change size while this scanner reads it (as BatchIO's)."""
        if BACKEND != "c":
            return _pure.pub_lane(buf, starts, lens, n, self._max_line, self._max_msg,
                                  self._max_body, self._max_count, len(self._offs))
        op, ln, rp = self._views.arrays(LANE_FIELDS * n)
        with _ffi.from_buffer("uint32_t[]", starts) as sp, \
                _ffi.from_buffer("uint32_t[]", lens) as lp:
            got = _lib.nsqf_pub_lane(self._views.buffer(buf), sp, lp, n, self._lim,
                                     self._max_count, op, ln, len(self._offs), rp)
        return self._res, self._offs, self._lens, got


class FinLane:
    """The FIN lane's scan (nsqf_fin_lane; csrc/nsqframe.h): one call per loop turn over
    the bytes every subscribed connection sent. Owned by one event loop. ``scan(buf,
    starts, lens, n)`` returns (res, offsets, timeouts, stored): res[i] = how many FIN
    and REQ lines connection i's bytes are (FIN_LANE_SLOW: not only those), their
    offsets and REQ timeouts in ms (-1 for a FIN) in connection order."""

    __slots__ = ("_offs", "_ms", "_res", "_views")

    def __init__(self, cap: int) -> None:
        self._offs = array.array("q", bytes(8 * cap))
        self._ms = array.array("q", bytes(8 * cap))
        self._res = array.array("I")
        self._views = _LaneViews(self._res, ("int64_t[]", self._offs),
                                 ("int64_t[]", self._ms))

    def scan(self, buf: bytearray, starts: "array.array[int]", lens: "array.array[int]",
             n: int) -> "tuple[Sequence[int], Sequence[int], Sequence[int], int]":
        """The buffer must not change size while this scanner reads it."""
        if BACKEND != "c":
            return _pure.fin_lane(buf, starts, lens, n, len(self._offs))
        op, mp, rp = self._views.arrays(n)
        with _ffi.from_buffer("uint32_t[]", starts) as sp, \
                _ffi.from_buffer("uint32_t[]", lens) as lp:
            got = _lib.nsqf_fin_lane(self._views.buffer(buf), sp, lp, n, op, mp,
                                     len(self._offs), rp)
        return self._res, self._offs, self._ms, got


class Scanner:
    """Finds complete NSQ V2 commands in a receive buffer (one per decoder).

    scan(buf, most=0) -> (spans, used, stop): spans = [(line_off, line_len,
    body_off, body_len)] of the complete commands (the first ``most`` when > 0),
    used = bytes they cover, stop = (status, line_off, line_len, value) with status
    NEED_MORE, FULL (``most`` found, bytes left) or an E_* code.
    See csrc/nsqframe.h for the exact rules. Not for concurrent use.
    """

    __slots__ = ("fins", "scan")

    scan: Callable[[bytes | bytearray, int], ScanResult]
    fins: Callable[[bytes | bytearray], "tuple[Sequence[int], int]"]

    def __init__(self, max_line: int, max_msg_size: int, max_body_size: int) -> None:
        impl: CScanner | _pure.Scanner
        if BACKEND == "c":
            impl = CScanner(max_line, max_msg_size, max_body_size)
        else:
            impl = _pure.Scanner(max_line, max_msg_size, max_body_size)
        self.scan = impl.scan
        self.fins = impl.fins


log_build: Callable[..., tuple[bytes | bytearray, Sequence[int]]]
log_scan: Callable[..., tuple[Sequence[int], int, tuple[int, int, int]]]
log_frames: Callable[..., bytes | bytearray]
log_frames_each: Callable[..., bytes | bytearray]
mpub_parts: Callable[..., tuple[Sequence[int], Sequence[int]]]
if BACKEND == "c":
    mpub_split = c_mpub_split
    mpub_parts = c_mpub_parts
    log_build, log_scan, log_frames = c_log_build, c_log_scan, c_log_frames
    log_frames_each = c_log_frames_each
else:
    mpub_split = _pure.mpub_split
    mpub_parts = _pure.mpub_parts
    log_build, log_scan, log_frames = _pure.log_build, _pure.log_scan, _pure.log_frames
    log_frames_each = _pure.log_frames_each
