"""Smoke runs of the bench (loadtest/bench.py == ``pybroker bench``): it runs every
scenario for a second and reports non-zero figures. No timing assertions: the figures
depend on the machine; the point is that the instrument works end to end."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from tests.support.broker import project_root
from tests.support.programs import require_nsqd

pytestmark = pytest.mark.timeout(90)

BENCH = str(project_root() / "loadtest" / "bench.py")
QUICK = ["--duration=1s", "--connections=1", "--rate=2000", "--memory-messages=20000",
         "--size=100", "--batch-size=50"]


def run_bench(tmp_path: Path, *args: str) -> tuple[dict, str]:
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, BENCH, *QUICK, f"--json={out}", *args],
                          capture_output=True, text=True, timeout=80, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text()), proc.stdout


def test_every_scenario_reports_nonzero_figures(tmp_path: Path) -> None:
    table_path = tmp_path / "table.md"
    result, stdout = run_bench(tmp_path, f"--table={table_path}")
    s = result["summary"]
    py = {scenario: s[scenario]["pybroker"] for scenario in s}
    assert set(py) == {"pub", "sub", "pubsub", "latency", "memory"}
    assert all(p["ok_runs"] == 1 for p in py.values()), py
    assert py["pub"]["pub_msgs_s"] > 0 and py["pub"]["pub_mb_s"] > 0
    assert py["sub"]["sub_msgs_s"] > 0 and py["sub"]["prefilled"] > 0
    assert py["pubsub"]["pub_msgs_s"] > 0 and py["pubsub"]["sub_msgs_s"] > 0
    lat = py["latency"]
    assert lat["received"] > 0 and lat["lost"] == 0
    assert 0 < lat["e2e_p50_ms"] <= lat["e2e_p99_ms"] <= lat["e2e_p99.9_ms"]
    mem = py["memory"]
    assert mem["messages"] == 20000 and mem["drained"] == 20000
    assert mem["rss_after"] > 0 and mem["bytes_per_msg"] > 0
    assert all(p["peak_rss"] > 0 for p in py.values())
    # the human-readable table, on stdout and in the --table file
    for text in (stdout, table_path.read_text()):
        assert "| pub | publish msgs/s |" in text
        assert "| latency | end-to-end p99 ms |" in text
        assert "| memory | bytes per message |" in text


@pytest.mark.nsqd
def test_vs_nsqd_prints_ratios_and_plots(tmp_path: Path) -> None:
    nsqd = require_nsqd()
    extra = []
    has_plot = importlib.util.find_spec("matplotlib") is not None
    if has_plot:
        extra.append(f"--plot={tmp_path / 'bench.png'}")
    result, stdout = run_bench(tmp_path, "--scenarios=pub,latency", f"--vs-nsqd={nsqd}",
                               *extra)
    for scenario in ("pub", "latency"):
        entry = result["summary"][scenario]
        assert entry["nsqd"]["ok_runs"] == 1 and entry["pybroker"]["ok_runs"] == 1
    assert result["summary"]["pub"]["ratio"]["pub_msgs_s"] > 0
    assert result["summary"]["latency"]["ratio"]["e2e_p99_ms"] > 0
    assert "| scenario | figure | pybroker | nsqd | pybroker/nsqd |" in stdout
    # brokers alternate: for each scenario, pybroker then nsqd (run 1)
    order = [(r["scenario"], r["broker"]) for r in result["records"]]
    assert order == [("pub", "pybroker"), ("pub", "nsqd"),
                     ("latency", "pybroker"), ("latency", "nsqd")]
    if has_plot:
        assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_register_adds_the_bench_command() -> None:
    from pybroker.bench.cli import register

    app = typer.Typer()

    @app.command()
    def other() -> None:
        """A second command, so that typer keeps sub-commands."""

    register(app)
    result = CliRunner().invoke(app, ["bench", "--help"])
    assert result.exit_code == 0, result.output
    assert "--vs-nsqd" in result.output and "--scenarios" in result.output


def test_bad_scenario_is_refused(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, BENCH, "--scenarios=pub,nope"],
                          capture_output=True, text=True, timeout=30, cwd=tmp_path, check=False)
    assert proc.returncode == 2
    assert "nope" in proc.stderr


def test_figures_arithmetic() -> None:
    """The numbers the table is made of: nearest-rank percentiles, Go durations, and
    pybroker/nsqd as the median of per-run ratios (not the ratio of medians)."""
    from pybroker.bench.runner import paired_ratios
    from pybroker.bench.stats import parse_duration, percentiles

    assert percentiles(range(1, 1001), (50, 99, 99.9, 100)) == {
        "p50": 500.0, "p99": 990.0, "p99.9": 999.0, "p100": 1000.0}
    assert percentiles([], (50,)) == {}
    assert parse_duration("1m30s") == 90.0 and parse_duration("250ms") == 0.25
    assert parse_duration("2") == 2.0
    with pytest.raises(ValueError):
        parse_duration("10 parsecs")
    records = [{"run": run, "broker": b, "scenario": "pub", "pub_msgs_s": v}
               for run, b, v in [(1, "pybroker", 100), (1, "nsqd", 400), (2, "pybroker", 300),
                                 (2, "nsqd", 100), (3, "pybroker", 200), (3, "nsqd", 200)]]
    # per-run ratios 0.25, 3.0, 1.0 -> median 1.0 (medians 200/200 would also say 1.0,
    # so drop run 3's nsqd: ratios 0.25, 3.0 -> 1.625; the ratio of medians is 200/250)
    assert paired_ratios(records)["pub_msgs_s"] == 1.0
    assert paired_ratios(records[:-1])["pub_msgs_s"] == pytest.approx(1.625)


def test_relay_floor_prints_both_settings(tmp_path: Path) -> None:
    """loadtest/bench_relay_floor.py (docs/replication.md, "The floor"): one short run
    of each setting prints a non-zero rate and CPU figures for each."""
    script = str(project_root() / "loadtest" / "bench_relay_floor.py")
    proc = subprocess.run([sys.executable, script, "--runs=1", "--seconds=0.5"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {ln.split()[0]: ln.split() for ln in proc.stdout.splitlines()
            if ln.split() and ln.split()[0] in ("single", "relay")}
    assert set(rows) == {"single", "relay"}, proc.stdout
    for name, row in rows.items():
        rate, leader = float(row[1].replace(",", "")), float(row[3])
        assert rate > 0 and leader > 0, (name, proc.stdout)
    assert float(rows["relay"][4]) > 0, proc.stdout        # the followers' CPU


def test_churn_prints_rates_beside_nsqd(tmp_path: Path) -> None:
    """loadtest/bench_churn.py (docs/benchmarks.md, "Connection churn"): one short run
    prints a non-zero rate and CPU a connection for pybroker and nsqd, and the ratio."""
    nsqd = require_nsqd()
    script = str(project_root() / "loadtest" / "bench_churn.py")
    proc = subprocess.run([sys.executable, script, "--runs=1", "--seconds=0.5",
                           "--threads=2", f"--nsqd={nsqd}"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    medians = {ln.split()[0]: ln.split() for ln in proc.stdout.split("medians of")[1]
               .splitlines()[1:] if ln.strip()}
    assert set(medians) == {"pybroker", "nsqd"}, proc.stdout
    for row in medians.values():
        assert float(row[1].replace(",", "")) > 0 and float(row[3]) > 0, proc.stdout
    assert medians["pybroker"][-2].endswith("x"), proc.stdout
