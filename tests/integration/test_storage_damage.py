"""Damaged or unusable storage: pybroker starts, says what it found, sets damaged data
aside, delivers every intact message and keeps serving.

Cases: a torn segment tail; a corrupted record (found when the queue is opened, and
found while reading); garbage in nsqd.dat (with and without a usable .bak); a data_path
that cannot be a directory; writes failing while running (RLIMIT_FSIZE on the server
process, SIGXFSZ ignored as CPython does: writes past the limit fail with EFBIG).
"""
from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.broker import BrokerProcess, project_root, unique_name, wait_until
from tests.support.durability import (
    bodies,
    consume,
    create_channel,
    flip_bytes,
    http,
    ping,
    log_dir,
    segment_records,
    stats,
)
from tests.support.wire import PROBE_TOPIC, ConnectionClosed, WireClient, pub

MakeBroker = Callable[..., BrokerProcess]


def stop_clean(b: BrokerProcess) -> None:
    code = b.stop(signal.SIGTERM)
    assert code == 0 and "Traceback" not in b.stderr_text(), b.stderr_text()


def restart(b: BrokerProcess) -> None:
    stop_clean(b)
    b.start()


def log_lines(b: BrokerProcess, *words: str) -> list[str]:
    return [ln for ln in b.stderr_lines if all(w in ln for w in words)]


def spill(b: BrokerProcess, topic: str, n: int, size: int = 40) -> list[bytes]:
    """PUB n messages one by one (with mem-queue-size=1 each is its own disk write)."""
    msgs = [f"{topic}-{i:05d}-".encode().ljust(size, b"x") for i in range(n)]
    with WireClient.connect(b.tcp_address) as c:  # type: ignore[arg-type]
        for m in msgs:
            c.pub(topic, m)
    return msgs


def assert_serving(b: BrokerProcess, topic: str) -> None:
    """New messages go through, and every loop thread answers (connections are
    spread over the loops round-robin)."""
    clients = [WireClient.connect(b.tcp_address) for _ in range(4)]  # type: ignore[arg-type]
    try:
        for c in clients:
            c.pub(PROBE_TOPIC, b"alive")
        clients[0].pub(topic, b"after-damage")
    finally:
        for c in clients:
            c.close()
    got = bodies(consume(b, topic, "ch", idle_s=0.5))
    assert b"after-damage" in got


# -- segments ---------------------------------------------------------------------------------


def test_torn_segment_tail(make_broker: MakeBroker) -> None:
    b = make_broker("--mem-queue-size=1", "--max-bytes-per-file=2048")
    topic = unique_name("torn")
    create_channel(b, topic, "ch")
    msgs = spill(b, topic, 60)
    stop_clean(b)
    qdir = log_dir(b.data_path, topic)
    last = max(qdir.glob("*.log"))
    recs = segment_records(last)
    assert len(recs) >= 2, recs
    # a write cut in the middle of the last record
    os.truncate(last, recs[-1].offset + recs[-1].length - 7)
    b.start()
    assert log_lines(b, "torn write"), b.stderr_text()
    got = bodies(consume(b, topic, "ch", idle_s=1.0))
    lost = set(msgs) - set(got)
    assert len(lost) == 1 and len(got) == len(set(got)) == len(msgs) - 1, (lost, got)
    assert_serving(b, topic)
    restart(b)  # and the repaired queue opens cleanly
    assert consume(b, topic, "ch", idle_s=0.5) == []
    assert not log_lines(b, "TOPICLOG"), b.stderr_text()


def _corrupt_middle(seg: Path) -> tuple[bytes, list[bytes]]:
    """Flip bytes inside the middle record of a segment; return that record's body and
    the bodies of the records after it in the same file."""
    recs = segment_records(seg)
    assert len(recs) >= 5, recs
    mid = len(recs) // 2
    r = recs[mid]
    flip_bytes(seg, r.offset + r.length - 10, 4)
    return r.body, [x.body for x in recs[mid + 1:]]


@pytest.mark.parametrize("where", ["first", "last"])
def test_corrupt_record_is_set_aside(make_broker: MakeBroker, where: str) -> None:
    """A record with a bad checksum in the first segment (found while reading) or in the
    last one (found when the queue is opened): the server starts, logs it, keeps the
    original as .bad, and delivers every message before the damage and in every other
    segment."""
    b = make_broker("--mem-queue-size=1", "--max-bytes-per-file=2048")
    topic = unique_name("crc")
    create_channel(b, topic, "ch")
    msgs = spill(b, topic, 77)
    stop_clean(b)
    qdir = log_dir(b.data_path, topic)
    segs = sorted(qdir.glob("*.log"))
    assert len(segs) >= 3, segs
    assert sorted(r.body for s in segs for r in segment_records(s)) == sorted(msgs)
    seg = segs[0 if where == "first" else -1]
    original_seg = seg.read_bytes()
    damaged, after_in_seg = _corrupt_middle(seg)
    must_have = set(msgs) - {damaged} - set(after_in_seg)
    original = seg.read_bytes()

    b.start()
    got = bodies(consume(b, topic, "ch", idle_s=1.0))
    assert damaged not in got
    assert not must_have - set(got), f"{len(must_have - set(got))} intact messages lost"
    assert len(got) == len(set(got)), "duplicates"
    assert log_lines(b, "TOPICLOG", "checksum"), b.stderr_text()
    bad = list(qdir.glob("*.bad"))
    assert len(bad) == 1 and bad[0].read_bytes() == original != original_seg, bad
    assert_serving(b, topic)
    restart(b)
    assert consume(b, topic, "ch", idle_s=0.5) == []
    assert "Traceback" not in b.stderr_text()


def test_corrupt_record_loses_only_itself(make_broker: MakeBroker) -> None:
    """Only the record whose checksum fails is damaged; the records after it in the
    same segment are intact (their own checksums and seqs are fine) and are delivered."""
    b = make_broker("--mem-queue-size=1", "--max-bytes-per-file=4096")
    topic = unique_name("crc_rest")
    create_channel(b, topic, "ch")
    msgs = spill(b, topic, 40)
    stop_clean(b)
    seg = min(log_dir(b.data_path, topic).glob("*.log"))
    damaged, after = _corrupt_middle(seg)
    b.start()
    got = set(bodies(consume(b, topic, "ch", idle_s=1.0)))
    lost = [m for m in msgs if m not in got]
    assert lost == [damaged], f"lost {len(lost)} messages: the damaged one and " \
        f"{len(set(lost) & set(after))} intact ones after it in the same segment"


# -- metadata ---------------------------------------------------------------------------------


def _setup_topics(b: BrokerProcess) -> tuple[str, str]:
    t1, t2 = unique_name("meta"), unique_name("meta_paused")
    create_channel(b, t1, "ch")
    create_channel(b, t2, "ch")
    assert http(b, "POST", f"/topic/pause?topic={t2}")[0] == 200
    assert http(b, "POST", f"/channel/pause?topic={t1}&channel=ch")[0] == 200
    with WireClient.connect(b.tcp_address) as c:  # type: ignore[arg-type]
        c.mpub(t1, [b"a1", b"a2"])
        c.mpub(t2, [b"b1", b"b2"])
    return t1, t2


def _paused_flags(b: BrokerProcess) -> dict[str, tuple[bool, dict[str, bool]]]:
    return {t["topic_name"]: (t["paused"], {c["channel_name"]: c["paused"]
                                            for c in t["channels"]})
            for t in stats(b)["topics"]}


def test_garbage_nsqd_dat_falls_back_to_bak(make_broker: MakeBroker) -> None:
    b = make_broker()
    t1, t2 = _setup_topics(b)
    restart(b)   # start-up and shutdown save again: the .bak now holds the same state
    before = _paused_flags(b)
    stop_clean(b)
    meta = Path(b.data_path) / "nsqd.dat"
    assert (Path(b.data_path) / "nsqd.dat.bak").exists()
    meta.write_bytes(b"\x00garbage{{{" * 10)
    b.start()
    assert log_lines(b, "nsqd.dat"), b.stderr_text()
    assert log_lines(b, ".bak"), b.stderr_text()
    assert _paused_flags(b) == before
    assert before[t2][0] and before[t1][1] == {"ch": True}
    assert http(b, "POST", f"/channel/unpause?topic={t1}&channel=ch")[0] == 200
    assert http(b, "POST", f"/topic/unpause?topic={t2}")[0] == 200
    assert sorted(bodies(consume(b, t1, "ch", expect=2))) == [b"a1", b"a2"]
    assert sorted(bodies(consume(b, t2, "ch", expect=2))) == [b"b1", b"b2"]


def test_garbage_nsqd_dat_and_bak_start_empty(make_broker: MakeBroker) -> None:
    b = make_broker()
    _setup_topics(b)
    restart(b)
    stop_clean(b)
    for name in ("nsqd.dat", "nsqd.dat.bak"):
        (Path(b.data_path) / name).write_bytes(b"not json at all")
    b.start()
    lines = log_lines(b, "metadata")
    assert lines and any("ERROR" in ln for ln in lines), b.stderr_text()
    print("".join(lines))
    assert ping(b) == (200, "OK")
    with WireClient.connect(b.tcp_address) as c:  # type: ignore[arg-type]
        c.pub(unique_name("fresh"), b"x")


# -- unusable data_path ---------------------------------------------------------------------


@pytest.mark.parametrize("under", ["file", "file/sub"])
def test_unusable_data_path_refuses_to_start(tmp_path: Path, under: str) -> None:
    (tmp_path / "file").write_text("I am a file\n")
    path = tmp_path / under
    env = dict(os.environ)
    proc = subprocess.run([sys.executable, "-m", "pybroker", "serve",
                           "--tcp-address=127.0.0.1:0", "--http-address=127.0.0.1:0",
                           f"--data-path={path}"], cwd=project_root(), env=env,
                          capture_output=True, timeout=30, check=False)
    err = proc.stderr.decode()
    assert proc.returncode == 2, err
    assert "Traceback" not in err, err
    problems = [ln for ln in err.splitlines() if " INFO: " not in ln]
    assert len(problems) == 1, err
    assert problems[0].startswith("pybroker: data_path: cannot use "), err
    assert str(tmp_path / "file") in problems[0], err
    assert "listening" not in err, err


# -- writes failing while running -------------------------------------------------------------


def _limit_file_size(b: BrokerProcess, size: int | None) -> None:
    """Set the server's soft RLIMIT_FSIZE (None: unlimited) and check SIGXFSZ is
    ignored, so a write past the limit fails with EFBIG instead of killing it."""
    assert b.proc is not None
    pid = b.proc.pid
    sigign = int(Path(f"/proc/{pid}/status").read_text().split("SigIgn:")[1].split()[0], 16)
    assert sigign & (1 << (signal.SIGXFSZ - 1)), "SIGXFSZ is not ignored by the server"
    _, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
    resource.prlimit(pid, resource.RLIMIT_FSIZE,
                     (resource.RLIM_INFINITY if size is None else size, hard))


@pytest.mark.parametrize("mode", ["memory", "fsync"])
def test_write_failures(make_broker: MakeBroker, mode: str) -> None:
    """Either durability: a PUB whose record cannot be written to the topic's log is
    answered E_PUB_FAILED (with the reason); /ping says NOK while writes fail;
    everything acknowledged is delivered; once writes work again, so does publishing
    and /ping."""
    b = make_broker(f"--durability={mode}", "--mem-queue-size=10")
    topic = unique_name("efbig")
    create_channel(b, topic, "ch")
    acked: list[bytes] = []
    with WireClient.connect(b.tcp_address) as c:  # type: ignore[arg-type]
        c.pub(topic, b"before")
        acked.append(b"before")
    _limit_file_size(b, 16 * 1024)
    c = WireClient.connect(b.tcp_address)  # type: ignore[arg-type]
    for i in range(100):
        body = f"fill-{i:03d}-".encode().ljust(1000, b"y")
        c.send(pub(topic, body))
        ftype, data = c.read_frame()
        if ftype != 0:
            break
        acked.append(body)
    else:
        pytest.fail("no PUB failed past the file size limit")
    assert data.startswith(b"E_PUB_FAILED"), data
    assert b"EFBIG" in data or b"too large" in data, data
    c.assert_closed()
    status, text = ping(b)
    assert status == 500 and text.startswith("NOK - "), (status, text)
    # still failing: publishing fails again, and /ping keeps saying so
    with WireClient.connect(b.tcp_address) as c2:  # type: ignore[arg-type]
        c2.send(pub(topic, b"z" * 1000))
        c2.expect_error("E_PUB_FAILED")
    time.sleep(0.5)
    status, text = ping(b)
    assert status == 500 and text.startswith("NOK - "), \
        f"/ping says {status} {text!r} while writes still fail"
    assert_no_dead_loops(b)
    _limit_file_size(b, None)
    with WireClient.connect(b.tcp_address) as c3:  # type: ignore[arg-type]
        c3.pub(topic, b"after")
    acked.append(b"after")
    wait_until(lambda: ping(b) == (200, "OK"), what="/ping OK once writes work")
    got = bodies(consume(b, topic, "ch", expect=len(acked)))
    assert sorted(got) == sorted(acked)


def assert_no_dead_loops(b: BrokerProcess) -> None:
    clients = [WireClient.connect(b.tcp_address) for _ in range(4)]  # type: ignore[arg-type]
    try:
        for c in clients:
            c.pub(PROBE_TOPIC, b"alive")
    finally:
        for c in clients:
            c.close()
    assert "event loop crashed" not in b.stderr_text()


def test_write_failures_on_req_and_sub_fsync_mode(make_broker: MakeBroker) -> None:
    """Disk writes fail while consumers work: a REQ with a delay (its due time goes to
    the channel's saved state) and the first SUB of a topic with a backlog (a cursor
    over the log: nothing is copied). No traceback, the consumer keeps its connection
    (or gets a clean E_SUB_FAILED), and every message is delivered."""
    b = make_broker("--durability=fsync", "--msg-timeout=60s")
    t_a, t_b = unique_name("efbig_req"), unique_name("efbig_sub")
    create_channel(b, t_a, "ch")
    with WireClient.connect(b.tcp_address) as p:  # type: ignore[arg-type]
        p.mpub(t_a, [b"a1", b"a2"])
        p.mpub(t_b, [f"b{i}".encode().ljust(300, b".") for i in range(3)])
    c = WireClient.connect(b.tcp_address)  # type: ignore[arg-type]
    c.sub(t_a, "ch")
    c.rdy(2)
    got = c.read_messages(2)
    c.rdy(0)
    seg = max(log_dir(b.data_path, t_a).glob("*.log"))
    _limit_file_size(b, seg.stat().st_size)   # no segment may grow; nsqd.dat is smaller
    c.req(got[0].id, 1000)
    c.assert_alive()                           # not closed: REQ failures are not fatal
    c.fin(got[1].id)
    c.rdy(5)
    again = c.read_message(5)                  # the REQ'd message, at its time
    assert (again.body, again.attempts) == (got[0].body, 2), again
    c.fin(again.id)
    c.assert_alive()
    # first SUB of t_b: its backlog cannot be written to the new channel's queue
    s = WireClient.connect(b.tcp_address)  # type: ignore[arg-type]
    s.send(b"SUB " + t_b.encode() + b" ch\n")
    try:
        ftype, data = s.read_frame()
    except ConnectionClosed:
        ftype, data = -1, b"closed without an answer"
    s.close()
    assert_no_dead_loops(b)
    _limit_file_size(b, None)
    expected = [f"b{i}".encode().ljust(300, b".") for i in range(3)]
    delivered = bodies(consume(b, t_b, "ch", idle_s=1.0))
    assert sorted(delivered) == expected, \
        f"{len(delivered)} of 3 backlog messages delivered after the SUB ({data!r})"
    assert ftype == 0 or data.startswith(b"E_SUB_FAILED"), (ftype, data)
    c.close()
    assert "Traceback" not in b.stderr_text(), b.stderr_text()
