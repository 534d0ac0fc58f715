"""conf/pybroker.service: systemd accepts it, and what it runs is what pybroker serves."""
from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

from pybroker.config import load_toml
from tests.support.broker import BrokerProcess, project_root
from tests.support.programs import require_program

UNIT = project_root() / "conf" / "pybroker.service"
PROD = project_root() / "conf" / "prod.toml"


def directives() -> dict[str, list[str]]:
    """Key -> values of the unit's directives (a key may repeat)."""
    out: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    return out


def test_systemd_accepts_the_unit(tmp_path: Path) -> None:
    # a skip even in strict mode: CI containers run no systemd
    analyze = require_program("systemd-analyze", "to check the unit with",
                              required_in_ci=False)
    # systemd also checks that ExecStart is executable and that User exists: point them at
    # this environment's pybroker and at root, the only user sure to exist
    pybroker = Path(sys.executable).parent / "pybroker"
    text = (UNIT.read_text().replace("/opt/pybroker/bin/pybroker", str(pybroker))
            .replace("User=pybroker", "User=root").replace("Group=pybroker", "Group=root"))
    unit = tmp_path / "pybroker.service"
    unit.write_text(text)
    r = subprocess.run([analyze, "verify", str(unit)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and r.stderr.strip() == "", r.stderr


def test_the_unit_runs_pybroker_serve_with_the_prod_config(tmp_path: Path) -> None:
    d = directives()
    argv = shlex.split(d["ExecStart"][0])
    assert argv[0].endswith("/bin/pybroker") and argv[1:3] == ["serve", "-c"]
    # prod.toml's data path is the unit's StateDirectory and working directory
    data_path = load_toml(str(PROD))["data_path"]
    assert data_path == "/var/lib/" + d["StateDirectory"][0] == d["WorkingDirectory"][0]
    assert d["ReadWritePaths"] == [data_path]
    assert d["RestartPreventExitStatus"] == ["2"]       # a bad configuration exits 2
    assert d["KillSignal"] == ["SIGTERM"] and int(d["LimitNOFILE"][0]) >= 65536
    # the same command line, with the shipped config, serves and stops cleanly on SIGTERM
    b = BrokerProcess("pybroker",
                      data_path=str(tmp_path / "data"))
    b.command = lambda: [sys.executable, "-m", "pybroker", *argv[1:3], str(PROD),  # type: ignore[method-assign]
                         "--tcp-address=127.0.0.1:0", "--http-address=127.0.0.1:0",
                         f"--data-path={tmp_path / 'data'}"]
    b.start()
    assert b.ping()
    code = b.stop()
    assert code == 0 and "Traceback" not in b.stderr_text(), b.stderr_text()
    assert "fd limit" in b.stderr_text()                # the limit it runs with is logged


# -- conf/pybroker-nsqd.service: the drop-in nsqd (docs/dropin.md) -----------------------
DROPIN_UNIT = project_root() / "conf" / "pybroker-nsqd.service"
NSQD_CFG = project_root() / "conf" / "nsqd.cfg"


def test_systemd_accepts_the_dropin_unit(tmp_path: Path) -> None:
    # a skip even in strict mode: CI containers run no systemd
    analyze = require_program("systemd-analyze", "to check the unit with",
                              required_in_ci=False)
    dropin = Path(sys.executable).parent / "pybroker-nsqd"
    text = (DROPIN_UNIT.read_text().replace("/opt/pybroker/bin/pybroker-nsqd", str(dropin))
            .replace("User=nsqd", "User=root").replace("Group=nsqd", "Group=root"))
    unit = tmp_path / "nsqd.service"
    unit.write_text(text)
    r = subprocess.run([analyze, "verify", str(unit)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and r.stderr.strip() == "", r.stderr


def test_the_dropin_unit_runs_nsqds_command_line_with_nsqd_cfg(tmp_path: Path) -> None:
    d: dict[str, list[str]] = {}
    for line in DROPIN_UNIT.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            d.setdefault(key, []).append(value)
    argv = shlex.split(d["ExecStart"][0])
    assert argv[0].endswith("/bin/pybroker-nsqd")
    assert argv[1:] == ["-config=/etc/nsqd/nsqd.cfg", "-data-path=/var/lib/nsqd"]
    assert "/var/lib/" + d["StateDirectory"][0] == d["WorkingDirectory"][0] == \
        load_toml(str(NSQD_CFG))["data_path"]
    assert d["RestartPreventExitStatus"] == ["2"] and d["KillSignal"] == ["SIGTERM"]
    # the shipped nsqd.cfg as nsqd's flags would override it: flags win over the file
    b = BrokerProcess("nsqd", data_path=str(tmp_path / "data"))
    b.command = lambda: [sys.executable, "-m", "pybroker.nsqd_cli",  # type: ignore[method-assign]
                         f"-config={NSQD_CFG}", f"-data-path={tmp_path / 'data'}",
                         "-tcp-address=127.0.0.1:0", "-http-address=127.0.0.1:0"]
    b.start()
    assert b.ping()
    code = b.stop()
    assert code == 0 and "Traceback" not in b.stderr_text(), b.stderr_text()
    assert b.stderr_text().startswith("[nsqd] ")            # nsqd's log prefix
    assert "WARN" not in b.stderr_text()                   # every key of nsqd.cfg is known
