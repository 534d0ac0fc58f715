"""The outside programs the suite compares against or traces with, found in one place.

``require_program("nsq_tail")`` returns the program's path, or ends the test when it is
missing: with a skip that names it (a user's run of the README's test command), or, when
``PYBROKER_TEST_STRICT`` is set (``.ci/run`` sets it), with a failure, so that a green CI
run means every comparison with real NSQ ran. A program is looked for in ``$NAME`` (the
name upper-cased, ``-`` and ``.`` as ``_``: ``$NSQD``, ``$GO_NSQ_TEST``), then on PATH,
then beside ``$NSQD``.

What strict mode requires, all provided by ``.ci/run`` (or present in any CI clone):
NSQ's programs (nsqd, nsqlookupd, nsqadmin, nsq_tail, nsq_to_file, nsq_stat, to_nsq,
bench_writer/bench_reader), etcd (Debian's etcd-server), go-nsq's compiled test suite with its source directory
($GO_NSQ_DIR) and a private network namespace to run it in, strace, curl, a Java runtime,
Chromium and chromedriver (Debian's chromium, chromium-driver), the extras (pyspark,
pyarrow, locust, selenium), git and a C compiler.

The skips that remain in a strict run, each for a reason no CI set-up changes:
- systemd-analyze missing: the unit file's check (containers run no systemd);
- pynsq 0.9.1 with snappy or deflate against nsqd itself: nsqd writes its compression
  frames in pieces that pynsq on tornado 6 cannot read (gnsq covers those modes on nsqd).
"""
from __future__ import annotations

import importlib
import os
import shutil
from types import ModuleType
from typing import NoReturn

import pytest

STRICT_VAR = "PYBROKER_TEST_STRICT"


def strict() -> bool:
    """True when a missing comparison program is a failure (CI), not a skip."""
    return os.environ.get(STRICT_VAR, "").strip() not in ("", "0", "false", "no")


def missing(reason: str, *, required_in_ci: bool = True) -> NoReturn:
    """End the test for a missing outside program: a skip, or in strict mode a failure
    (unless ``required_in_ci`` is False: a prerequisite CI cannot provide either)."""
    if required_in_ci and strict():
        pytest.fail(f"{reason} [{STRICT_VAR} is set: a comparison that cannot run is a "
                    "failure]", pytrace=False)
    # reported at the test that needed the program, not at this line (pytest.skip raised
    # from a helper is reported where it was raised)
    raise pytest.skip.Exception(reason, allow_module_level=True, _use_item_location=True)


def env_name(name: str) -> str:
    return name.upper().replace("-", "_").replace(".", "_")


def _executable(path: str | None) -> str | None:
    return path if path and os.path.isfile(path) and os.access(path, os.X_OK) else None


def find_program(name: str) -> str | None:
    """$NAME, else ``name`` on PATH, else ``name`` beside $NSQD; None when not found."""
    found = _executable(os.environ.get(env_name(name)) or shutil.which(name))
    nsqd = os.environ.get("NSQD")
    if found is None and nsqd:
        found = _executable(os.path.join(os.path.dirname(nsqd), name))
    return found


def require_program(name: str, purpose: str = "to compare against", *,
                    required_in_ci: bool = True) -> str:
    """The path of program ``name``, or the test ends (skip, or failure in strict mode)."""
    path = find_program(name)
    if path is None:
        missing(f"no {name} binary on PATH (or ${env_name(name)}) {purpose}",
                required_in_ci=required_in_ci)
    return path


def require_nsqd() -> str:
    return require_program("nsqd", "to compare against")


def require_dir(var: str, marker: str, purpose: str) -> str:
    """A directory named by environment variable ``var`` holding ``marker``."""
    path = os.environ.get(var, "")
    if not path or not os.path.exists(os.path.join(path, marker)):
        missing(f"${var} does not name a directory with {marker} ({purpose})")
    return path


def require_module(name: str, purpose: str) -> ModuleType:
    """Import an optional module (an extra CI installs), or end the test."""
    try:
        return importlib.import_module(name)
    except ImportError:
        missing(f"{name} is not installed ({purpose})")
