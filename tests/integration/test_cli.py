"""The command line as a new user meets it: --version, exit codes and one-line errors,
--help at 80 columns with real types, pub's summary on a terminal, to-file's log level."""
from __future__ import annotations

import os
import pty
import re
import select
import signal
import subprocess
import sys
import time

import pytest

from pybroker import __version__
from tests.support.broker import BrokerProcess, project_root, unique_name, wait_until
from tests.support.tools import TOOL, reap_tools, run_tool, spawn  # noqa: F401

pytestmark = pytest.mark.timeout(60)

COMMANDS = ["serve", "tail", "to-file", "pub", "stat", "rewind", "spark archive",
            "dead-letters list", "dead-letters show", "dead-letters republish"]


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = dict(os.environ, **(env or {}))
    return subprocess.run([*TOOL, *args], capture_output=True, text=True, timeout=30,
                          env=full, cwd=project_root())


def test_version_on_the_group_and_on_serve() -> None:
    for args in (["--version"], ["serve", "--version"]):
        r = _cli(*args)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == f"pybroker v{__version__} (nsqd protocol v1.3.0)"
    r = subprocess.run([os.path.join(os.path.dirname(sys.executable), "pybroker"), "--version"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and __version__ in r.stdout


@pytest.mark.parametrize("args,needle", [
    (["serve", "--tcp-address=127.0.0.1:99999"],
     "tcp_address: port 99999 in '127.0.0.1:99999' is out of range 0..65535"),
    (["serve", "--http-address=127.0.0.1:70000"], "http_address: port 70000"),
    (["serve", "--tcp-address=nowhere"], "tcp_address: 'nowhere' is not <host>:<port>"),
    (["serve", "--mem-queue-size=lots"], "flag --mem-queue-size: expected an integer"),
    (["serve", "--msg-timeout=60"], "flag --msg-timeout: invalid duration '60'"),
    (["serve", "--deflate=maybe"], "flag --deflate: expected true or false"),
    (["serve", "--log-level=loud"], "log_level: unknown level 'loud'"),
])
def test_bad_flags_exit_2_with_one_line(args: list[str], needle: str) -> None:
    r = _cli(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.startswith("pybroker: bad configuration: ")
    assert needle in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_unknown_command_and_flag_exit_2() -> None:
    r = _cli("nosuch")
    assert r.returncode == 2 and "No such command 'nosuch'" in r.stderr
    r = _cli("serve", "--no-such-flag")
    assert r.returncode == 2 and "No such option: --no-such-flag" in r.stderr


def test_bare_number_duration_in_toml_is_milliseconds(tmp_path: object) -> None:
    from pathlib import Path

    from pybroker.config import MS, load_toml, resolve
    cfg = Path(str(tmp_path)) / "c.toml"
    cfg.write_text("msg_timeout = 1500\nsync_timeout = \"3s\"\n")
    o = resolve(load_toml(str(cfg)), {})
    assert (o.msg_timeout, o.sync_timeout) == (1500 * MS, 3000 * MS)
    help_text = _cli("serve", "--help", env={"COLUMNS": "80"}).stdout
    assert "In a TOML file a bare number is milliseconds" in " ".join(help_text.split())


def _help(cmd: str) -> str:
    r = _cli(*cmd.split(), "--help", env={"COLUMNS": "80"})
    assert r.returncode == 0, r.stderr
    return r.stdout


def _flag_names(cmd: str) -> list[str]:
    """Every long flag the command declares, read from click, not from the help text."""
    from pybroker.cli import full_app
    import typer.main
    group = typer.main.get_command(full_app())
    command = group
    for name in cmd.split():
        command = command.commands[name]  # type: ignore[attr-defined]
    return [o for p in command.params for o in getattr(p, "opts", []) if o.startswith("--")]


@pytest.mark.parametrize("cmd", COMMANDS)
def test_help_fits_80_columns_with_whole_flag_names(cmd: str) -> None:
    text = _help(cmd)
    for line in text.splitlines():
        assert len(line) <= 80, line
        assert "\u2026" not in line, line               # nothing cut with an ellipsis
    assert "<str>" not in text and "<list[str]>" not in text
    assert not any(ch in text for ch in "\r\x1b")   # no raw control characters
    words = set(re.findall(r"--[a-z0-9-]+", text))
    for flag in _flag_names(cmd):
        assert flag in words, f"{flag} not shown whole in `{cmd} --help`"


def test_serve_help_names_value_types() -> None:
    text = _help("serve")
    for flag, meta in [("--mem-queue-size", "INT"), ("--msg-timeout", "DURATION"),
                       ("--queue-scan-dirty-percent", "FLOAT"), ("--deflate", "true|false"),
                       ("--tcp-address", "HOST:PORT"), ("--data-path", "PATH"),
                       ("--lookupd-tcp-address", "HOST:PORT"), ("--log-level", "TEXT"),
                       ("--queue-scan-refresh-interval", "DURATION"),
                       ("--queue-scan-selection-count", "INT")]:
        assert re.search(rf"^  {re.escape(flag)} {re.escape(meta)}\b", text, re.M), flag
    assert "[default: 1m]" in text and "[default: 10000]" in text


@pytest.mark.parametrize("cmd", COMMANDS)
def test_help_says_defaults_one_way_and_only_possible_ones(cmd: str) -> None:
    """`[default: X]` as click writes it everywhere, never `(default: X)`; no Python
    types as placeholders; an option with a numeric range has a numeric placeholder."""
    text = " ".join(_help(cmd).split())
    assert "(default:" not in text, text
    assert not re.search(r"<(str|int|float|bool|list\[\w+\])>", text), text
    assert not re.search(r"\bTEXT\s+(?:(?!--)[^\[])*\[(x>=|\d+<=x)", text), text
    assert text.count("[default:") == len(re.findall(r"\[default:[^\]]*\]", text))


def test_serve_help_shows_possible_defaults() -> None:
    text = " ".join(_help("serve").split())
    assert re.search(r"--tls-required true\|false\|tcp-https .*?\[default: false\]", text)
    assert '[default: "[pybroker] "]' in text
    assert "[default: from hostname]" in text


def test_tool_help_texts() -> None:
    pub = _help("pub")
    assert "[default: (\\n)]" in pub                 # the newline shown escaped
    assert re.search(r"^  -rate, --rate INT", pub, re.M)
    tail = _help("tail")
    assert re.search(r"^  -n, --total-messages INT", tail, re.M)
    assert "--n," not in tail
    to_file = _help("to-file")
    assert re.search(r"--log-level TEXT\s+set log verbosity.*\[default: info\]",
                     " ".join(to_file.split()))


def _publish(b: BrokerProcess, topic: str, n: int) -> None:
    from pybroker.client import Producer
    p = Producer(b.tcp_hostport)
    try:
        for i in range(n):
            p.publish(topic, f"m{i}".encode())
    finally:
        p.stop()


def test_tail_accepts_gos_double_dash_n(broker: BrokerProcess) -> None:
    topic = unique_name("cli_tail")
    _publish(broker, topic, 3)   # queued for the channel tail makes
    proc = spawn([*TOOL, "tail", f"--topic={topic}", "--channel=c",
                  f"--nsqd-tcp-address={broker.tcp_hostport}", "--n=2"])
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert out.splitlines() == [b"m0", b"m1"]


def test_pub_bad_topic_says_so_without_bytes_reprs(broker: BrokerProcess) -> None:
    r = run_tool("pub", "--topic=bad topic!", f"--nsqd-tcp-address={broker.tcp_hostport}",
                 input=b"x\n")
    assert r.returncode == 1
    assert b'topic name "bad topic!" is not valid' in r.stderr
    assert b"b'" not in r.stderr and b"Traceback" not in r.stderr


def _run_on_pty(argv: list[str], stdin: bytes, timeout_s: float = 20.0) -> tuple[int, bytes]:
    """Run argv with stdout and stderr on a pseudo-terminal; return (status, output)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=slave, stderr=slave,
                            cwd=project_root())
    os.close(slave)
    assert proc.stdin is not None
    proc.stdin.write(stdin)
    proc.stdin.close()
    out = b""
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:        # EIO: every writer closed its end
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
        return proc.wait(timeout_s), out
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


def test_pub_prints_a_summary_on_a_terminal_only(broker: BrokerProcess) -> None:
    topic = unique_name("cli_pub")
    lines = b"".join(b"line %d\n" % i for i in range(500))
    code, out = _run_on_pty([*TOOL, "pub", f"--topic={topic}",
                             f"--nsqd-tcp-address={broker.tcp_hostport}"], lines)
    assert code == 0, out
    last = out.rsplit(b"\r\x1b[K", 1)[-1].decode()
    assert re.fullmatch(r"pub: 500 messages, 3\.\dKiB in \d+\.\ds \(\d+ msg/s\)\r?\n",
                        last.replace(" KiB", "KiB")), out
    # through a pipe (a script's view) it prints nothing at all
    r = run_tool("pub", f"--topic={topic}", f"--nsqd-tcp-address={broker.tcp_hostport}",
                 input=lines)
    assert r.returncode == 0 and r.stdout == b"" and r.stderr == b""


def test_to_file_logs_at_info_by_default(broker: BrokerProcess, tmp_path: object) -> None:
    topic = unique_name("cli_tofile")
    proc = spawn([*TOOL, "to-file", f"--topic={topic}", "--channel=c",
                  f"--nsqd-tcp-address={broker.tcp_hostport}", f"--output-dir={tmp_path}"])
    _publish(broker, topic, 1)
    assert proc.stderr is not None
    os.set_blocking(proc.stderr.fileno(), False)
    seen = bytearray()

    def opened() -> bool:
        seen.extend(proc.stderr.read() or b"")  # type: ignore[union-attr]
        return b"opening" in seen

    wait_until(opened, 15, what="to-file's INFO line about the file it opens")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=20)
    seen.extend(err or b"")
    assert proc.returncode == 0, bytes(seen)
    text = bytes(seen).decode()
    assert re.search(r"^\[to-file\] \d{4}/\d\d/\d\d \d\d:\d\d:\d\d INFO: ", text, re.M), text


@pytest.mark.parametrize("args", [["tail", "--topic=t"], ["dead-letters", "list", "--topic=t"],
                                  ["to-file", "--topic=t", "--output-dir=."]])
def test_a_refused_connection_names_the_address(args: list[str]) -> None:
    import socket
    with socket.socket() as s:           # a port that was free a moment ago: refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = _cli(*args, f"--nsqd-tcp-address=127.0.0.1:{port}")
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert f"cannot connect to 127.0.0.1:{port}: Connection refused" in r.stderr, r.stderr
