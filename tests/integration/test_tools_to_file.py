"""``pybroker to-file`` end to end on pybroker and nsqd: exact files, gzip, rotation, crashes.

Files are compared byte for byte (gzip files after decompression, member by member).
Where nsq_to_file is installed, both tools write the same topic and must agree.
"""
from __future__ import annotations

import signal
import socket
import subprocess
import time
import zlib
from pathlib import Path

import pytest

from pybroker.client import Consumer, Producer
from tests.support.broker import BrokerProcess, project_root, unique_name, wait_until
from tests.support.http import wait_all_finished
from tests.support.lookupd import FakeLookupd
from tests.support.programs import require_program
from tests.support.tools import TOOL, reap_tools, run_tool, spawn, start_tool  # noqa: F401

pytestmark = pytest.mark.timeout(60)
HOST = socket.gethostname().split(".")[0]


def year() -> str:
    """The year in file names (--datetime-format=%Y), read when the test runs."""
    return time.strftime("%Y")


def start_to_file(b: BrokerProcess, *args: str) -> subprocess.Popen[bytes]:
    return spawn([*TOOL, "to-file", f"--nsqd-tcp-address={b.tcp_hostport}",
                  "--sync-interval=100ms", "--datetime-format=%Y", *args])


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> bytes:
    """Signal the tool, expect a clean exit 0, return its stderr."""
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert b"Traceback" not in err, err
    return err


def gunzip(data: bytes) -> tuple[bytes, int, bool]:
    """Decompress concatenated gzip members: (content, complete members, ends cleanly).

    A truncated last member (a killed writer) contributes nothing.
    """
    out, members, pos = b"", 0, 0
    while pos < len(data):
        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        try:
            chunk = d.decompress(data[pos:])
        except zlib.error:
            return out, members, False
        if not d.eof:
            return out, members, False
        out += chunk
        members += 1
        pos = len(data) - len(d.unused_data)
    return out, members, True


def content(path: Path) -> bytes:
    data = path.read_bytes()
    if path.name.endswith(".gz"):
        text, _, _ = gunzip(data)
        return text
    return data


def publish(b: BrokerProcess, topic: str, bodies: list[bytes]) -> None:
    with Producer(b.tcp_hostport) as p:
        for i in range(0, len(bodies), 500):
            p.multi_publish(topic, bodies[i:i + 500])


def assert_channel_empty(b: BrokerProcess, topic: str, channel: str) -> None:
    """Every message was FIN'd: none queued, deferred or in flight (one left un-FIN'd
    would stay in flight, then be queued again at its timeout)."""
    wait_all_finished(b, topic, channel)


def test_plain_file_exact_bytes_and_append(any_broker: BrokerProcess, tmp_path: Path) -> None:
    topic = unique_name("tf_plain")
    bodies = [b"msg-%04d" % i for i in range(100)]
    publish(any_broker, topic, bodies)
    args = (f"--topic={topic}", f"--output-dir={tmp_path}", "--channel=archive",
            "--consumer-opt=msg_timeout,1s")
    proc = start_to_file(any_broker, *args)
    path = tmp_path / f"{topic}.{HOST}.{year()}.log"
    expected = b"".join(b + b"\n" for b in bodies)
    wait_until(lambda: path.exists() and path.stat().st_size >= len(expected), 15,
               what="100 lines on disk")
    stop(proc)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    assert path.read_bytes() == expected
    # a second run appends to the same file (no <REV> without gzip/rotation/work dir)
    publish(any_broker, topic, [b"more-1", b"more-2"])
    proc = start_to_file(any_broker, *args)
    wait_until(lambda: path.stat().st_size >= len(expected) + 14, 15, what="2 more lines")
    stop(proc, signal.SIGINT)
    assert path.read_bytes() == expected + b"more-1\nmore-2\n"
    assert_channel_empty(any_broker, topic, "archive")


def test_gzip_rotate_size_with_work_dir(any_broker: BrokerProcess, tmp_path: Path) -> None:
    topic = unique_name("tf_gzsize")
    out, work = tmp_path / "out", tmp_path / "work"
    bodies = [b"m-%07d" % i for i in range(200)]        # 10 bytes a line
    publish(any_broker, topic, bodies)
    proc = start_to_file(any_broker, f"--topic={topic}", f"--output-dir={out}",
                         f"--work-dir={work}", "--gzip", "--gzip-level=9", "--rotate-size=500",
                         "--max-in-flight=40")

    def written() -> bytes:
        # a finished file moves from the work dir to the output dir between the two
        # listings or the read: that look sees too little (or nothing) and the poll retries
        files = sorted(out.glob("*.gz")) + sorted(work.glob("*.gz"))
        try:
            return b"".join(gunzip(f.read_bytes())[0] for f in files)
        except FileNotFoundError:
            return b""

    wait_until(lambda: written().count(b"\n") >= 200, 15, what="200 lines written")
    stop(proc)
    assert list(work.iterdir()) == [], "finished files must leave the work dir"
    names = sorted(p.name for p in out.iterdir())
    assert names == [f"{topic}.{HOST}-{rev:06d}.{year()}.log.gz" for rev in range(4)]
    # a file rotates once it holds more than 500 bytes: 51 lines (510 bytes) each
    lines = [b + b"\n" for b in bodies]
    chunks = [lines[0:51], lines[51:102], lines[102:153], lines[153:200]]
    for name, chunk in zip(names, chunks, strict=True):
        text, members, clean = gunzip((out / name).read_bytes())
        assert clean, f"{name} has a truncated gzip member"
        assert members >= 1
        assert text == b"".join(chunk)


def test_rotate_interval_skip_empty(any_broker: BrokerProcess, tmp_path: Path) -> None:
    topic = unique_name("tf_interval")
    out, work = tmp_path / "out", tmp_path / "work"
    first = [b"first-%d" % i for i in range(5)]
    publish(any_broker, topic, first)
    proc = start_to_file(any_broker, f"--topic={topic}", f"--output-dir={out}",
                         f"--work-dir={work}", "--rotate-interval=1s", "--skip-empty-files")
    rev0 = out / f"{topic}.{HOST}-000000.{year()}.log"
    wait_until(rev0.exists, 15, what="the first file to rotate into the output dir")
    # nsq_to_file moves a file by a link, then the removal of the old name: for a
    # moment it is in both dirs
    wait_until(lambda: list(work.iterdir()) == [], 5, what="the work dir left empty")
    second = [b"second-%d" % i for i in range(3)]
    publish(any_broker, topic, second)
    rev1 = work / f"{topic}.{HOST}-000001.{year()}.log"
    wait_until(lambda: rev1.exists() and rev1.stat().st_size >= 27, 15, what="second file")
    wait_until((out / rev1.name).exists, 15, what="the second file to rotate")
    # one more interval with nothing written: --skip-empty-files must not make a file of it
    time.sleep(1.2)
    stop(proc)
    assert sorted(p.name for p in out.iterdir()) == [rev0.name, rev1.name]
    assert rev0.read_bytes() == b"".join(b + b"\n" for b in first)
    assert (out / rev1.name).read_bytes() == b"".join(b + b"\n" for b in second)


@pytest.mark.parametrize("gzip", [False, True], ids=["plain", "gzip"])
def test_killed_and_restarted_loses_nothing(any_broker: BrokerProcess, tmp_path: Path,
                                            gzip: bool) -> None:
    topic = unique_name("tf_kill")
    bodies = [b"k-%05d" % i for i in range(5000)]
    publish(any_broker, topic, bodies)
    args = [f"--topic={topic}", f"--output-dir={tmp_path}", "--max-in-flight=50",
            "--consumer-opt=msg_timeout,1s"] + (["--gzip"] if gzip else [])

    def lines() -> list[bytes]:
        return b"".join(content(p) for p in sorted(tmp_path.iterdir())).splitlines()

    proc = start_to_file(any_broker, *args)
    wait_until(lambda: len(lines()) >= 300, 15, what="300 lines before the kill")
    proc.kill()                                     # SIGKILL: no chance to clean up
    proc.communicate(timeout=5)
    assert len(lines()) < 5000, "the run finished before it could be killed"
    proc = start_to_file(any_broker, *args)
    wait_until(lambda: set(lines()) >= set(bodies), 20, what="every message on disk")
    stop(proc)
    got = lines()
    assert set(got) == set(bodies), "lost messages"
    assert all(line.startswith(b"k-") and len(line) == 7 for line in got), "torn lines"
    # only messages in flight at the kill (at most max-in-flight) may appear twice
    assert len(got) - len(bodies) <= 50
    if gzip:
        assert len(list(tmp_path.iterdir())) == 2, "a restart opens the next revision"


def test_topic_pattern_through_lookupd(any_broker: BrokerProcess, tmp_path: Path) -> None:
    base = unique_name("tf_pat")
    wanted, other = [f"{base}_a", f"{base}_b"], f"x{base}_c"
    with FakeLookupd() as lookupd:
        for t in [*wanted, other]:
            publish(any_broker, t, [t.encode()])
            lookupd.add_producer(t, any_broker)
        proc = spawn([*TOOL, "to-file", f"--topic-pattern=^{base}",
                      f"--lookupd-http-address={lookupd.http_hostport}",
                      f"--output-dir={tmp_path}", "--sync-interval=100ms",
                      "--datetime-format=%Y"])
        files = [tmp_path / f"{t}.{HOST}.{year()}.log" for t in wanted]
        wait_until(lambda: all(f.exists() and f.stat().st_size > 0 for f in files), 15,
                   what="files for the matching topics")
        stop(proc)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f.name for f in files)
    for t, f in zip(wanted, files, strict=True):
        assert f.read_bytes() == t.encode() + b"\n"


def test_argument_errors(tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run([*TOOL, "to-file", *args], capture_output=True,
                              timeout=30, cwd=project_root())

    r = run("--topic=t", "--nsqd-tcp-address=127.0.0.1:1", "--gzip",
            "--filename-format=<TOPIC>.log")
    assert r.returncode == 1 and b"missing <REV> in --filename-format" in r.stderr
    r = run("--topic=t", "--nsqd-tcp-address=127.0.0.1:1", "--gzip-level=10")
    assert r.returncode == 1 and b"invalid --gzip-level value (10), should be 1-9" in r.stderr
    r = run("--nsqd-tcp-address=127.0.0.1:1")
    assert r.returncode == 1 and b"--topic or --topic-pattern required" in r.stderr
    r = run("--topic-pattern=x", "--nsqd-tcp-address=127.0.0.1:1")
    assert r.returncode == 1
    assert b"--lookupd-http-address must be specified when no --topic specified" in r.stderr


@pytest.mark.parametrize("gzip", [False, True], ids=["plain", "gzip"])
def test_same_files_as_nsq_to_file(any_broker: BrokerProcess, tmp_path: Path,
                                   gzip: bool) -> None:
    go_tool = require_program("nsq_to_file")
    topic = unique_name("tf_cmp")
    for ch in ("go", "py"):                 # both channels exist before publishing
        c = Consumer(topic, ch, lambda m: None, max_in_flight=0)
        c.connect_to_nsqd(any_broker.tcp_hostport)
        c.close()
    bodies = [b"cmp-%03d %s" % (i, b"x" * (i % 17)) for i in range(300)]
    publish(any_broker, topic, bodies)
    extra = ["--gzip", "--rotate-size=2000"] if gzip else []
    go_dir, py_dir = tmp_path / "go", tmp_path / "py"
    common = [f"--topic={topic}", "--sync-interval=100ms", "--datetime-format=%Y", *extra]
    go = spawn([go_tool, *common, "--channel=go", f"--output-dir={go_dir}",
                f"--nsqd-tcp-address={any_broker.tcp_hostport}"])
    py = start_to_file(any_broker, *common, "--channel=py", f"--output-dir={py_dir}")
    total = sum(len(b) + 1 for b in bodies)

    def done(d: Path) -> bool:
        return d.exists() and sum(len(content(p)) for p in d.iterdir()) >= total

    try:
        wait_until(lambda: done(go_dir) and done(py_dir), 20, what="both tools to finish")
    finally:
        go.send_signal(signal.SIGTERM)
        go.communicate(timeout=20)
        stop(py)
    go_files = sorted(p.name for p in go_dir.iterdir())
    assert sorted(p.name for p in py_dir.iterdir()) == go_files
    for name in go_files:
        assert content(py_dir / name) == content(go_dir / name), name


def test_sighup_closes_and_moves_the_current_file(any_broker: BrokerProcess,
                                                  tmp_path: Path) -> None:
    topic = unique_name("tf_hup")
    out, work = tmp_path / "out", tmp_path / "work"
    publish(any_broker, topic, [b"one", b"two"])
    proc = start_to_file(any_broker, f"--topic={topic}", f"--output-dir={out}",
                         f"--work-dir={work}")
    rev0 = out / f"{topic}.{HOST}-000000.{year()}.log"
    wait_until(lambda: any(p.stat().st_size >= 8 for p in work.glob("*.log")), 15,
               what="the first lines in the work dir")
    proc.send_signal(signal.SIGHUP)           # sync, close, move; keep running
    wait_until(rev0.exists, 10, what="the file moved by SIGHUP")
    assert proc.poll() is None, "SIGHUP must not stop the tool"
    publish(any_broker, topic, [b"three"])
    rev1 = work / f"{topic}.{HOST}-000001.{year()}.log"
    wait_until(lambda: rev1.exists() and rev1.stat().st_size == 6, 10, what="the next file")
    stop(proc)
    assert rev0.read_bytes() == b"one\ntwo\n"
    assert (out / rev1.name).read_bytes() == b"three\n"
