"""Installing as a new user does: ``pip install .`` from a fresh checkout into a new
virtualenv, without a C compiler (CC=false) and with one, then running the broker
installed and from the checkout (whose pybroker/ has no compiled module)."""
from __future__ import annotations

import json
import os
import runpy
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.support.broker import BrokerProcess, project_root, unique_name
from tests.support.programs import missing, require_program

pytestmark = pytest.mark.timeout(600)

WARNING = "the C codec (pybroker._native._nsqframe) is not built"
DOC_KEYS = ["version", "health", "start_time", "topics", "memory", "producers"]
# pybroker's extra top-level keys, after nsqd's (tests/integration/test_stats.py checks them)
EXTRA_KEYS = ("codec", "refused_connections")


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the files git tracks: what a fresh clone holds (no build outputs)."""
    root = project_root()
    git = require_program("git", "to tell tracked files from build outputs")
    if not (root / ".git").exists():
        missing("not a git checkout: cannot tell tracked files from build outputs")
    files = subprocess.run([git, "ls-files", "-z"], cwd=root, check=True,
                           capture_output=True).stdout.decode().split("\0")
    dest = tmp_path_factory.mktemp("clone")
    for name in filter(None, files):
        if (root / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / name, dest / name)
    assert not list(dest.rglob("_nsqframe*.so"))
    return dest


def _venv(where: Path, checkout: Path, env: dict[str, str]) -> Path:
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True, timeout=120)
    python = where / "bin" / "python"
    r = subprocess.run([str(python), "-m", "pip", "install", "-v", str(checkout)],
                       capture_output=True, text=True, timeout=500, env=env,
                       cwd=str(where))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    (where / "pip-install.log").write_text(r.stdout + r.stderr)
    return python


def _site_native(python: Path) -> Path:
    out = subprocess.run([str(python), "-c", "import pybroker, os; print(os.path.dirname("
                          "pybroker.__file__))"], capture_output=True, text=True, check=True,
                         cwd="/", timeout=60).stdout.strip()
    return Path(out) / "_native"


@pytest.fixture(scope="module")
def no_compiler(tmp_path_factory: pytest.TempPathFactory, checkout: Path) -> Path:
    """A virtualenv where pybroker was installed with CC=false (no C compiler)."""
    env = dict(os.environ, CC="false")
    env.pop("PYBROKER_STRICT_CFLAGS", None)
    return _venv(tmp_path_factory.mktemp("venv-cc-false"), checkout, env)


@pytest.fixture(scope="module")
def with_compiler(tmp_path_factory: pytest.TempPathFactory, checkout: Path) -> Path:
    """A virtualenv where pybroker was installed with a C compiler."""
    require_program(os.environ.get("CC", "cc"), "(a C compiler) to build the C codec with")
    env = {k: v for k, v in os.environ.items() if k != "PYBROKER_STRICT_CFLAGS"}
    return _venv(tmp_path_factory.mktemp("venv-cc"), checkout, env)


def _serve(python: Path, cwd: Path, tmp: Path) -> BrokerProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYBROKER_PURE")}
    b = BrokerProcess("pybroker", data_path=str(tmp / unique_name("data")),
                      python=str(python), cwd=str(cwd))
    b.env = env
    return b.start()


def _stats(b: BrokerProcess) -> dict[str, object]:
    with urllib.request.urlopen(b.http_url + "/stats?format=json", timeout=5) as r:
        doc: dict[str, object] = json.load(r)
    return doc


def _round_trip(b: BrokerProcess) -> None:
    from pybroker.client import Consumer, Producer
    got: list[bytes] = []
    topic = unique_name("pkg")
    with Producer(b.tcp_hostport) as p:
        p.multi_publish(topic, [b"a", b"b"])
    c = Consumer(topic, "c", lambda m: got.append(m.body))
    c.connect_to_nsqd(b.tcp_hostport)
    try:
        from tests.support.broker import wait_until
        wait_until(lambda: len(got) == 2, 10, what="both messages")
    finally:
        c.close(5)
    assert got == [b"a", b"b"]


def _stop_clean(b: BrokerProcess) -> str:
    code = b.stop()
    text = b.stderr_text()
    assert code == 0 and "Traceback" not in text, text
    return text


def test_install_without_a_compiler_runs_the_pure_codec(no_compiler: Path,
                                                        tmp_path: Path) -> None:
    log = (no_compiler.parent.parent / "pip-install.log").read_text()
    assert "the C codec was not built" in log          # setup.py said why, and went on
    assert not list(_site_native(no_compiler).glob("_nsqframe*"))
    b = _serve(no_compiler, tmp_path, tmp_path)         # run from outside any checkout
    try:
        _round_trip(b)
        doc = _stats(b)
        assert doc["codec"] == "pure"
        assert [k for k in doc if k not in EXTRA_KEYS] == DOC_KEYS   # nsqd's keys unchanged
    finally:
        text = _stop_clean(b)
    warnings = [ln for ln in text.splitlines() if WARNING in ln]
    assert len(warnings) == 1 and " WARN: " in warnings[0], text
    assert "INFO: codec: pure (the C codec is not built)" in text


def test_install_with_a_compiler_runs_the_c_codec(with_compiler: Path, tmp_path: Path) -> None:
    assert list(_site_native(with_compiler).glob("_nsqframe*.so"))
    log = (with_compiler.parent.parent / "pip-install.log").read_text()
    assert "-Werror" not in log                        # a user's build: warnings stay warnings
    b = _serve(with_compiler, tmp_path, tmp_path)
    try:
        _round_trip(b)
        assert _stats(b)["codec"] == "c"
    finally:
        text = _stop_clean(b)
    assert WARNING not in text and "INFO: codec: c" in text


def test_the_install_has_the_pybroker_nsqd_script(with_compiler: Path, tmp_path: Path) -> None:
    """pip installs the drop-in nsqd beside pybroker: nsqd's version format, its flags."""
    script = with_compiler.parent / "pybroker-nsqd"
    r = subprocess.run([str(script), "-version"], capture_output=True, text=True, timeout=60,
                       cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("nsqd v1.3.0-compat (built w/pybroker-")
    r = subprocess.run([str(script), "-no-such-flag"], capture_output=True, text=True,
                       timeout=60, cwd=tmp_path)
    assert (r.returncode, r.stderr) == (2, "flag provided but not defined: -no-such-flag\n")


def test_python_m_pybroker_from_the_checkout_after_install(with_compiler: Path,
                                                            checkout: Path,
                                                            tmp_path: Path) -> None:
    """The checkout's pybroker/ shadows the installed one and has no compiled module:
    it runs on the pure codec, says so once, serves, and stops with status 0."""
    r = subprocess.run([str(with_compiler), "-m", "pybroker", "--version"], cwd=checkout,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("pybroker v"), r.stderr
    b = _serve(with_compiler, checkout, tmp_path)
    try:
        _round_trip(b)
        assert _stats(b)["codec"] == "pure"
    finally:
        text = _stop_clean(b)
    warnings = [ln for ln in text.splitlines() if WARNING in ln]
    assert len(warnings) == 1, text
    # the advice names the cause (the source tree was imported), not `pip install .`,
    # which is what the user did
    assert f"imported from its source tree {checkout}" in warnings[0], warnings[0]
    assert "(pip install .)" not in warnings[0]


def test_werror_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """-Werror comes from PYBROKER_STRICT_CFLAGS=1 (which CI exports), never by default."""
    build = str(project_root() / "pybroker" / "_native" / "build.py")

    def flags() -> list[str]:
        ns = runpy.run_path(build)
        return list(ns["ffibuilder"]._assigned_source[3]["extra_compile_args"])

    monkeypatch.delenv("PYBROKER_STRICT_CFLAGS", raising=False)
    assert "-Werror" not in flags() and "-Wall" in flags()
    monkeypatch.setenv("PYBROKER_STRICT_CFLAGS", "1")
    assert "-Werror" in flags()
    ci = (project_root() / ".ci" / "run").read_text()
    assert "export PYBROKER_STRICT_CFLAGS=1" in ci
