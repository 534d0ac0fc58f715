"""Publishing while the disk fails, in both durability modes (docs/storage.md, "When a
write fails"; issue: OK'd messages were lost with TCP and HTTP publishers on a full
disk).

A real broker (two loop threads, so publishes are handed between loops) with TCP
publishers (PUB, MPUB, DPUB), an HTTP publisher (/pub, /mpub) and a dead-lettering
channel all writing one topic. Its writes fail for a while: through the fault seam
(``PYBROKER_FAULTS``, armed in the broker process: the topic's writes fail with ENOSPC
while a flag file exists, and in fsync mode its fsyncs with EIO in a second window), or
on a real full filesystem (a small tmpfs in a private mount namespace). Then:

- every command got an answer: OK, or nsqd's error for it (E_PUB_FAILED,
  E_MPUB_FAILED, E_DPUB_FAILED; HTTP 500 PUB_FAILED / MPUB_FAILED), never silence;
- only publishes whose writes ran while writes failed failed, and a topic beside it
  and the dead-letter source never failed;
- every OK'd message (and every dead letter) is delivered after recovery, and no
  record of a publish whose write failed is;
- /ping says NOK while writes fail, and "writes work again" is logged only once a
  write of real records worked.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.broker import BrokerProcess, unique_name, wait_until
from tests.support.durability import (
    bodies,
    channel_stats,
    consume,
    create_channel,
    http,
    ping,
)
from tests.support.publish_faults import (
    HttpPublisher,
    Outcome,
    Requeuer,
    TcpPublisher,
    envelope_body,
)

MakeBroker = Callable[..., BrokerProcess]
EXPECTED = {"PUB": "E_PUB_FAILED", "MPUB": "E_MPUB_FAILED", "DPUB": "E_DPUB_FAILED",
            "/pub": '500 {"message":"PUB_FAILED"}', "/mpub": '500 {"message":"MPUB_FAILED"}'}


@dataclass
class Window:
    """A period during which writes failed: [on, off] on time.monotonic()."""
    on: float
    off: float
    log_from: int      # the broker's log lines within it: [log_from, log_to)
    log_to: int
    pings: list[tuple[int, str]]


class Load:
    """The publishers and the dead-lettering consumer of one test."""

    def __init__(self, b: BrokerProcess, topic: str, other: str, source: str) -> None:
        assert b.tcp_address is not None and b.http_address is not None
        self.b = b
        self.topic, self.other, self.source = topic, other, source
        for t in (topic, other, source):
            create_channel(b, t, "drain" if t != source else "work")
        q = urllib.parse.urlencode({"topic": source, "channel": "work", "max_attempts": 1,
                                    "dead_letter_topic": topic})
        status, text = http(b, "POST", f"/channel/config?{q}")
        assert status == 200, text
        tcp = b.tcp_address
        self.on_topic: list[TcpPublisher | HttpPublisher] = [
            TcpPublisher(prefix="t1", address=tcp, topic=topic, pause_s=0.002),
            TcpPublisher(prefix="t2", address=tcp, topic=topic, pause_s=0.002),
            HttpPublisher(prefix="h1", address=b.http_address, topic=topic, pause_s=0.002)]
        self.beside = TcpPublisher(prefix="o1", address=tcp, topic=other, pause_s=0.004)
        self.feeder = TcpPublisher(prefix="s1", address=tcp, topic=source, pause_s=0.01)
        self.requeuer = Requeuer(address=tcp, topic=source, channel="work")
        self.all = [*self.on_topic, self.beside, self.feeder]

    def start(self) -> None:
        self.requeuer.start()
        for p in self.all:
            p.start()
        wait_until(lambda: all(len(p.acked) >= 10 for p in self.all), timeout_s=20,
                   what="every publisher to get OKs")

    def window(self, flag: Path, seconds: float) -> Window:
        """Writes fail while flag exists (the fault plan); /ping is polled meanwhile."""
        on = time.monotonic()
        flag.touch()
        pings = []
        log_from = len(self.b.stderr_lines)
        t_end = time.monotonic() + seconds
        while time.monotonic() < t_end:
            pings.append(ping(self.b))
            time.sleep(0.1)
        log_to = len(self.b.stderr_lines)
        flag.unlink()
        return Window(on, time.monotonic(), log_from, log_to, pings)

    def recover(self) -> None:
        """Publish on until every publisher got an OK for a command sent after the
        last window, then stop them, and let the dead-lettering finish."""
        mark = time.monotonic()
        wait_until(lambda: all(any(o.answer == "OK" and o.sent > mark
                                   for o in list(p.outcomes)) for p in self.all),
                   timeout_s=20, what="every publisher to publish again")
        for p in self.all:
            p.stop()

        def source_done() -> bool:
            st = channel_stats(self.b, self.source, "work") or {}
            return (st.get("depth") == 0 and st.get("in_flight_count") == 0
                    and st.get("dead_letter_pending") == 0
                    and st.get("deferred_count") == 0)

        wait_until(source_done, timeout_s=30, what="every source message dead-lettered")
        self.requeuer.stop()


def check_answers(load: Load, windows: list[Window], write_window: Window | None) -> None:
    """Every command answered; failures only from the windows, with nsqd's errors;
    none beside the faulty topic."""
    for p in load.all:
        silent = [o for o in p.outcomes if o.answer.startswith("no answer")]
        assert not silent, f"{p.prefix}: commands never answered: {silent[:3]}"
        for o in p.failed:
            assert o.answer.startswith(EXPECTED[o.kind]), (p.prefix, o)
            assert any(w.on <= o.answered and o.sent <= w.off for w in windows), \
                f"{p.prefix}: {o.kind} failed outside the windows: {o}"
    assert not load.beside.failed, f"a topic beside failed: {load.beside.failed[:3]}"
    assert not load.feeder.failed, f"the dead-letter source failed: {load.feeder.failed[:3]}"
    for w in windows:
        for kind in ((TcpPublisher, HttpPublisher)):
            failed = [o for p in load.on_topic if isinstance(p, kind) for o in p.failed
                      if w.on <= o.answered and o.sent <= w.off]
            assert failed, f"no {kind.__name__} command failed in {w}"


def check_health(b: BrokerProcess, windows: list[Window]) -> None:
    for w in windows:
        assert any(s == 500 and t.startswith("NOK - failed to write") for s, t in w.pings), \
            w.pings
        lines = b.stderr_lines[w.log_from:w.log_to]
        assert not [ln for ln in lines if "writes work again" in ln], \
            "'writes work again' logged while writes failed"
    wait_until(lambda: ping(b) == (200, "OK"), timeout_s=10, what="/ping OK again")
    wait_until(lambda: "writes work again" in b.stderr_text(), timeout_s=10,
               what="the line saying writes work again")
    text = b.stderr_text()
    assert "Traceback" not in text, text


def check_delivery(load: Load, failed_writes: list[Outcome]) -> None:
    """After recovery: everything OK'd delivered, every source message dead-lettered
    into the topic, nothing of a publish whose write failed."""
    b = load.b
    got = bodies(consume(b, load.topic, "drain", idle_s=2.0, timeout_s=120))
    plain = {m for m in got if not m.startswith(b"{")}
    dead = {envelope_body(m) for m in got if m.startswith(b"{")}
    acked = set().union(*(p.acked for p in load.on_topic))
    missing = acked - plain
    assert not missing, f"{len(missing)} OK'd messages lost, e.g. {sorted(missing)[:5]}"
    undead = load.feeder.acked - dead
    assert not undead, f"{len(undead)} dead letters lost, e.g. {sorted(undead)[:5]}"
    never_written = {m for o in failed_writes for m in o.bodies}
    assert not never_written & plain, "records of failed writes were delivered"
    beside = set(bodies(consume(b, load.other, "drain", idle_s=2.0, timeout_s=60)))
    assert load.beside.acked <= beside
    print(f"{len(acked)} OK'd on the topic, {sum(len(p.failed) for p in load.on_topic)} "
          f"commands failed, {len(dead)} dead letters, {len(got)} delivered "
          f"({len(set(got))} distinct)")


def dead_letter_failures(b: BrokerProcess) -> int:
    return sum("dead-lettering" in ln and "failed" in ln for ln in b.stderr_lines)


@pytest.mark.parametrize("mode", ["memory", "fsync"])
def test_fault_seam_fails_exactly_the_publishes_its_writes_carried(
        make_broker: MakeBroker, tmp_path: Path, mode: str) -> None:
    topic, other, source = unique_name("faulty"), unique_name("beside"), unique_name("src")
    writes, syncs = tmp_path / "writes-fail", tmp_path / "fsyncs-fail"
    plan = f"op=pwrite kind=ENOSPC count=0 while={writes} path=/topics/{topic}/"
    if mode == "fsync":
        plan += f"; op=fsync kind=EIO count=0 while={syncs} path=/topics/{topic}/"
    b = make_broker(f"--durability={mode}", env={"PYBROKER_FAULTS": plan})
    assert "TEST FAULT PLAN ARMED" in b.stderr_text()
    load = Load(b, topic, other, source)
    load.start()
    w1 = load.window(writes, 2.0)
    windows = [w1]
    if mode == "fsync":
        time.sleep(0.5)
        windows.append(load.window(syncs, 2.0))
    load.recover()
    assert dead_letter_failures(b) > 0, "no dead-letter publish failed in the window"
    check_answers(load, windows, w1)
    check_health(b, windows)
    failed_writes = [o for p in load.on_topic for o in p.failed
                     if w1.on <= o.answered and o.sent <= w1.off]
    check_delivery(load, failed_writes)


# -- a real full filesystem ---------------------------------------------------------------


class TmpfsNamespace:
    """A private mount namespace holding a small tmpfs at ``path``, kept alive by a
    sleeping process (stopped by its PID). Processes are run in it with nsenter; the
    test reaches its files through /proc/<pid>/root."""

    def __init__(self, path: Path, size: str) -> None:
        self.path = path
        for tool in ("unshare", "nsenter", "mount"):
            if shutil.which(tool) is None:
                pytest.skip(f"{tool} is not installed: no private mount namespace")
        self.proc = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c",
             f"mount -t tmpfs -o size={size} tmpfs '{path}' && echo mounted && "
             "exec sleep 3600"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert self.proc.stdout is not None and self.proc.stderr is not None
        line = self.proc.stdout.readline()
        if line.strip() != b"mounted":
            self.proc.wait(5)
            why = self.proc.stderr.read().decode(errors="replace").strip()
            pytest.skip(f"cannot mount a tmpfs in a private mount namespace here "
                        f"(needs CAP_SYS_ADMIN, e.g. root): {why}")

    def inside(self, rel: str = "") -> Path:
        """A path of the tmpfs as this process sees it."""
        return Path(f"/proc/{self.proc.pid}/root{self.path}") / rel

    def free_bytes(self) -> int:
        st = os.statvfs(self.inside())
        return st.f_bavail * st.f_frsize

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


class NamespacedBroker(BrokerProcess):
    """A broker process started inside a TmpfsNamespace (its data path on the tmpfs)."""

    def __init__(self, ns: TmpfsNamespace, args: list[str]) -> None:
        super().__init__("pybroker", args, data_path=str(ns.path))
        self.ns = ns

    def command(self) -> list[str]:
        return ["nsenter", "--target", str(self.ns.proc.pid), "--mount", "--",
                *super().command()]


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[TmpfsNamespace]:
    mount = tmp_path / "data"
    mount.mkdir()
    ns = TmpfsNamespace(mount, "32m")
    yield ns
    ns.stop()


@pytest.mark.parametrize("mode", ["memory", "fsync"])
def test_full_filesystem(tmpfs: TmpfsNamespace, mode: str) -> None:
    """The same load on a real filesystem that fills up: a ballast file leaves little
    room, the publishers fill it, writes fail with ENOSPC (or write short); the ballast
    goes, publishing recovers; the broker is killed (-9) and restarted on the same
    tmpfs, and everything OK'd is delivered."""
    b = NamespacedBroker(tmpfs, [f"--durability={mode}"]).start()
    try:
        topic, other, source = (unique_name("full"), unique_name("beside"),
                                unique_name("src"))
        load = Load(b, topic, other, source)
        load.start()
        ballast = tmpfs.inside("ballast")
        on = time.monotonic()
        with open(ballast, "wb") as f:
            chunk = b"\0" * (1 << 20)
            while tmpfs.free_bytes() > (3 << 20):
                f.write(chunk)
                f.flush()
        log_from = len(b.stderr_lines)
        pings: list[tuple[int, str]] = []

        def full() -> bool:
            pings.append(ping(b))
            return all(any(o.answered >= on for o in p.failed)
                       for p in load.on_topic)

        wait_until(full, timeout_s=30, interval_s=0.1,
                   what="TCP and HTTP publishes to fail on the full filesystem")
        time.sleep(1.0)
        pings.append(ping(b))
        log_to = len(b.stderr_lines)
        ballast.unlink()
        window = Window(on, time.monotonic(), log_from, log_to, pings)
        load.recover()
        for p in load.all:
            silent = [o for o in p.outcomes if o.answer.startswith("no answer")]
            assert not silent, f"{p.prefix}: commands never answered: {silent[:3]}"
            for o in p.failed:
                assert o.answer.startswith(EXPECTED[o.kind]), (p.prefix, o)
                assert window.on <= o.answered and o.sent <= window.off, o
        assert any(s == 500 and t.startswith("NOK - failed to write") for s, t in pings)
        wait_until(lambda: ping(b) == (200, "OK"), timeout_s=10, what="/ping OK again")
        assert "Traceback" not in b.stderr_text(), b.stderr_text()
        failed_writes = [o for p in load.on_topic for o in p.failed]
        b.kill9()
        b.start()
        check_delivery(load, failed_writes)
    finally:
        b.stop(signal.SIGTERM)
