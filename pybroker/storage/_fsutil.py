"""Small filesystem helpers for pybroker.storage: atomic replace, directory fsync,
file-name-safe queue names. stdlib only.
"""
from __future__ import annotations

import os
import urllib.parse
from collections.abc import Iterable

from pybroker.storage.fileops import REAL, FileOps

_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-.")
_MAX_SAFE_LEN = 200


def safe_name(name: str) -> str:
    """A file name for a queue name that is safe on any POSIX filesystem.

    Bytes outside ``[A-Za-z0-9_.-]`` are percent-encoded (so ``topic:channel`` becomes
    ``topic%3Achannel``); a leading dot is encoded too, so the result is never hidden,
    ``.`` or ``..``. The mapping is one-to-one and reversed by :func:`unsafe_name`,
    except that names longer than 200 bytes once encoded are cut and given a hash
    suffix (``%~<hex>``), which cannot be produced by the encoding itself.
    """
    if not name:
        raise ValueError("queue name must not be empty")
    out = []
    for i, b in enumerate(name.encode("utf-8")):
        if b in _SAFE and not (i == 0 and b == 0x2E):
            out.append(chr(b))
        else:
            out.append(f"%{b:02X}")
    safe = "".join(out)
    if len(safe) > _MAX_SAFE_LEN:
        import hashlib  # long names only: not loaded at start-up

        digest = hashlib.sha256(name.encode("utf-8")).hexdigest()[:24]
        safe = safe[:_MAX_SAFE_LEN - 26] + "%~" + digest
    return safe


def unsafe_name(safe: str) -> str | None:
    """The queue name for a safe name, or None if it was hashed (read it from meta)."""
    if "%~" in safe:
        return None
    return urllib.parse.unquote(safe, errors="strict")


def fsync_dir(path: str) -> None:
    """fsync a directory so that renames, creations and deletions in it are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tmp_path(path: str) -> str:
    """A unique temporary path next to ``path`` (same directory, so rename is atomic)."""
    return f"{path}.{os.urandom(6).hex()}.tmp"


def atomic_write(path: str, data: bytes | Iterable[bytes | memoryview], *,
                 sync_dir: bool = True, ops: FileOps = REAL) -> None:
    """Replace ``path`` with ``data`` (bytes, or pieces of it written in turn)
    atomically: temp file, fsync, rename, fsync dir. The temp file is opened, written,
    synced and closed through ``ops`` (the storage fault seam: pybroker.storage.fileops).

    A crash leaves either the old content or the new, never a mix. Raises OSError.
    """
    tmp = tmp_path(path)
    fd = ops.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        at = 0
        for piece in ((data,) if isinstance(data, bytes) else data):
            at = pwrite_all(ops, fd, piece, at, tmp)
        ops.fsync(fd)
    except BaseException:
        ops.close(fd)
        _unlink_quietly(tmp)
        raise
    ops.close(fd)
    try:
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    if sync_dir:
        fsync_dir(os.path.dirname(path) or ".")


def pwrite_all(ops: FileOps, fd: int, data: bytes | memoryview, at: int, path: str) -> int:
    """Write all of ``data`` at ``at`` (a short write goes on from where it stopped);
    returns the offset after it. Raises OSError (also for a write of nothing)."""
    view = memoryview(data)
    while view:
        n = ops.pwrite(fd, view, at)
        if n <= 0:
            raise OSError(f"a write of {path} wrote nothing")
        view = view[n:]
        at += n
    return at


def unique_aside(path: str, suffix: str) -> str:
    """``path + suffix``, or ``path + suffix + '.N'`` if that already exists."""
    cand = path + suffix
    n = 1
    while os.path.lexists(cand):
        cand = f"{path}{suffix}.{n}"
        n += 1
    return cand


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
