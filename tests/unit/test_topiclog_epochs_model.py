"""A Hypothesis state machine over the topic log's write side with faults injected
(docs/storage.md, "When a write fails"): random appends and writes, each write with or
without a failure (ENOSPC, EIO, a short write that then completes or fails, a write of
nothing, a cut-back that fails too), fsyncs that work or fail, reopenings; segments small
enough to roll often. A small model keeps what must hold:

- a write that returned carried exactly its records (its epoch returned), one that raised
  carried none (its epoch named in the error), in memory and after reopening;
- epochs are used up one per write attempt, failed or not;
- after an fsync failure every written epoch not yet durable is lost (``lost_by``) and
  stays lost; no fsync runs on that segment again; the next write rolls;
- ``durable_epoch`` is the newest epoch a successful fsync covered.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from pybroker.storage import StorageError
from pybroker.storage.fileops import Fault, FaultyFileOps, FileOps
from pybroker.storage.topiclog import TopicLog

TS = 1_700_000_000 * 10**9
WRITE_FAULTS = {
    None: [],
    "ENOSPC": [Fault("pwrite", "ENOSPC", count=0)],
    "EIO": [Fault("pwrite", "EIO", count=0)],
    "short-then-ok": [Fault("pwrite", "short")],
    "short-then-ENOSPC": [Fault("pwrite", "short"), Fault("pwrite", "ENOSPC", nth=2,
                                                          count=0)],
    "zero": [Fault("pwrite", "zero", count=0)],
    "cut-back-fails": [Fault("pwrite", "short"), Fault("pwrite", "EIO", nth=2, count=0),
                       Fault("ftruncate", "EIO")],
}


class LogMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="logmodel-"))
        self.ops = FaultyFileOps(record=True)
        self.log = self._open()
        self.n = 0
        self.bodies: list[bytes] = []        # what the log holds, in order
        self.next_epoch = 1
        self.written: list[int] = []         # epochs whose write succeeded
        self.durable = 0
        self.lost: set[int] = set()
        self.poisoned = False                # an fsync failed; no write since

    def _open(self) -> TopicLog:
        return TopicLog(str(self.dir / "t"), max_bytes_per_file=400, mem_records=5,
                        max_record_bytes=4096, fileops=self.ops)

    def teardown(self) -> None:
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @rule(count=st.integers(1, 4), size=st.integers(1, 120),
          fault=st.sampled_from(sorted(WRITE_FAULTS, key=str)))
    def write(self, count: int, size: int, fault: str | None) -> None:
        new = []
        for _ in range(count):
            self.n += 1
            new.append(f"{self.n:05d}".encode().ljust(size, b"."))
        self.ops.faults = [Fault(f.op, f.kind, f.nth, f.count) for f in WRITE_FAULTS[fault]]
        log = self.log
        epoch = self.next_epoch
        self.next_epoch += 1
        with log.lock:
            log.append(new, TS)
            try:
                got = log.write_pending()
            except StorageError as e:
                assert e.epoch == epoch
                log.discard_pending()
                assert fault not in (None, "short-then-ok") or self._rolled_short(), fault
                return
            finally:
                self.ops.faults = []
        assert got == epoch
        assert fault in (None, "short-then-ok"), f"a write with {fault} succeeded"
        self.bodies += new
        self.written.append(epoch)
        self.poisoned = False

    def _rolled_short(self) -> bool:
        """A short write of a new segment's header fails the roll (and so the write)."""
        return any(op == "open" for op, _ in self.ops.calls[-3:])

    @rule(fail=st.booleans())
    def sync(self, fail: bool) -> None:
        before = sum(op == "fsync" for op, _ in self.ops.calls)
        self.ops.faults = [Fault("fsync", "EIO")] if fail else []
        try:
            self.log.sync()
        except StorageError as e:
            assert fail and not self.poisoned
            newest = self.written[-1] if self.written else 0
            assert e.epoch == newest
            self.lost |= {ep for ep in self.written if ep > self.durable}
            self.poisoned = True
            return
        finally:
            self.ops.faults = []
        fsyncs = sum(op == "fsync" for op, _ in self.ops.calls) - before
        if self.poisoned:
            assert fsyncs == 0, "a segment whose fsync failed was fsynced again"
            return
        assert not fail or fsyncs == 0 or not self.written
        if not fail:
            self.durable = max([self.durable] + self.written)

    @rule()
    def reopen(self) -> None:
        self.log.close()
        self.ops = FaultyFileOps(record=True)
        self.log = self._open()
        self.next_epoch = 1
        self.written, self.durable, self.lost, self.poisoned = [], 0, set(), False

    @invariant()
    def contents(self) -> None:
        log = self.log
        assert log.head == log.written == len(self.bodies)
        out = []
        off = log.oldest
        while off < log.written:
            b = log.read(off, 100, 1 << 20)
            out += [b.payload(i)[34:] for i in range(b.n)]
            off = b.first + b.n
        assert out == self.bodies
        assert log.epoch == self.next_epoch
        assert log.durable_epoch == self.durable
        for ep in self.written:     # (a failed write's epoch carried nothing to lose)
            assert (log.lost_by(ep) is not None) == (ep in self.lost), ep

    @invariant()
    def files_hold_what_was_written(self) -> None:
        if self.n % 5:
            return                      # reopening is slow: every few steps
        again = TopicLog(str(self.dir / "t"), max_bytes_per_file=400, mem_records=5,
                         max_record_bytes=4096, fileops=FileOps())
        try:
            out = []
            off = again.oldest
            while off < again.written:
                b = again.read(off, 100, 1 << 20)
                out += [b.payload(i)[34:] for i in range(b.n)]
                off = b.first + b.n
            # a cut-back that failed leaves bytes past the end until the next write: a
            # reopening cuts them off as a torn tail (or keeps complete records of the
            # failed write at the end, which the log never reported written)
            assert out[:len(self.bodies)] == self.bodies
        finally:
            again.close()


TestLogMachine = LogMachine.TestCase
TestLogMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                   suppress_health_check=list(HealthCheck))
