"""Go's ``flag`` package rules, for command lines written for Go programs such as nsqd.

What it owns: turning argv into flag values exactly as Go's ``flag.FlagSet.Parse`` does,
so a script, unit file or test harness written for nsqd starts pybroker unchanged:

- ``-name`` and ``--name`` are the same flag; ``-name=value`` and ``-name value``;
- a boolean flag takes no separate value: ``-snappy`` is true, ``-snappy=false`` false,
  and ``-snappy false`` is true followed by the first non-flag argument ``false``;
- parsing stops at the first non-flag argument (``-`` alone is one) or after ``--``;
  what follows is returned, not parsed;
- a repeated flag: the last value wins, list flags collect every value;
- ``-h``, ``-help`` and ``--help`` ask for the usage (unless defined as flags);
- values as Go parses them: integers ``strconv.ParseInt(s, 0, 64)`` (``0x1f``, ``0o17``,
  ``017`` octal, ``1_000``), booleans ``strconv.ParseBool``, durations
  ``time.ParseDuration`` (``1h2m0.5s``, ``300ms``, ``1.5µs``, ``-1s``).

Errors carry Go's wording (``flag provided but not defined: -foo``, ``flag needs an
argument: -tcp-address``, ``invalid value "x" for flag -mem-queue-size: parse error``).
No CLI framework and nothing beyond ``re`` is imported: this runs before the broker's
listeners are bound, so it must be fast (linear in argv, which the OS bounds by ARG_MAX;
no backtracking pattern).
"""
from __future__ import annotations

import re
from typing import Callable, Union

# kinds: Go's flag types. "list" is a repeatable string flag (nsqd's app.StringArray),
# "floats" a repeatable comma-separated float list (app.FloatArray), "value" a flag.Value
# with its own parser (``parse``), "boolvalue" one that is also an IsBoolFlag.
BOOL, INT, DURATION, STRING, LIST, FLOATS, VALUE, BOOLVALUE = (
    "bool", "int", "duration", "string", "list", "floats", "value", "boolvalue")
_GO_TYPE = {BOOL: "", INT: "int", DURATION: "duration", STRING: "string", LIST: "value",
            FLOATS: "value", VALUE: "value", BOOLVALUE: ""}

_TRUE = frozenset(("1", "t", "T", "TRUE", "true", "True"))
_FALSE = frozenset(("0", "f", "F", "FALSE", "false", "False"))
_INT_MIN, _INT_MAX = -(2**63), 2**63 - 1
_INT_CHARS = re.compile(r"[0-9a-zA-Z_]+")  # ASCII only: Python's int() takes more
_DURATION_PART = re.compile(r"([0-9]*)(?:\.([0-9]*))?([a-zµμ]+)")
_UNITS = {"ns": 1, "us": 1_000, "µs": 1_000, "μs": 1_000, "ms": 1_000_000,
          "s": 1_000_000_000, "m": 60_000_000_000, "h": 3_600_000_000_000}
_FLOAT = re.compile(r"[+-]?(?:inf(?:inity)?|nan|(?:\d[\d_]*(?:\.[\d_]*)?|\.\d[\d_]*)"
                    r"(?:e[+-]?\d+)?|0x[\da-f_.]+(?:p[+-]?\d+)?)", re.I)


# a parsed flag's value (and a Flag's shown default): LIST and FLOATS flags collect
# their repeats in one list
FlagValue = Union[None, bool, int, float, str, list[str | float]]


class FlagError(Exception):
    """A command line Go's flag package refuses; str() is Go's message (exit status 2)."""


class HelpRequested(Exception):
    """-h, -help or --help (exit status 0 after the usage, as Go's ExitOnError)."""


class Flag:
    """One flag: its name, kind, the value shown as its default, usage text, and for
    VALUE/BOOLVALUE kinds the parser (raises ValueError with the message Go would)."""

    __slots__ = ("name", "kind", "default", "usage", "parse")

    def __init__(self, name: str, kind: str, default: object, usage: str,
                 parse: Callable[[str], FlagValue] | None = None) -> None:
        self.name = name
        self.kind = kind
        self.default = default
        self.usage = usage
        self.parse = parse

    @property
    def is_bool(self) -> bool:
        return self.kind in (BOOL, BOOLVALUE)


def parse_bool(s: str) -> bool:
    """Go's strconv.ParseBool."""
    if s in _TRUE:
        return True
    if s in _FALSE:
        return False
    raise ValueError("parse error")


def parse_int(s: str) -> int:
    """Go's strconv.ParseInt(s, 0, 64): sign, 0x/0o/0b prefixes, a leading 0 is octal,
    underscores only between digits (base-prefixed or not, as Go's literals)."""
    body = s[1:] if s[:1] in ("+", "-") else s
    if not _INT_CHARS.fullmatch(body) or body[0] == "_" or body[-1] == "_" or "__" in body:
        raise ValueError("parse error")
    if len(body) > 1 and body[0] == "0" and body[1] not in "xXoObB":
        body = "0o" + body[1:]  # Go: a leading zero means octal
    try:
        n = int(body, 0)
    except ValueError:
        raise ValueError("parse error") from None
    if s[:1] == "-":
        n = -n
    if not _INT_MIN <= n <= _INT_MAX:
        raise ValueError("value out of range")
    return n


def parse_duration(s: str) -> int:
    """Go's time.ParseDuration, in nanoseconds (negative allowed, as in Go)."""
    orig, neg = s, False
    if s[:1] in ("+", "-"):
        neg, s = s[0] == "-", s[1:]
    if s == "0":
        return 0
    if not s:
        raise ValueError(f"time: invalid duration {_quote(orig)}")
    total, pos = 0, 0
    while pos < len(s):
        m = _DURATION_PART.match(s, pos)
        if m is None or (not m.group(1) and not m.group(2)):
            raise ValueError(f"time: invalid duration {_quote(orig)}")
        unit = _UNITS.get(m.group(3))
        if unit is None:
            raise ValueError(f"time: unknown unit {_quote(m.group(3))} in duration "
                             f"{_quote(orig)}")
        whole, frac = m.group(1), m.group(2) or ""
        total += int(whole or 0) * unit + (int(frac) * unit // 10 ** len(frac) if frac else 0)
        if total > _INT_MAX + (1 if neg else 0):
            raise ValueError(f"time: invalid duration {_quote(orig)}")
        pos = m.end()
    return -total if neg else total


def parse_float(s: str) -> float:
    """Go's strconv.ParseFloat(s, 64) for the forms people write."""
    if not _FLOAT.fullmatch(s):
        raise ValueError("parse error")
    try:
        if s.lower().lstrip("+-").startswith("0x"):
            return float.fromhex(s.replace("_", ""))
        return float(s.replace("_", ""))
    except ValueError:
        raise ValueError("parse error") from None


def _quote(s: str) -> str:
    """Go's %q for the plain strings of a command line."""
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _set(flag: Flag, raw: str, actual: dict[str, FlagValue]) -> None:
    kind = flag.kind
    if kind == BOOL:
        value: FlagValue = parse_bool(raw)
    elif kind == INT:
        value = parse_int(raw)
    elif kind == DURATION:
        try:
            value = parse_duration(raw)
        except ValueError:
            raise ValueError("parse error") from None
    elif kind == STRING:
        value = raw
    elif kind == LIST:
        got = actual.setdefault(flag.name, [])
        if isinstance(got, list):
            got.append(raw)  # in place: linear in repeats
        return
    elif kind == FLOATS:
        try:
            floats = [parse_float(p) for p in raw.split(",")]
        except ValueError:
            raise ValueError(f"could not parse {_quote(raw)} as floats") from None
        got = actual.setdefault(flag.name, [])
        if isinstance(got, list):
            got.extend(floats)  # sorted once parsing is done
        return
    else:
        assert flag.parse is not None
        value = flag.parse(raw)
    actual[flag.name] = value


def parse(flags: dict[str, Flag], argv: list[str]) -> tuple[dict[str, FlagValue], list[str]]:
    """Parse argv as Go's FlagSet.Parse; returns (flags set -> parsed value, the
    arguments after the flags). Raises FlagError or HelpRequested."""
    actual: dict[str, FlagValue] = {}
    args = list(argv)
    i = 0
    while i < len(args):
        s = args[i]
        if len(s) < 2 or s[0] != "-":
            break
        dashes = 2 if s[1] == "-" else 1
        i += 1
        if s == "--":
            break
        name = s[dashes:]
        if not name or name[0] in "-=":
            raise FlagError(f"bad flag syntax: {s}")
        name, eq, value = name.partition("=")
        flag = flags.get(name)
        if flag is None:
            if name in ("help", "h"):
                raise HelpRequested()
            raise FlagError(f"flag provided but not defined: -{name}")
        try:
            if flag.is_bool:
                if eq:
                    try:
                        _set(flag, value, actual)
                    except ValueError as e:
                        raise FlagError(f"invalid boolean value {_quote(value)} for -{name}: "
                                        f"{e}") from None
                else:
                    _set(flag, "true", actual)
                continue
            if not eq:
                if i == len(args):
                    raise FlagError(f"flag needs an argument: -{name}")
                value = args[i]
                i += 1
            _set(flag, value, actual)
        except ValueError as e:
            raise FlagError(f"invalid value {_quote(value)} for flag -{name}: {e}") from None
    for name, got in actual.items():
        if flags[name].kind == FLOATS and isinstance(got, list):
            got.sort(key=float, reverse=True)  # matches nsqd's FloatArray: largest first
    return actual, args[i:]


def usage(prog: str, flags: dict[str, Flag]) -> str:
    """Go's usage text (``Usage of nsqd:`` and PrintDefaults' layout), flags by name."""
    lines = [f"Usage of {prog}:"]
    for name in sorted(flags):
        f = flags[name]
        head = f"  -{name}"
        kind = _GO_TYPE[f.kind]
        if kind:
            head += " " + kind
        text = f.usage.replace("\n", "\n    \t")
        if f.default not in (None, "", False, 0, []):
            shown = _quote(str(f.default)) if f.kind == STRING else f.default
            text += f" (default {str(shown).lower() if isinstance(shown, bool) else shown})"
        lines.append(head + ("\t" if len(name) == 1 and not kind else "\n    \t") + text)
    return "\n".join(lines) + "\n"
