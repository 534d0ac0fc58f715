"""DataPathLock: one broker per data_path, held with an OS file lock (stdlib only).

nsqd refuses a second instance on the same data path ("failed to lock data-path"); so
does pybroker. The lock is ``flock(LOCK_EX | LOCK_NB)`` on ``<data_path>/.pybroker.lock``,
held by an open descriptor for the life of the process (the kernel drops it when the
process exits, however it exits, so a crash never leaves a stale lock). The file holds
the PID of the holder, for people.

Taken by the main thread at start-up; held, untouched, for the life of the process.
"""
from __future__ import annotations

import fcntl
import os


class DataPathLocked(OSError):
    """Another process holds the data_path's lock."""


class DataPathLock:
    def __init__(self, data_path: str) -> None:
        self.path = os.path.join(data_path, ".pybroker.lock")
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock; raises DataPathLocked if another process has it, OSError if
        the file cannot be made."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            os.close(fd)
            who = f" (PID {holder})" if holder.isdigit() else ""
            raise DataPathLocked(f"failed to lock data-path {os.path.dirname(self.path)}: "
                                 f"in use by another pybroker{who}") from None
        except OSError:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
