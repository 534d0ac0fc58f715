"""The README's test command is the one CI runs (.ci/run), and it runs in parallel."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _pytest_line(text: str) -> str:
    found = re.findall(r"^python3 -m venv .*?\.venv/bin/python -m pytest.*$", text, re.M)
    assert len(found) == 1, found
    return found[0].replace(" -q ", " ").strip()


def test_readme_and_ci_run_the_same_suite_command() -> None:
    readme = _pytest_line((ROOT / "README.md").read_text())
    ci = _pytest_line((ROOT / ".ci" / "run").read_text())
    assert readme == ci
    assert re.search(r"-m pytest .*-n \d+", readme), readme     # pytest-xdist workers
