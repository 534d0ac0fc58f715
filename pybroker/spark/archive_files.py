"""Files written by ``pybroker to-file`` / ``nsq_to_file``: finding, naming, reading them.

A file holds one message body per line; gzip files are a series of gzip members, one
per sync. The writer FINs messages only after a sync, so a file's tail that is not
complete (a last line with no newline, a gzip member with no end) holds messages that
were never acknowledged and will be written again: they are skipped, not read twice.
File names follow ``<TOPIC>.<HOST><REV>.<DATETIME>.log[.gz]``; the topic and the
datetime (``--datetime-format``, local time by default) are taken from them. No pyspark.
"""
from __future__ import annotations

import glob
import os
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import BinaryIO

_NAME_RE = re.compile(r"^(?P<topic>.+)\.(?P<host>[^.]*)\.(?P<dt>[^.]+)\.log(?:\.gz)?$")
_GZIP_MAGIC = b"\x1f\x8b"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class ArchiveFile:
    """One archive file: its path, and what its name says (None when it says nothing)."""

    path: str
    topic: str | None
    timestamp_us: int | None


def parse_name(name: str, datetime_format: str = "%Y-%m-%d_%H",
               utc: bool = False) -> tuple[str, int | None] | None:
    """(topic, timestamp in microseconds or None) from a file name; None if not one.

    The host and the datetime never contain a dot, so the topic is everything before
    the last two dot-separated fields (topic names may contain dots).
    """
    base = os.path.basename(name)
    m = _NAME_RE.match(base)
    if m is None:
        return None
    ts: int | None = None
    try:
        when = datetime.strptime(m.group("dt"), datetime_format)
        if utc:
            when = when.replace(tzinfo=UTC)
        ts = int(when.timestamp()) * 1_000_000
    except ValueError:
        pass
    return m.group("topic"), ts


def _candidates(path: str) -> list[str]:
    if any(c in path for c in "*?["):
        return sorted(p for p in glob.glob(path) if os.path.isfile(p))
    if os.path.isdir(path):
        found: list[str] = []
        for root, dirs, files in os.walk(path):
            dirs[:] = sorted(d for d in dirs if not d.startswith((".", "_")))
            found.extend(os.path.join(root, f) for f in sorted(files)
                         if f.endswith((".log", ".log.gz")) and not f.startswith((".", "_")))
        return found
    if os.path.isfile(path):
        return [path]
    raise FileNotFoundError(f"no such archive file or directory: {path}")


def find_archives(paths: list[str], topic: str = "", datetime_format: str = "%Y-%m-%d_%H",
                  utc: bool = False) -> list[ArchiveFile]:
    """The archive files under ``paths`` (directories are walked), for ``topic`` if set.

    Raises:
        FileNotFoundError: a path names nothing.
    """
    out: list[ArchiveFile] = []
    seen: set[str] = set()
    for path in paths:
        for p in _candidates(path):
            if p in seen:
                continue
            seen.add(p)
            parsed = parse_name(p, datetime_format, utc)
            name_topic, ts = parsed if parsed is not None else (None, None)
            if topic:
                if name_topic != topic and not os.path.basename(p).startswith(topic + "."):
                    continue
                name_topic = topic
            out.append(ArchiveFile(p, name_topic, ts))
    return out


def _gzip_members(f: BinaryIO) -> Iterator[bytes]:
    """The decompressed content of each complete gzip member; a cut-off last one is
    dropped."""
    data = b""
    while True:
        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        parts: list[bytes] = []
        while not d.eof:
            if not data:
                data = f.read(_CHUNK)
                if not data:
                    return                   # ended inside a member: never synced
            parts.append(d.decompress(data))
            data = d.unused_data
        yield b"".join(parts)
        if not data:
            data = f.read(_CHUNK)
            if not data:
                return


def _plain_chunks(f: BinaryIO) -> Iterator[bytes]:
    while True:
        chunk = f.read(_CHUNK)
        if not chunk:
            return
        yield chunk


def read_bodies(path: str) -> Iterator[bytes]:
    """Each message body of an archive file, plain or gzip (detected by its magic)."""
    with open(path, "rb") as f:
        gz = f.read(2) == _GZIP_MAGIC
        f.seek(0)
        chunks = _gzip_members(f) if gz else _plain_chunks(f)
        rest = b""
        for chunk in chunks:
            lines = (rest + chunk).split(b"\n")
            rest = lines.pop()
            yield from lines
        # ``rest`` is a line without its newline: a write still under way, skipped
