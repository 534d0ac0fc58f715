"""The pytest plugin shipped with the package (pybroker.testing, entry point ``pytest11``).

Each test writes a small test suite that uses only the plugin's fixtures and runs it with
pytester in a separate pytest process, so the plugin is found through its entry point,
exactly as in a user's project."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    # -p no:cacheprovider: nothing written into the temporary project but what it makes
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", *args, timeout=90)


USER_SUITE = '''
import json, os, urllib.request

def test_addresses_and_data_path(pybroker_server):
    host, port = pybroker_server.tcp_address
    assert host == "127.0.0.1" and port > 0
    assert pybroker_server.http_hostport.startswith("127.0.0.1:")
    with urllib.request.urlopen(pybroker_server.http_url + "/ping", timeout=5) as r:
        assert r.read() == b"OK"
    assert os.path.isdir(pybroker_server.data_path)
    with open(os.environ["PIDS"], "a") as f:
        f.write(f"{pybroker_server.pid} {pybroker_server.data_path}\\n")

def test_produce_and_consume(pybroker_producer, pybroker_consumer):
    consumer = pybroker_consumer("events", "archive")
    pybroker_producer.publish("events", b"one")
    pybroker_producer.multi_publish("events", [b"two", b"three"])
    got = consumer.wait_for(3)
    assert [m.body for m in got] == [b"one", b"two", b"three"]
    assert all(m.attempts == 1 for m in got)

def test_two_brokers_with_options(make_pybroker_server):
    small = make_pybroker_server("--max-msg-size=16")
    other = make_pybroker_server()
    assert small.tcp_address != other.tcp_address
    assert small.data_path != other.data_path
    from pybroker.client import Producer
    p = Producer(small.tcp_hostport)
    try:
        try:
            p.publish("t", b"x" * 17)
        except Exception as e:
            assert "E_BAD_MESSAGE" in str(e)
        else:
            raise AssertionError("a 17-byte message was accepted")
    finally:
        p.stop()
    with urllib.request.urlopen(other.http_url + "/stats?format=json", timeout=5) as r:
        assert json.load(r)["topics"] == []
'''


def test_the_fixtures_in_a_users_suite(pytester: pytest.Pytester, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    pids = tmp_path / "pids"
    monkeypatch.setenv("PIDS", str(pids))
    pytester.makepyfile(test_user=USER_SUITE)
    result = run(pytester, "-v")
    result.assert_outcomes(passed=3)
    # teardown stopped (and reaped) the broker process; its data path was one of pytest's
    # temporary directories of that run
    pid, data_path = pids.read_text().split()
    assert not Path(f"/proc/{pid}").exists()
    assert data_path.startswith(str(pytester.path))


def test_a_failing_test_carries_the_brokers_log(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_fail='''
        def test_fails(pybroker_producer):
            pybroker_producer.publish("logged_topic", b"x")
            assert False, "the test's own failure"

        def test_passes(pybroker_server):
            pass
    ''')
    result = run(pytester)
    result.assert_outcomes(passed=1, failed=1)
    out = result.stdout.str()
    # one log section, for the failing test only, with what the broker logged
    sections = re.findall(r"-+ pybroker log: (\S+) -+", out)
    assert len(sections) == 1, out
    assert "TCP: listening on 127.0.0.1:" in out
    assert "TOPIC(logged_topic): created" in out
    assert "the test's own failure" in out


def test_a_broker_that_crashes_fails_the_test_at_teardown(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_crash='''
        import os, signal

        def test_kills_its_broker(pybroker_server):
            os.kill(pybroker_server.pid, signal.SIGKILL)
    ''')
    result = run(pytester)
    result.assert_outcomes(passed=1, errors=1)
    out = result.stdout.str()
    assert re.search(r"pybroker \(pid \d+\) exited with status -9", out), out
    assert "pybroker log" in out


def test_a_suite_without_the_fixtures_is_untouched(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_plain='''
        import subprocess, sys

        def test_plain():
            assert 1 + 1 == 2

        def test_fails_plainly():
            assert 1 + 1 == 3
    ''')
    result = run(pytester, "--fixtures")
    out = result.stdout.str()
    for name in ("pybroker_server", "make_pybroker_server", "pybroker_producer",
                 "pybroker_consumer"):
        assert re.search(rf"^{name}\b", out, re.M), name      # registered, via pytest11
    result = run(pytester)
    result.assert_outcomes(passed=1, failed=1)
    assert "pybroker log" not in result.stdout.str()
    assert "listening on" not in result.stdout.str()           # no broker was started
