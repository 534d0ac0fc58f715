"""Errors raised by pybroker.storage (stdlib only; the broker core translates them).

Data damage found while reading is never raised: it is logged and worked around.
What is raised is an operating-system failure the caller must act on (disk full,
permissions, a path that is not a directory), a format this code cannot read, or
use of a closed queue.
"""
from __future__ import annotations

import errno as _errno

_FULL = {_errno.ENOSPC, _errno.EDQUOT, _errno.EFBIG}
_ACCESS = {_errno.EACCES, _errno.EPERM, _errno.EROFS}


class StorageError(Exception):
    """Base class: a storage operation failed; existing data was left intact.

    Attributes:
        path: the file or directory involved, if known.
        errno: the OS error number, if the cause was an OSError.
        epoch: for a topic log's write or sync, the write epoch whose records it
            failed (0 otherwise).
    """

    def __init__(self, message: str, *, path: str | None = None,
                 errno: int | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.errno = errno
        self.epoch = 0


class DiskFullError(StorageError):
    """No room to write: ENOSPC, EDQUOT or EFBIG (file size limit)."""


class StorageAccessError(StorageError):
    """Not allowed to write: EACCES, EPERM or EROFS."""


class StorageIOError(StorageError):
    """Every other OS error (EIO, ENOTDIR, ENOENT on a data file, ...)."""


class MetadataError(StorageError):
    """The metadata file could not be read or written."""


def from_oserror(what: str, path: str, err: OSError) -> StorageError:
    """Map an OSError to the matching StorageError subclass with a clear message."""
    num = err.errno
    cls: type[StorageError]
    if num in _FULL:
        cls = DiskFullError
    elif num in _ACCESS:
        cls = StorageAccessError
    else:
        cls = StorageIOError
    name = _errno.errorcode.get(num, "?") if num is not None else "?"
    return cls(f"{what} {path}: [{name}] {err.strerror or err}", path=path, errno=num)
