"""Pure-Python NSQ V2 frame codec: the executable spec of csrc/nsqframe.c.

Same functions, results and errors as the C backend in pybroker._native; used
when PYBROKER_PURE=1 and by the parity tests. Imports only the stdlib.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence

# Values mirror csrc/nsqframe.h (build.py exposes the header's; tests compare).
NEED_MORE = 0
FULL = 1
E_LINE_TOO_LONG = -1
E_MSG_SIZE = -2
E_BODY_SIZE = -3
E_MPUB_COUNT_READ = -10
E_MPUB_COUNT = -11
E_MPUB_PART_READ = -12
E_MPUB_PART_SIZE = -13
E_MPUB_PART_BIG = -14
E_MPUB_PART_SHORT = -15
E_MPUB_TRAILING = -16
E_CAPACITY = -20
E_FRAME_SIZE = -21
MAX_BODY = 0x7FFFFFFF - 30

_U32_MAX = 0xFFFFFFFF

Span = tuple[int, int, int, int]
"""(line_off, line_len, body_off, body_len); body_* are 0 for bodiless verbs."""
Stop = tuple[int, int, int, int]
"""(status, line_off, line_len, value) describing why a scan stopped."""

_MSG_VERBS = frozenset((b"PUB", b"DPUB"))
_LARGE_VERBS = frozenset((b"MPUB", b"IDENTIFY", b"AUTH"))
_I32 = struct.Struct(">i")


class ScanError(Exception):
    """A framing error from mpub_split (and the code behind a scan stop).

    Attributes:
        code: a negative E_* constant.
        index: the MPUB part the error is about (0 when not about a part).
        value: the offending size or count, or the number of trailing bytes.
    """

    def __init__(self, code: int, index: int = 0, value: int = 0) -> None:
        super().__init__(code, index, value)
        self.code = code
        self.index = index
        self.value = value

    def __str__(self) -> str:
        return f"frame error {self.code} (index {self.index}, value {self.value})"


def check_u32(name: str, value: int) -> int:
    """Return value if it fits a uint32 limit, else raise ValueError."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if not 0 <= value <= _U32_MAX:
        raise ValueError(f"{name} {value} out of range 0-{_U32_MAX}")
    return value


class Scanner:
    """Finds complete NSQ V2 commands in a receive buffer.

    Owned by one connection decoder; not for concurrent use by two threads.
    """

    __slots__ = ("max_body_size", "max_line", "max_msg_size")

    def __init__(self, max_line: int, max_msg_size: int, max_body_size: int) -> None:
        self.max_line = check_u32("max_line", max_line)
        self.max_msg_size = check_u32("max_msg_size", max_msg_size)
        self.max_body_size = check_u32("max_body_size", max_body_size)

    def fins(self, buf: bytes | bytearray) -> tuple[list[int], int]:
        """The run of FIN lines at the start of buf (see nsqf_scan_fins): the value
        of each id when it is 16 lowercase hex digits (else -1), and the bytes used."""
        return scan_fins(buf)

    def scan(self, buf: bytes | bytearray, most: int = 0) -> tuple[list[Span], int, Stop]:
        """Find every complete command in buf, or the first ``most`` when > 0.

        Returns:
            (spans, used, stop): spans of the complete commands in order, the
            bytes they cover, and (status, line_off, line_len, value) where
            status is NEED_MORE, FULL (``most`` commands found, bytes left after
            them) or a negative E_* code; see nsqframe.h.
        """
        max_line = self.max_line
        end = min(len(buf), _U32_MAX)
        spans: list[Span] = []
        pos = 0
        while True:
            if pos == end:
                return spans, pos, (NEED_MORE, pos, 0, 0)
            if 0 < most <= len(spans):
                return spans, pos, (FULL, pos, 0, 0)
            # The '\n' may be at most max_line bytes after the line's start.
            nl = buf.find(b"\n", pos, min(end, pos + max_line + 1))
            if nl < 0:
                status = E_LINE_TOO_LONG if end - pos > max_line else NEED_MORE
                return spans, pos, (status, pos, 0, 0)
            nxt = nl + 1
            line_end = nl - 1 if nl > pos and buf[nl - 1] == 13 else nl
            line_len = line_end - pos
            sp = buf.find(b" ", pos, line_end)
            verb = bytes(buf[pos : line_end if sp < 0 else sp])
            if verb in _MSG_VERBS:
                limit, code = self.max_msg_size, E_MSG_SIZE
            elif verb in _LARGE_VERBS:
                limit, code = self.max_body_size, E_BODY_SIZE
            else:
                spans.append((pos, line_len, 0, 0))
                pos = nxt
                continue
            if end - nxt < 4:
                return spans, pos, (NEED_MORE, pos, line_len, 0)
            (size,) = _I32.unpack_from(buf, nxt)
            if size <= 0 or size > limit:
                return spans, pos, (code, pos, line_len, size)
            body_off = nxt + 4
            if end - body_off < size:
                return spans, pos, (NEED_MORE, pos, line_len, size)
            spans.append((pos, line_len, body_off, size))
            pos = body_off + size


def mpub_parts(
    body: bytes | bytearray | memoryview, max_msg_size: int, max_count: int
) -> tuple[list[int], list[int]]:
    """mpub_split's checks, returning the parts as (offsets, lengths) into body."""
    offs: list[int] = []
    lens: list[int] = []
    mv = memoryview(body).cast("B")
    pos = 4
    for part in mpub_split(mv, max_msg_size, max_count):
        pos += 4
        offs.append(pos)
        lens.append(len(part))
        pos += len(part)
    return offs, lens


def mpub_split(
    body: bytes | bytearray | memoryview, max_msg_size: int, max_count: int
) -> list[bytes]:
    """Validate an MPUB body [int32 n]([int32 size][data])* and split it.

    Checks in nsqd's order: count read, 1 <= count <= max_count, then per
    part: size read, size > 0, size <= max_msg_size, data present; then no
    trailing bytes.

    Returns:
        The parts, as bytes.
    Raises:
        ScanError: code E_MPUB_*, index = part, value as in nsqframe.h.
    """
    check_u32("max_msg_size", max_msg_size)
    check_u32("max_count", max_count)
    mv = memoryview(body).cast("B")
    end = min(len(mv), _U32_MAX)
    if end < 4:
        raise ScanError(E_MPUB_COUNT_READ, 0, 0)
    (count,) = _I32.unpack_from(mv, 0)
    if count <= 0 or count > max_count:
        raise ScanError(E_MPUB_COUNT, 0, count)
    parts: list[bytes] = []
    pos = 4
    for i in range(count):
        if end - pos < 4:
            raise ScanError(E_MPUB_PART_READ, i, 0)
        (size,) = _I32.unpack_from(mv, pos)
        pos += 4
        if size <= 0:
            raise ScanError(E_MPUB_PART_SIZE, i, size)
        if size > max_msg_size:
            raise ScanError(E_MPUB_PART_BIG, i, size)
        if end - pos < size:
            raise ScanError(E_MPUB_PART_SHORT, i, size)
        parts.append(bytes(mv[pos : pos + size]))
        pos += size
    if pos != end:
        raise ScanError(E_MPUB_TRAILING, count, end - pos)
    return parts


_HEX_LOWER = frozenset(b"0123456789abcdef")


def scan_fins(buf: bytes | bytearray) -> tuple[list[int], int]:
    """The spec of nsqf_scan_fins: complete 21-byte "FIN <16 bytes>\\n" lines at the
    start of buf -> (offsets, used); an id that is not 16 lowercase hex digits gives
    -1; an id holding a space or newline ends the run (not one parameter)."""
    out: list[int] = []
    pos = 0
    end = len(buf)
    while end - pos >= 21:
        if buf[pos:pos + 4] != b"FIN " or buf[pos + 20] != 0x0A:
            break
        mid = bytes(buf[pos + 4:pos + 20])
        if b" " in mid or b"\n" in mid:
            break
        v = int(mid, 16) if _HEX_LOWER.issuperset(mid) else -1
        out.append(v if v < 1 << 63 else -1)
        pos += 21
    return out, pos


# -- topic log records (spec of nsqf_log_build, nsqf_log_scan, nsqf_log_frames) --------------
REC_HEADER = 16
PAYLOAD_HEAD = 34
LOG_END = 0
LOG_PARTIAL = 1
LOG_FULL = 2
LOG_BAD_LENGTH = -30
LOG_BAD_CRC = -31
LOG_BAD_OFFSET = -32
_REC = struct.Struct(">IIQqqH")
_REC_HEAD = struct.Struct(">IIQ")
_LEN_OFF = struct.Struct(">IQ")


def log_build(first: int, ts_ns: int, deliver_at_ns: int, src: bytes | bytearray | memoryview,
              offs: Sequence[int], lens: Sequence[int]) -> tuple[bytes, list[int]]:
    """Records for bodies src[offs[i]:offs[i]+lens[i]] with offsets first, first+1, ...
    -> (the records back to back, where each starts)."""
    out = []
    pos = []
    at = 0
    for i, (o, n) in enumerate(zip(offs, lens)):
        off = first + i
        payload = (struct.pack(">qqH", deliver_at_ns, ts_ns, 0) + b"%016x" % off
                   + bytes(src[o:o + n]))
        head = _LEN_OFF.pack(len(payload), off)
        rec = struct.pack(">I", zlib.crc32(payload, zlib.crc32(head))) + head + payload
        pos.append(at)
        at += len(rec)
        out.append(rec)
    return b"".join(out), pos


def log_scan(buf: bytes | memoryview, first: int, check_crc: bool, max_payload: int,
             cap: int) -> tuple[list[int], int, tuple[int, int, int]]:
    """Records back to back in buf, the first with offset ``first`` ->
    (starts, bytes used, (status, deferred count, max ts))."""
    pos: list[int] = []
    at = 0
    end = len(buf)
    deferred = 0
    max_ts = 0
    status = LOG_END
    while at < end:
        if len(pos) >= cap:
            status = LOG_FULL
            break
        if end - at < REC_HEADER:
            status = LOG_PARTIAL
            break
        crc, plen, off = _REC_HEAD.unpack_from(buf, at)
        if plen < PAYLOAD_HEAD or plen > max_payload:
            status = LOG_BAD_LENGTH
            break
        if end - at - REC_HEADER < plen:
            status = LOG_PARTIAL
            break
        if off != first + len(pos):
            status = LOG_BAD_OFFSET
            break
        if check_crc and zlib.crc32(bytes(buf[at + 4:at + REC_HEADER + plen])) != crc:
            status = LOG_BAD_CRC
            break
        _, _, _, deliver_at, ts, _ = _REC.unpack_from(buf, at)
        if deliver_at:
            deferred += 1
        max_ts = max(max_ts, ts)
        pos.append(at)
        at += REC_HEADER + plen
    return pos, at, (status, deferred, max_ts)


def log_frames(buf: bytes | memoryview, pos: Sequence[int], attempts: int) -> bytes:
    """Message frames for the records starting at buf[p] for p in pos; attempts < 0:
    each record's stored attempts + 1."""
    return _frames(buf, pos, [1] * len(pos) if attempts < 0 else None, attempts)


def log_frames_each(buf: bytes | memoryview, pos: Sequence[int],
                    adds: Sequence[int]) -> bytes:
    """Message frames as log_frames makes them, record i's attempts its stored
    attempts + adds[i]."""
    if len(adds) != len(pos):
        raise ValueError("log_frames_each: one add a record")
    return _frames(buf, pos, adds, 0)


def _frames(buf: bytes | memoryview, pos: Sequence[int], adds: Sequence[int] | None,
            attempts: int) -> bytes:
    out = []
    for k, p in enumerate(pos):
        plen = int.from_bytes(buf[p + 4:p + 8], "big")
        msg = bytearray(buf[p + 24:p + REC_HEADER + plen])
        a = int.from_bytes(msg[8:10], "big") + adds[k] if adds is not None else attempts
        msg[8:10] = min(a, 0xFFFF).to_bytes(2, "big")
        out.append(struct.pack(">ii", len(msg) + 4, 2) + bytes(msg))
    return b"".join(out)


# -- the publish lane (csrc/nsqframe.h nsqf_pub_lane) ----------------------------------
LANE_FAST = 0
LANE_SLOW = 1
LANE_FIELDS = 6
LANE_NAMES = 16      # distinct names matched per call (res field 5)
_LANE_NAME = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-#")


def _lane_one(buf: bytes | bytearray | memoryview, start: int, length: int, max_line: int,
              max_msg: int, max_body: int, max_count: int,
              parts: list[tuple[int, int]], cap: int) -> tuple[int, int, int, int] | None:
    """One connection's bytes: (name offset, name length, commands, flags|messages) with
    its parts appended to ``parts``, or None (SLOW; ``parts`` as it was)."""
    end_all = start + length
    pos = start
    mark = len(parts)
    cmds = 0
    name_off = name_len = first_mpub = 0
    if length == 0:
        return None
    while pos < end_all:
        at = pos
        if bytes(buf[at:at + 4]) == b"PUB ":
            mpub, name = 0, at + 4
        elif bytes(buf[at:at + 5]) == b"MPUB ":
            mpub, name = 1, at + 5
        else:
            break
        end = name
        while end < end_all and end - at < max_line and buf[end] in _LANE_NAME:
            end += 1
        if end >= end_all or buf[end] != 0x0A or end == name:
            break
        if cmds == 0:
            name_off, name_len, first_mpub = name, end - name, mpub
        elif end - name != name_len or bytes(buf[name:end]) != bytes(
                buf[name_off:name_off + name_len]):
            break
        pos = end + 1
        if end_all - pos < 4:
            break
        size = int.from_bytes(buf[pos:pos + 4], "big", signed=True)
        pos += 4
        if size <= 0 or size > (max_body if mpub else max_msg) or end_all - pos < size:
            break
        if not mpub:
            if len(parts) >= cap:
                break
            parts.append((pos, size))
        else:
            blen, bp = size, 4
            if blen < 4:
                break
            count = int.from_bytes(buf[pos:pos + 4], "big", signed=True)
            if count <= 0 or count > max_count or count > cap - len(parts):
                break
            ok = True
            for _ in range(count):
                if blen - bp < 4:
                    ok = False
                    break
                part = int.from_bytes(buf[pos + bp:pos + bp + 4], "big", signed=True)
                bp += 4
                if part <= 0 or part > max_msg or blen - bp < part:
                    ok = False
                    break
                parts.append((pos + bp, part))
                bp += part
            if not ok or bp != blen:
                break
        pos += size
        cmds += 1
    else:
        return name_off, name_len, cmds, (len(parts) - mark) | (first_mpub << 31)
    del parts[mark:]
    return None


def pub_lane(buf: bytes | bytearray | memoryview, starts: Sequence[int],
             lens_in: Sequence[int], n: int, max_line: int, max_msg: int, max_body: int,
             max_count: int, parts_cap: int) -> tuple[list[int], list[int], list[int], int]:
    """nsqf_pub_lane's spec: (res, offs, lens, parts stored)."""
    res = [0] * (LANE_FIELDS * n)
    parts: list[tuple[int, int]] = []
    firsts: dict[bytes, int] = {}    # name -> its first FAST connection
    for i in range(n):
        k = LANE_FIELDS * i
        res[k + 5] = i
        r = _lane_one(buf, starts[i], lens_in[i], max_line, max_msg, max_body, max_count,
                      parts, parts_cap)
        if r is None:
            res[k] = LANE_SLOW
            continue
        res[k + 1:k + 5] = r
        name = bytes(buf[r[0]:r[0] + r[1]])
        if name in firsts:
            res[k + 5] = firsts[name]
        elif len(firsts) < LANE_NAMES:
            firsts[name] = i
    return res, [p[0] for p in parts], [p[1] for p in parts], len(parts)


FIN_LANE_SLOW = 0xFFFFFFFF


def fin_lane(buf: bytes | bytearray | memoryview, starts: Sequence[int],
             lens_in: Sequence[int], n: int, cap: int
             ) -> tuple[list[int], list[int], list[int], int]:
    """nsqf_fin_lane's spec: (res, offsets, timeouts (-1: a FIN), lines stored)."""
    res = [0] * n
    offs: list[int] = []
    ms: list[int] = []
    for i in range(n):
        data = bytes(buf[starts[i]:starts[i] + lens_in[i]])
        lines = _ack_lines(data, cap - len(offs))
        if lines is None:
            res[i] = FIN_LANE_SLOW
            continue
        res[i] = len(lines)
        offs += [off for off, _ in lines]
        ms += [t for _, t in lines]
    return res, offs, ms, len(offs)


def _ack_lines(data: bytes, room: int) -> list[tuple[int, int]] | None:
    """A connection's bytes as FIN and REQ lines, (offset, timeout or -1), at most
    room of them; None: not only such lines."""
    if not data:
        return None
    out: list[tuple[int, int]] = []
    pos = 0
    while pos < len(data):
        if len(out) >= room:
            return None
        fins, used = scan_fins(data[pos:])
        if fins:
            if len(out) + len(fins) > room:
                return None
            out += [(off, -1) for off in fins]
            pos += used
            continue
        end = data.find(b"\n", pos)
        line = data[pos:end] if end >= 0 else b""
        parts = line.split(b" ")
        if (len(parts) != 3 or parts[0] != b"REQ" or len(parts[1]) != 16
                or not _HEX_LOWER.issuperset(parts[1]) or int(parts[1], 16) >= 1 << 63
                or not 1 <= len(parts[2]) <= 18 or not parts[2].isdigit()):
            return None
        out.append((int(parts[1], 16), int(parts[2])))
        pos = end + 1
    return out
