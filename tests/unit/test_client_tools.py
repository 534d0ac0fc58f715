"""Pieces of the tools without a server: file names, strftime, gzip members, stat rows, flags."""
from __future__ import annotations

import gzip
import io
import os
import time
from pathlib import Path
from typing import List

import pytest
import typer
from typer.testing import CliRunner

from pybroker.tools._common import GoFlagsCommand, Progress, opt
from pybroker.tools.files import (GzipMemberWriter, compute_filename_format, exclusive_rename,
                                  host_identifier, strftime, with_rev)
from pybroker.tools.stat import HEADER, ChannelStats, format_row


def test_strftime_matches_go_directives(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    try:
        ts = 1136239445.0                      # Go's reference time: 2006-01-02 22:04:05 UTC
        assert strftime("%Y-%m-%d_%H", ts) == "2006-01-02_22"
        assert strftime("%y %b %B %a %A %I %p %M %S %Z %z %%", ts) == \
            "06 Jan January Mon Monday 10 PM 04 05 UTC +0000 %"
        # directives Go's table lacks stay as written, like jehiah/go-strftime
        assert strftime("%j %e %Q x%", ts) == "%j %e %Q x%"
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()


def test_filename_format_rules() -> None:
    fmt = "<TOPIC>.<HOST><REV>.<DATETIME>.log"
    plain = compute_filename_format(fmt, "t", gzip=False, rotating=False,
                                    work_dir_differs=False, host="h")
    assert plain == "t.h.<DATETIME>.log"
    gz = compute_filename_format(fmt, "t", gzip=True, rotating=False, work_dir_differs=False,
                                 host="h")
    assert gz == "t.h<REV>.<DATETIME>.log.gz" and with_rev(gz, 3) == "t.h-000003.<DATETIME>.log.gz"
    assert compute_filename_format("<TOPIC><REV>.gz", "t", gzip=True, rotating=False,
                                   work_dir_differs=False, host="h") == "t<REV>.gz"
    pid = compute_filename_format("<PID>-<TOPIC><REV>", "t", gzip=False, rotating=True,
                                  work_dir_differs=False, host="h")
    assert pid == f"{os.getpid()}-t<REV>"
    for kw in ({"gzip": True}, {"rotating": True}, {"work_dir_differs": True}):
        args = {"gzip": False, "rotating": False, "work_dir_differs": False, **kw}
        with pytest.raises(ValueError, match="missing <REV>"):
            compute_filename_format("<TOPIC>.log", "t", host="h", **args)
    short = host_identifier("")
    assert "." not in short
    assert host_identifier("x-<SHORT_HOST>") == "x-" + short


def test_gzip_members_are_complete_and_go_shaped() -> None:
    buf = io.BytesIO()
    w = GzipMemberWriter(buf, 9)
    w.write(b"one\n")
    w.write(b"two\n")
    w.close()
    w = GzipMemberWriter(buf, 1)
    w.write(b"three\n")
    w.close()
    GzipMemberWriter(buf, 6).close()           # an empty member, as Go's Close writes
    data = buf.getvalue()
    assert data[:10] == b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff"   # no name, mtime 0
    assert gzip.decompress(data) == b"one\ntwo\nthree\n"
    assert data.count(b"\x1f\x8b\x08\x00\x00\x00\x00\x00") == 3


def test_exclusive_rename_never_overwrites(tmp_path: Path) -> None:
    src, dst = tmp_path / "a", tmp_path / "b"
    src.write_text("new")
    dst.write_text("old")
    with pytest.raises(FileExistsError):
        exclusive_rename(str(src), str(dst))
    assert dst.read_text() == "old" and src.exists()
    dst.unlink()
    exclusive_rename(str(src), str(dst))
    assert dst.read_text() == "new" and not src.exists()


def test_stat_row_format() -> None:
    old = ChannelStats(message_count=100, depth=10)
    cur = ChannelStats(depth=30, backend_depth=5, in_flight_count=7, deferred_count=2,
                       requeue_count=3, timeout_count=1, message_count=160, client_count=4)
    row = format_row(cur, old, 2.0)
    # ingress (160-100)/2 = 30; egress (60 - (30-10))/2 = 20; mem = 30 - 5
    assert row == ("     30      20 |      30      25       5     7     2 |"
                   "       3       1          160       4\n")
    assert HEADER.splitlines()[1].split() == ["ingress", "egress", "|", "total", "mem", "disk",
                                              "inflt", "def", "|", "req", "t-o", "msgs",
                                              "clients"]
    total = ChannelStats()
    total.add({"depth": 1, "message_count": 2, "client_count": 1, "paused": True})
    total.add({"depth": 2, "message_count": 3})
    assert (total.depth, total.message_count, total.client_count, total.paused) == (3, 5, 1,
                                                                                   True)


def _flag_app() -> typer.Typer:
    app = typer.Typer()

    @app.command("x", cls=GoFlagsCommand)
    def x(topic: List[str] = opt([], "topic", help="t"),
          gz: bool = opt(False, "gzip", help="g"),
          n: int = typer.Option(0, "-n", "--n", help="n")) -> None:
        typer.echo(f"{topic} {gz} {n}")

    @app.command("y")
    def y() -> None:
        pass

    return app


@pytest.mark.parametrize("args,out", [
    (["-topic=a", "--topic", "b", "-n=5"], "['a', 'b'] False 5"),
    (["-gzip", "-n", "2"], "[] True 2"),
    (["-gzip=true", "--n=3"], "[] True 3"),
    (["--gzip=false", "-topic", "c"], "['c'] False 0"),
    (["-gzip=0", "-gzip=1"], "[] True 0"),
])
def test_go_style_flags(args: list[str], out: str) -> None:
    r = CliRunner().invoke(_flag_app(), ["x", *args])
    assert r.exit_code == 0, r.output
    assert r.output.strip() == out


def test_progress_draws_only_when_enabled() -> None:
    quiet = io.StringIO()
    p = Progress("pub", stream=quiet).start()       # a StringIO is not a terminal
    p.add(5, 100)
    p.stop()
    assert quiet.getvalue() == ""
    loud = io.StringIO()
    p = Progress("pub", stream=loud, enabled=True, interval_s=0.01).start()
    p.add(3, 2048)
    time.sleep(0.05)
    p.stop()
    text = loud.getvalue()
    assert "pub: 3 messages, 2.0 KiB" in text and text.endswith("\n")
