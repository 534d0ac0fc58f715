"""File naming and writing for ``pybroker to-file``, as nsq_to_file names and writes files.

Owns: the filename format (``<TOPIC> <HOST> <PID> <DATETIME> <REV>``), Go-compatible
strftime, the gzip member writer (one gzip member per sync, so a file's complete
members mark exactly what was acknowledged), and the exclusive move of finished files.
No consumer or thread here.
"""
from __future__ import annotations

import os
import socket
import struct
import time
import zlib
from typing import BinaryIO

_MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August",
           "September", "October", "November", "December"]
_DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


def strftime(fmt: str, ts: float | None = None) -> str:
    """strftime with exactly the directives nsq_to_file knows; others pass through as-is.

    %B %b %m %A %a %d %H %I %M %S %Y %y %p %Z %z %% in local time, English names.
    """
    t = time.localtime(time.time() if ts is None else ts)
    hour12 = t.tm_hour % 12 or 12
    off = t.tm_gmtoff or 0
    sign = "-" if off < 0 else "+"
    off = abs(off)
    table = {
        "B": _MONTHS[t.tm_mon - 1], "b": _MONTHS[t.tm_mon - 1][:3], "m": f"{t.tm_mon:02d}",
        "A": _DAYS[t.tm_wday], "a": _DAYS[t.tm_wday][:3], "d": f"{t.tm_mday:02d}",
        "H": f"{t.tm_hour:02d}", "I": f"{hour12:02d}", "M": f"{t.tm_min:02d}",
        "S": f"{t.tm_sec:02d}", "Y": f"{t.tm_year:04d}", "y": f"{t.tm_year % 100:02d}",
        "p": "PM" if t.tm_hour >= 12 else "AM", "Z": t.tm_zone or "",
        "z": f"{sign}{off // 3600:02d}{off % 3600 // 60:02d}", "%": "%",
    }
    out: list[str] = []
    i = 0
    while i < len(fmt):
        if fmt[i] == "%" and i + 1 < len(fmt) and fmt[i + 1] in table:
            out.append(table[fmt[i + 1]])
            i += 2
        else:
            out.append(fmt[i])
            i += 1
    return "".join(out)


def host_identifier(template: str = "") -> str:
    """``<HOST>``: the short hostname, or ``--host-identifier`` with its tokens."""
    hostname = socket.gethostname()
    short = hostname.split(".")[0]
    if not template:
        return short
    return template.replace("<SHORT_HOST>", short).replace("<HOSTNAME>", hostname)


def compute_filename_format(fmt: str, topic: str, *, gzip: bool, rotating: bool,
                            work_dir_differs: bool, host: str) -> str:
    """Fill in everything but ``<DATETIME>`` and ``<REV>`` (nsq_to_file's rules).

    ``<REV>`` is required when gzip, rotation or a separate work dir is used (files are
    then never reopened) and removed otherwise; ``.gz`` is appended for gzip.

    Raises:
        ValueError: ``<REV>`` is missing but required.
    """
    if gzip or rotating or work_dir_differs:
        if "<REV>" not in fmt:
            raise ValueError("missing <REV> in --filename-format when gzip, rotation, "
                             "or work dir enabled")
    else:
        fmt = fmt.replace("<REV>", "")
    fmt = fmt.replace("<TOPIC>", topic).replace("<HOST>", host)
    fmt = fmt.replace("<PID>", str(os.getpid()))
    if gzip and not fmt.endswith(".gz"):
        fmt += ".gz"
    return fmt


def with_rev(path: str, rev: int) -> str:
    return path.replace("<REV>", f"-{rev:06d}")


def make_parent_dir(path: str) -> None:
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, 0o770, exist_ok=True)


def exclusive_rename(src: str, dst: str) -> None:
    """Move ``src`` to ``dst`` without ever replacing ``dst`` (link, then unlink).

    Raises:
        FileExistsError: ``dst`` exists.
    """
    os.link(src, dst)
    os.remove(src)


class GzipMemberWriter:
    """Writes one gzip member to ``out``, header first, as Go's compress/gzip does.

    The header is Go's (no name, mtime 0, XFL 2 for level 9 and 4 for level 1, OS 255);
    ``close()`` ends the member with its CRC-32 and size and always yields a complete
    member, even an empty one.
    """

    def __init__(self, out: BinaryIO, level: int) -> None:
        self.out = out
        self.level = level
        self._z = zlib.compressobj(level, zlib.DEFLATED, -15)
        self._crc = 0
        self._size = 0
        self._wrote_header = False

    def _header(self) -> None:
        xfl = 2 if self.level == 9 else 4 if self.level == 1 else 0
        self.out.write(b"\x1f\x8b\x08\x00" + struct.pack("<I", 0) + bytes([xfl, 255]))
        self._wrote_header = True

    def write(self, data: bytes) -> int:
        if not self._wrote_header:
            self._header()
        self._crc = zlib.crc32(data, self._crc)
        self._size += len(data)
        self.out.write(self._z.compress(data))
        return len(data)

    def close(self) -> None:
        if not self._wrote_header:
            self._header()
        self.out.write(self._z.flush(zlib.Z_FINISH))
        self.out.write(struct.pack("<II", self._crc & 0xFFFFFFFF, self._size & 0xFFFFFFFF))
