"""Go's flag rules (pybroker.goflags) and serve's Go spellings (pybroker.launch).

The expected values are what Go 1.19's flag, strconv and time packages give (the
integration tests compare the whole command line with a real nsqd where one is on PATH).
Hostile input: huge argument lists and values parse in linear time and fail cleanly.
"""
from __future__ import annotations

import time
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pybroker.goflags import (BOOL, BOOLVALUE, DURATION, FLOATS, INT, LIST, STRING, Flag,
                              FlagError, HelpRequested, parse, parse_bool, parse_duration,
                              parse_float, parse_int, usage)
from pybroker.launch import go_style_args, plain_serve_args
from pybroker.nsqd_cli import NSQD_FLAGS, flag_table, flag_values

S = 1_000_000_000


@pytest.mark.parametrize("text,value", [
    ("0", 0), ("00", 0), ("42", 42), ("+42", 42), ("-42", -42), ("0x1f", 31), ("0X1F", 31),
    ("017", 15), ("0o17", 15), ("0O17", 15), ("0b101", 5), ("1_000", 1000), ("0x_1f", 31),
    ("0_17", 15), ("9223372036854775807", 2**63 - 1), ("-9223372036854775808", -(2**63)),
])
def test_parse_int_as_go(text: str, value: int) -> None:
    assert parse_int(text) == value


@pytest.mark.parametrize("text,why", [
    ("", "parse error"), ("08", "parse error"), ("1__0", "parse error"),
    ("_1", "parse error"), ("1_", "parse error"), (" 5", "parse error"),
    ("5 ", "parse error"), ("\u0663", "parse error"), ("0x", "parse error"),
    ("1.5", "parse error"), ("1e3", "parse error"), ("--1", "parse error"),
    ("9223372036854775808", "value out of range"), ("-0x8000000000000001", "value out of range"),
    ("9" * 5000, "parse error"),
])
def test_parse_int_refuses(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_int(text)


@pytest.mark.parametrize("text,ns", [
    ("0", 0), ("-0", 0), ("+0", 0), ("1h2m3.5s", 3723 * S + S // 2), ("300ms", 300_000_000),
    ("1.5\u00b5s", 1500), ("1.5\u03bcs", 1500), ("2us", 2000), ("7ns", 7), ("-1s", -S),
    ("+1s", S), (".5s", S // 2), ("5.s", 5 * S), ("1m30s", 90 * S), ("1.1s", 1_100_000_000),
    ("2562047h47m16.854775807s", 2**63 - 1), ("0.000000001s", 1), ("0.0000000009s", 0),
])
def test_parse_duration_as_go(text: str, ns: int) -> None:
    assert parse_duration(text) == ns


@pytest.mark.parametrize("text", ["", "1", "s", "1x", ".s", "1h junk", "1 s", "1S", "-",
                                  "2562047h47m16.854775808s", "1" * 5000 + "s", "--1s"])
def test_parse_duration_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)


def test_parse_bool_and_float() -> None:
    for t in ("1", "t", "T", "TRUE", "true", "True"):
        assert parse_bool(t) is True
    for f in ("0", "f", "F", "FALSE", "false", "False"):
        assert parse_bool(f) is False
    for bad in ("yes", "tRUE", "", " true", "2"):
        with pytest.raises(ValueError):
            parse_bool(bad)
    assert parse_float("0.99") == 0.99 and parse_float(".5") == 0.5
    assert parse_float("1e-1") == 0.1 and parse_float("0x1p-2") == 0.25
    for bad in ("", "x", "1,5", "0.5 "):
        with pytest.raises(ValueError):
            parse_float(bad)


TABLE = {f.name: f for f in [
    Flag("snappy", BOOL, True, "b"), Flag("n", INT, 0, "i"), Flag("t", DURATION, 0, "d"),
    Flag("addr", STRING, "", "s"), Flag("lookupd", LIST, None, "l"),
    Flag("pct", FLOATS, None, "f"),
    Flag("tls", BOOLVALUE, None, "v", lambda s: s.lower()),
]}


@pytest.mark.parametrize("argv,want,rest", [
    (["-n=5"], {"n": 5}, []), (["--n=5"], {"n": 5}, []), (["-n", "5"], {"n": 5}, []),
    (["--n", "5"], {"n": 5}, []), (["-n", "5", "-n", "6"], {"n": 6}, []),
    (["-snappy"], {"snappy": True}, []), (["--snappy=false"], {"snappy": False}, []),
    (["-snappy", "false"], {"snappy": True}, ["false"]),
    (["-snappy=0", "-n=1"], {"snappy": False, "n": 1}, []),
    (["-addr", "-n"], {"addr": "-n"}, []),                 # a value may start with "-"
    (["-addr="], {"addr": ""}, []), (["-addr=a=b"], {"addr": "a=b"}, []),
    (["-lookupd", "a", "--lookupd=b"], {"lookupd": ["a", "b"]}, []),
    (["-pct=0.5,0.99", "-pct", "0.75"], {"pct": [0.99, 0.75, 0.5]}, []),
    (["-tls"], {"tls": "true"}, []), (["-tls=TCP-HTTPS"], {"tls": "tcp-https"}, []),
    (["-t=1m"], {"t": 60 * S}, []),
    (["--", "-n=5"], {}, ["-n=5"]), (["-", "-n=5"], {}, ["-", "-n=5"]),
    (["x", "-n=5"], {}, ["x", "-n=5"]), ([], {}, []),
])
def test_parse_as_gos_flagset(argv: list[str], want: dict[str, Any], rest: list[str]) -> None:
    assert parse(TABLE, argv) == (want, rest)


@pytest.mark.parametrize("argv,message", [
    (["-nope"], "flag provided but not defined: -nope"),
    (["--nope=1"], "flag provided but not defined: -nope"),
    (["-n"], "flag needs an argument: -n"),
    (["-n=x"], 'invalid value "x" for flag -n: parse error'),
    (["-t", "10"], 'invalid value "10" for flag -t: parse error'),
    (["-snappy=yes"], 'invalid boolean value "yes" for -snappy: parse error'),
    (["-snappy="], 'invalid boolean value "" for -snappy: parse error'),
    (["---n=1"], "bad flag syntax: ---n=1"), (["-=1"], "bad flag syntax: -=1"),
    (["-pct=0.5,x"], 'invalid value "0.5,x" for flag -pct: could not parse "0.5,x" as floats'),
])
def test_parse_refuses_with_gos_words(argv: list[str], message: str) -> None:
    with pytest.raises(FlagError) as e:
        parse(TABLE, argv)
    assert str(e.value) == message


def test_help_flags() -> None:
    for argv in (["-h"], ["-help"], ["--help"], ["-n=1", "-help=x"]):
        with pytest.raises(HelpRequested):
            parse(TABLE, argv)
    text = usage("nsqd", TABLE)
    assert text.startswith("Usage of nsqd:\n  -addr string\n    \ts\n")
    assert "  -snappy\n    \tb (default true)\n" in text
    assert "  -n int\n    \ti\n" in text


def test_hostile_command_lines_parse_in_linear_time() -> None:
    t0 = time.perf_counter()
    actual, rest = parse(TABLE, ["-lookupd=x"] * 100_000)
    assert len(actual["lookupd"]) == 100_000 and rest == []
    assert len(parse(TABLE, ["-pct=0.5,0.25"] * 100_000)[0]["pct"]) == 200_000
    assert parse(TABLE, ["-addr=" + "a" * 2_000_000])[0]["addr"] == "a" * 2_000_000
    with pytest.raises(FlagError):
        parse(TABLE, ["-t=" + "1" * 1_000_000 + "s"])
    with pytest.raises(FlagError):
        parse(TABLE, ["-n=" + "1" * 1_000_000])
    assert time.perf_counter() - t0 < 10


def test_the_dropin_table_has_every_nsqd_flag_and_option() -> None:
    from pybroker.config import SPECS

    table, keys = flag_table()
    assert set(NSQD_FLAGS) <= set(table)
    assert set(keys.values()) == {s.key for s in SPECS}
    assert table["verbose"].kind == BOOL and table["worker-id"].kind == BOOL
    assert table["tls-required"].kind == BOOLVALUE
    assert table["e2e-processing-latency-percentile"].kind == FLOATS
    assert table["tcp-address"].default == "0.0.0.0:4150"
    actual, _ = parse(table, ["-msg-timeout=1m30s", "-node-id=0x1f", "-verbose",
                              "-tls-min-version="])
    assert flag_values(actual, keys) == {"msg_timeout": f"{90 * S}ns", "id": "31"}


@pytest.mark.parametrize("argv,want", [
    (["-tcp-address=a:1"], ["--tcp-address=a:1"]),
    (["-tcp-address", "a:1"], ["--tcp-address", "a:1"]),
    (["--snappy"], ["--snappy=true"]), (["-snappy"], ["--snappy=true"]),
    (["--snappy", "false"], ["--snappy", "false"]),            # serve's own spelling
    (["--snappy", "--deflate"], ["--snappy=true", "--deflate=true"]),
    (["-tls-required", "tcp-https"], ["--tls-required", "tcp-https"]),
    (["--verbose", "-worker-id=true", "-c", "f.toml"], ["-c", "f.toml"]),
    (["--statsd-prefix", "-snappy"], ["--statsd-prefix", "-snappy"]),  # a value stays
    (["-config=f"], ["--config=f"]), (["-version"], ["--version"]),
    (["-x"], ["-x"]), (["-cfoo"], ["-cfoo"]), (["--", "-snappy"], ["--", "-snappy"]),
])
def test_serve_reads_gos_spellings(argv: list[str], want: list[str]) -> None:
    assert go_style_args(argv) == want


def test_serve_starts_without_typer_only_for_plain_options() -> None:
    assert plain_serve_args(["--tcp-address=a:1", "--lookupd-tcp-address", "x:1",
                             "--lookupd-tcp-address=y:2", "-c", "f.toml", "--http-address="]) \
        == ("f.toml", {"tcp_address": "a:1", "nsqlookupd_tcp_addresses": ["x:1", "y:2"],
                       "http_address": ""})
    for argv in (["--help"], ["--version"], ["--nope=1"], ["--tcp-address"], ["x"],
                 ["--tcp-address", "-x"], ["-cf.toml"], ["--", "--snappy=true"]):
        assert plain_serve_args(argv) is None, argv


# -- property: any command line written in Go's spellings parses back to its values -------
_INTS = st.integers(-(2**63), 2**63 - 1)
_WORDS = st.text(st.characters(min_codepoint=33, max_codepoint=0x2FFF), max_size=12)


def _int_text(n: int, style: int) -> str:
    sign, v = ("-" if n < 0 else ""), abs(n)
    return sign + (str(v), hex(v), oct(v), "0" + oct(v)[2:], bin(v))[style]


@given(st.lists(st.tuples(st.sampled_from(["n", "addr", "lookupd", "snappy"]),
                          st.integers(0, 3), _INTS, _WORDS, st.booleans(), st.integers(0, 4)),
                max_size=12))
def test_go_spellings_round_trip(items: list[tuple[str, int, int, str, bool, int]]) -> None:
    argv: list[str] = []
    want: dict[str, Any] = {}
    for name, form, n, word, flag, style in items:
        dash = "--" if form % 2 else "-"
        if name == "snappy":
            argv.append(f"{dash}snappy" if flag else f"{dash}snappy={'tfTF01'[style]}")
            want["snappy"] = True if flag else "tfTF01"[style] in "tT1"
            continue
        text = _int_text(n, style) if name == "n" else word
        argv += [f"{dash}{name}={text}"] if form < 2 else [f"{dash}{name}", text]
        if name == "lookupd":
            want.setdefault("lookupd", []).append(text)
        else:
            want[name] = n if name == "n" else text
    assert parse(TABLE, argv) == (want, [])
