"""The ``pybroker`` entry point: ``pybroker serve`` starts without importing typer.

What it owns: the start of ``pybroker`` and ``python -m pybroker``. A ``serve`` command line
made of plain options (``--name=value``, ``--name value``, ``-c PATH``, ``--config PATH``,
and Go's spellings, see ``go_style_args``) is read here, straight from config.SPECS, and
the broker starts; anything else (``--help``, ``--version``, an unknown or malformed
option, another command) goes to the typer command line (cli.py), which reads it exactly
as before and owns help and error messages. Both routes end in pybroker.start's
``serve``, so the options mean the same either way. typer, click and the other commands'
packages cost tens of milliseconds to import; a broker started by a test harness or a
unit file needs none.
"""
from __future__ import annotations

import gc
import sys
from typing import TYPE_CHECKING

from pybroker.start import serve

if TYPE_CHECKING:
    from pybroker.config import OptionSpec

# Go's boolean flags (a bare -snappy is true), nsqd's deprecated no-ops, and the values a
# boolean option of serve takes after a space (serve's own "--snappy false")
_NO_OPS = frozenset(("verbose", "worker-id"))
_BOOL_WORDS = frozenset(("1", "0", "t", "f", "true", "false", "yes", "no", "y", "n", "on",
                         "off", "tcp-https"))


def _names() -> tuple[dict[str, OptionSpec], set[str]]:
    from pybroker.config import SPECS

    by_flag = {s.flag_name[2:]: s for s in SPECS}
    bools = {name for name, s in by_flag.items() if s.kind in ("bool", "tls_required")}
    return by_flag, bools


def go_style_args(args: list[str]) -> list[str]:
    """serve's arguments with Go's flag spellings turned into click's: ``-name[=v]`` ->
    ``--name[=v]`` for serve's long options, a bare boolean -> ``--name=true`` (unless
    a true/false word follows: serve's own ``--snappy false``), nsqd's no-op flags
    dropped. A value (the argument after an option that takes one) is never rewritten."""
    by_flag, bools = _names()
    long_names = set(by_flag) | {"config", "version", "help"}
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg == "--":
            out += args[i - 1:]
            break
        if arg.startswith("-") and not arg.startswith("--") and len(arg) > 2:
            name = arg[1:].partition("=")[0]
            if name in long_names or name in _NO_OPS:
                arg = "-" + arg
        if not arg.startswith("--"):
            out.append(arg)
            if arg == "-c" and i < len(args):
                out.append(args[i])
                i += 1
            continue
        name, eq, _ = arg[2:].partition("=")
        if name in _NO_OPS:
            continue  # matches nsqd 1.3: accepted, no effect
        if name in bools and not eq:
            if i < len(args) and args[i].lower() in _BOOL_WORDS:
                out += [arg, args[i]]
                i += 1
            else:
                out.append(arg + "=true")
            continue
        out.append(arg)
        if not eq and name in long_names and name not in ("version", "help") \
                and i < len(args):
            out.append(args[i])  # the option's value, whatever it looks like
            i += 1
    return out


def plain_serve_args(args: list[str]) -> tuple[str | None, dict[str, object]] | None:
    """(config path, {key: raw value}) for a command line of plain options only, as
    click would read it; None for anything else (typer reads it then)."""
    by_flag, _ = _names()
    config: str | None = None
    flags: dict[str, object] = {}
    lists: dict[str, list[str]] = {}     # the repeatable options
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg == "-c":
            name, eq, value = "config", "", ""
        elif arg.startswith("--"):
            name, eq, value = arg[2:].partition("=")
        else:
            return None
        if not eq:
            if i == len(args) or args[i].startswith("-"):
                return None  # a missing value, or one click may read otherwise
            value = args[i]
            i += 1
        if name == "config":
            config = value
            continue
        spec = by_flag.get(name)
        if spec is None:
            return None
        if spec.kind == "list":
            lists.setdefault(spec.key, []).append(value)
        else:
            flags[spec.key] = value
    flags.update(lists)
    return config, flags


def main() -> None:
    gc.disable()  # start-up allocates and frees little; runtime.run enables it again
    args = sys.argv[1:]
    if args[:1] == ["serve"]:
        args = ["serve", *go_style_args(args[1:])]
        plain = plain_serve_args(args[1:])
        if plain is not None:
            sys.exit(serve(*plain))
    gc.enable()
    from pybroker.cli import run_typer

    run_typer(args)
