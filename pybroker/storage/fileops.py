"""FileOps: the file operations of a topic log's write side, and the fault seam on them.

A TopicLog opens, writes, syncs and cuts back its segment files only through a FileOps
object (``open``, ``pwrite``, ``fsync``, ``ftruncate``, ``dup``, ``close``); so do the
channel states' whole writes (``_fsutil.atomic_write``'s temporary file) and their
journals' appends (pybroker.storage.statejournal). The default
(``REAL``) calls the os module. A ``FaultyFileOps`` runs a *fault plan*: rules that make
chosen calls fail the way a failing disk does, deterministically, so that tests reach
every failure path of the publish path without filling a disk:

- ``ENOSPC``, ``EDQUOT``, ``EFBIG``, ``EIO``, ``EROFS``: the call raises that OSError;
- ``short`` (pwrite only): half the bytes (at least one) are written and the count is
  returned, as a write that ran into a full disk does;
- ``zero`` (pwrite only): nothing is written and 0 is returned;
- ``slow`` (fsync only): the call waits ``ms=N`` milliseconds (at most MAX_SLOW_MS),
  then syncs, as a disk that turns slow does; nothing fails.

A rule matches calls of one operation, optionally only on files whose path contains a
string, optionally only while a file exists; of the calls it matches, it fails the
``nth`` (1-based) and the ``count - 1`` after it (``count=0``: all from the nth on).
Every rule counts every call it matches; when several fail one call, the first wins.

Tests in this process build plans directly (``FaultyFileOps([Fault(...)])``). A broker
process arms a plan from the environment at start-up (``from_environment``): the
variable ``PYBROKER_FAULTS`` holds rules separated by ``;``, each a list of
``key=value`` words, e.g.::

    PYBROKER_FAULTS="op=pwrite kind=ENOSPC while=/tmp/t/full path=/topics/orders"
    PYBROKER_FAULTS="op=fsync kind=EIO nth=3 count=2; op=pwrite kind=short nth=1"
    PYBROKER_FAULTS="op=fsync kind=slow ms=50 count=0 while=/tmp/t/slow"

This is a test facility: a broker with a plan armed says so in its log at start-up.
Budgets: a plan holds at most ``MAX_RULES`` rules; ``while=`` costs one ``stat`` per
matching call, ``path=`` a dict lookup.
"""
from __future__ import annotations

import errno
import os
import threading
import time
from dataclasses import dataclass, field

ENV = "PYBROKER_FAULTS"
OPS = ("open", "pwrite", "fsync", "ftruncate")
KINDS = {"ENOSPC": errno.ENOSPC, "EDQUOT": errno.EDQUOT, "EFBIG": errno.EFBIG,
         "EIO": errno.EIO, "EROFS": errno.EROFS, "short": 0, "zero": 0, "slow": 0}
MAX_RULES = 32
MAX_SLOW_MS = 10_000


class FileOps:
    """The real file operations (the os module), one method per call a log makes."""

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        return os.open(path, flags, mode)

    def pwrite(self, fd: int, data: bytes | bytearray | memoryview, offset: int) -> int:
        return os.pwrite(fd, data, offset)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def ftruncate(self, fd: int, length: int) -> None:
        os.ftruncate(fd, length)

    def dup(self, fd: int) -> int:
        return os.dup(fd)

    def close(self, fd: int) -> None:
        os.close(fd)


REAL = FileOps()


class FaultPlanError(ValueError):
    """A fault plan that cannot be parsed (the message says which word)."""


@dataclass
class Fault:
    """One rule of a fault plan (see the module docstring)."""

    op: str
    kind: str
    nth: int = 1
    count: int = 1
    path: str = ""
    while_exists: str = ""
    ms: int = 0                                     # kind slow: the wait
    seen: int = field(default=0, compare=False)     # matching calls so far
    fired: int = field(default=0, compare=False)    # calls failed so far

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise FaultPlanError(f"op {self.op!r}: not one of {', '.join(OPS)}")
        if self.kind not in KINDS:
            raise FaultPlanError(f"kind {self.kind!r}: not one of {', '.join(KINDS)}")
        if self.kind in ("short", "zero") and self.op != "pwrite":
            raise FaultPlanError(f"kind {self.kind!r} applies to pwrite only")
        if self.kind == "slow" and self.op != "fsync":
            raise FaultPlanError("kind 'slow' applies to fsync only")
        if self.nth < 1 or self.count < 0:
            raise FaultPlanError("nth must be >= 1 and count >= 0")
        if not 0 <= self.ms <= MAX_SLOW_MS:
            raise FaultPlanError(f"ms must be between 0 and {MAX_SLOW_MS}")

    def hit(self, path: str) -> bool:
        """Whether this call (on path) fails; counts it when it matches."""
        if self.path and self.path not in path:
            return False
        if self.while_exists and not os.path.exists(self.while_exists):
            return False
        self.seen += 1
        if self.seen < self.nth or (self.count and self.seen >= self.nth + self.count):
            return False
        self.fired += 1
        return True


def parse_plan(text: str) -> list[Fault]:
    """Rules from ``op=... kind=... [nth=N] [count=M] [path=S] [while=FILE] [ms=N];
    ...``."""
    faults = []
    for rule in filter(None, (r.strip() for r in text.split(";"))):
        words: dict[str, str] = {}
        for word in rule.split():
            key, eq, value = word.partition("=")
            if not eq or key not in ("op", "kind", "nth", "count", "path", "while", "ms"):
                raise FaultPlanError(f"{word!r}: expected op=, kind=, nth=, count=, path=, "
                                     f"while= or ms=")
            words[key] = value
        if "op" not in words or "kind" not in words:
            raise FaultPlanError(f"{rule!r}: op= and kind= are required")
        try:
            nth, count = int(words.get("nth", "1")), int(words.get("count", "1"))
            ms = int(words.get("ms", "0"))
        except ValueError:
            raise FaultPlanError(f"{rule!r}: nth, count and ms are integers") from None
        faults.append(Fault(words["op"], words["kind"], nth, count, words.get("path", ""),
                            words.get("while", ""), ms))
        if len(faults) > MAX_RULES:
            raise FaultPlanError(f"more than {MAX_RULES} rules")
    return faults


class FaultyFileOps(FileOps):
    """FileOps that fail the calls a fault plan names; ``calls`` records every call as
    (op, path) for tests that check what was (not) called. Thread-safe: the owner loop
    writes while the storage thread syncs."""

    def __init__(self, faults: list[Fault] | None = None, record: bool = False) -> None:
        self.faults = list(faults or [])
        self.record = record
        self.calls: list[tuple[str, str]] = []
        self._paths: dict[int, str] = {}
        # between the loop that writes and the storage thread that syncs: the rules'
        # counters, the fd -> path map and the call record
        self._lock = threading.Lock()

    def describe(self) -> str:
        return "; ".join(f"{f.op} {f.kind} nth={f.nth} count={f.count}"
                         + (f" path={f.path}" if f.path else "")
                         + (f" while={f.while_exists}" if f.while_exists else "")
                         + (f" ms={f.ms}" if f.kind == "slow" else "")
                         for f in self.faults)

    def _check(self, op: str, fd: int | None = None, path: str | None = None) -> str | None:
        """The fault kind this call gets, or None (a ``slow`` rule's wait is served
        here, outside the lock, and the call then goes on as if unmatched)."""
        with self._lock:
            where = path if path is not None else self._paths.get(fd or -1, "")
            if self.record:
                self.calls.append((op, where))
            rule = None
            for f in self.faults:       # every rule counts the calls it matches
                if f.op == op and f.hit(where) and rule is None:
                    rule = f
        if rule is not None and rule.kind == "slow":
            time.sleep(rule.ms / 1000)
            return None
        return rule.kind if rule is not None else None

    @staticmethod
    def _raise(kind: str, op: str) -> None:
        num = KINDS[kind]
        raise OSError(num, f"{os.strerror(num)} (fault plan: {op})")

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        kind = self._check("open", path=path)
        if kind is not None:
            self._raise(kind, "open")
        fd = os.open(path, flags, mode)
        with self._lock:
            self._paths[fd] = path
        return fd

    def pwrite(self, fd: int, data: bytes | bytearray | memoryview, offset: int) -> int:
        kind = self._check("pwrite", fd)
        if kind == "short" and len(data) > 1:
            return os.pwrite(fd, memoryview(data)[:len(data) // 2], offset)
        if kind == "zero":
            return 0
        if kind is not None and kind != "short":
            self._raise(kind, "pwrite")
        return os.pwrite(fd, data, offset)

    def fsync(self, fd: int) -> None:
        kind = self._check("fsync", fd)
        if kind is not None:
            self._raise(kind, "fsync")
        os.fsync(fd)

    def ftruncate(self, fd: int, length: int) -> None:
        kind = self._check("ftruncate", fd)
        if kind is not None:
            self._raise(kind, "ftruncate")
        os.ftruncate(fd, length)

    def dup(self, fd: int) -> int:
        new = os.dup(fd)
        with self._lock:
            self._paths[new] = self._paths.get(fd, "")
        return new

    def close(self, fd: int) -> None:
        with self._lock:
            self._paths.pop(fd, None)
        os.close(fd)


def from_environment(environ: dict[str, str] | None = None) -> FileOps:
    """The FileOps a broker process uses: REAL, or the plan in ``PYBROKER_FAULTS``.
    Raises FaultPlanError for a plan that does not parse."""
    text = (os.environ if environ is None else environ).get(ENV, "").strip()
    if not text:
        return REAL
    return FaultyFileOps(parse_plan(text))


__all__ = ["ENV", "REAL", "Fault", "FaultPlanError", "FaultyFileOps", "FileOps",
           "from_environment", "parse_plan"]
