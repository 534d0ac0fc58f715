"""The C frame codec's Python boundary: the only importer of _nsqframe.

Exposes Scanner, mpub_split and encode_messages backed by csrc/nsqframe.c,
or by the pure-Python spec in _pure when PYBROKER_PURE=1 (BACKEND says which).
Without PYBROKER_PURE, a missing compiled module is an ImportError: there is
no silent fallback. Each function crosses into C once per call; scratch
arrays belong to a Scanner, never to this module (cffi releases the GIL, so
several threads may be inside C at once).
"""

from __future__ import annotations

import array
import importlib
import os
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
    "ScanError",
    "ScanResult",
    "Scanner",
    "Span",
    "Stop",
    "c_backend",
    "encode_messages",
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


def _check_header() -> None:
    """Refuse a compiled module built from a different header than _pure's."""
    names = [
        "NEED_MORE", "FULL", "E_LINE_TOO_LONG", "E_MSG_SIZE", "E_BODY_SIZE",
        "E_MPUB_COUNT_READ", "E_MPUB_COUNT", "E_MPUB_PART_READ", "E_MPUB_PART_SIZE",
        "E_MPUB_PART_BIG", "E_MPUB_PART_SHORT", "E_MPUB_TRAILING", "E_CAPACITY",
        "E_FRAME_SIZE",
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

    __slots__ = ("_cap", "_lim", "_out", "_out_buf", "_stop", "_used", "_words")

    def __init__(self, max_line: int, max_msg_size: int, max_body_size: int) -> None:
        limits = (
            check_u32("max_line", max_line),
            check_u32("max_msg_size", max_msg_size),
            check_u32("max_body_size", max_body_size),
        )
        self._lim = _ffi.new("nsqf_limits *", limits)
        self._used = _ffi.new("size_t *")
        self._stop = _ffi.new("nsqf_stop *")
        self._grow(_SCAN_CAP_MIN)

    def _grow(self, cap: int) -> None:
        # An array('I') read back with one slice is the cheapest way found to
        # turn C spans into tuples (cdata field reads cost ~4x more).
        self._cap = cap
        self._words = array.array("I", bytes(4 * _SPAN_WORDS * cap))
        self._out_buf = _ffi.from_buffer(self._words)  # keeps the export alive
        self._out = _ffi.cast("nsqf_span *", self._out_buf)

    def scan(self, buf: bytes | bytearray) -> ScanResult:
        """Find every complete command in buf; see _pure.Scanner.scan."""
        length = min(len(buf), _U32_MAX)
        stop = self._stop
        used = self._used
        # Release the buffer export before returning, so that the caller may
        # resize a bytearray right after (del buf[:used]).
        with _ffi.from_buffer("uint8_t[]", buf) as ptr:
            n = _lib.nsqf_scan(ptr, length, self._lim, self._out, self._cap, used, stop)
            it = iter(self._words[: _SPAN_WORDS * n])
            spans: list[Span] = list(zip(it, it, it, it))
            base = 0
            while stop.status == _pure.FULL:
                base += used[0]
                if self._cap < _SCAN_CAP_MAX:
                    self._grow(self._cap * 2)
                n = _lib.nsqf_scan(
                    ptr + base, length - base, self._lim, self._out, self._cap, used, stop
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
    offs = array.array("I", bytes(4 * cap))
    lens = array.array("I", bytes(4 * cap))
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
    pairs = zip(offs[:n], lens[:n], strict=True)
    if isinstance(src, memoryview):
        return [src[o : o + s].tobytes() for o, s in pairs]
    return [src[o : o + s] for o, s in pairs]


def c_encode_messages(msgs: Sequence[object]) -> bytes:
    """nsqf_encode_messages; same contract as _pure.encode_messages."""
    n = len(msgs)
    if n == 0:
        return b""
    # Measured (100 x 200-byte bodies): one pass of list.append, then
    # array.array + ffi.from_buffer for the integer columns, beat passing
    # Python lists (cffi converts element by element), ffi.new from lists,
    # attrgetter + zip, and a cdata pointer per body.
    bodies: list[bytes] = []
    ts_ns: list[int] = []
    attempts: list[int] = []
    ids: list[bytes] = []
    for m in msgs:
        bodies.append(m.body)  # type: ignore[attr-defined]
        ts_ns.append(m.ts_ns)  # type: ignore[attr-defined]
        attempts.append(m.attempts)  # type: ignore[attr-defined]
        ids.append(m.id)  # type: ignore[attr-defined]
    joined_ids = b"".join(ids)
    if len(joined_ids) != 16 * n or max(map(len, ids)) != 16:
        bad = next(len(i) for i in ids if len(i) != 16)
        raise ValueError(f"message id must be 16 bytes, got {bad}")
    blob = b"".join(bodies)
    try:
        lens = array.array("I", map(len, bodies))
        ts_col = array.array("q", ts_ns)
        attempts_col = array.array("H", attempts)
    except OverflowError as exc:
        raise ValueError(f"message field out of range: {exc}") from exc
    if sum(lens) != len(blob):  # e.g. a memoryview of non-byte items
        raise ValueError("message bodies must be bytes")
    total = 34 * n + len(blob)
    out = bytearray(total)
    fb = _ffi.from_buffer
    r = _lib.nsqf_encode_messages(
        fb("uint8_t[]", out),
        total,
        n,
        fb("int64_t[]", ts_col),
        fb("uint16_t[]", attempts_col),
        joined_ids,
        blob,
        fb("uint32_t[]", lens),
    )
    if r != total:
        raise ValueError(f"message body too large to frame (code {r})")
    return bytes(out)


class CBackend:
    """The C-backed functions under the same names as the _pure module."""

    name = "c"
    Scanner = CScanner
    ScanError = ScanError
    mpub_split = staticmethod(c_mpub_split)
    encode_messages = staticmethod(c_encode_messages)
    ffi: Any = _ffi
    lib: Any = _lib


c_backend: CBackend | None = None
if _lib is not None:
    _check_header()
    c_backend = CBackend()

_force_pure = os.environ.get("PYBROKER_PURE", "") not in ("", "0")
if c_backend is None and not _force_pure:
    raise ImportError(
        "pybroker's C frame codec (pybroker._native._nsqframe) is not built: "
        "run `pip install -e .` (needs a C compiler and cffi), or set "
        f"PYBROKER_PURE=1 to use the pure-Python codec ({_import_error})"
    )

BACKEND: str = "pure" if _force_pure else "c"


class Scanner:
    """Finds complete NSQ V2 commands in a receive buffer (one per decoder).

    scan(buf) -> (spans, used, stop): spans = [(line_off, line_len, body_off,
    body_len)] of the complete commands, used = bytes they cover, stop =
    (status, line_off, line_len, value) with status NEED_MORE or an E_* code.
    See csrc/nsqframe.h for the exact rules. Not for concurrent use.
    """

    __slots__ = ("scan",)

    scan: Callable[[bytes | bytearray], ScanResult]

    def __init__(self, max_line: int, max_msg_size: int, max_body_size: int) -> None:
        impl: CScanner | _pure.Scanner
        if BACKEND == "c":
            impl = CScanner(max_line, max_msg_size, max_body_size)
        else:
            impl = _pure.Scanner(max_line, max_msg_size, max_body_size)
        self.scan = impl.scan


if BACKEND == "c":
    mpub_split = c_mpub_split
    encode_messages = c_encode_messages
else:
    mpub_split = _pure.mpub_split
    encode_messages = _pure.encode_messages
