"""The command line (typer): flags -> Options -> runtime.run(); nothing else.

``pybroker serve`` takes every nsqd option as a flag with nsqd's name (``--mem-queue-size``)
and a TOML file with nsqd's config names (``-c conf/prod.toml``); flags override the file.
Go's flag spellings are accepted too where they do not clash with serve's own
(``-tcp-address=...``, a bare ``--snappy``, nsqd's no-op ``--verbose``; see
launch.go_style_args). A bad configuration stops start-up with one line naming the key,
and exit status 2. The entry point is launch.py: a ``serve`` command line of plain options
starts the broker there without importing this module (typer); everything else comes
here. ``serve`` imports neither the other commands nor their packages (tools, bench,
spark); ``pybroker-nsqd`` (nsqd_cli.py) is the same broker under nsqd's command line.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import List, Optional

import typer

from pybroker import NSQ_COMPAT_VERSION, __version__
from pybroker.config import SPECS, format_duration
from pybroker.optiontypes import OptionValue
from pybroker.logfmt import setup_logging

__all__ = ["app", "full_app", "run_typer", "setup_logging"]

# click's plain help layout: every flag name whole and help wrapped beside it at any width
# (rich's table cuts long flag names with an ellipsis at 80 columns)
app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="pybroker: a message broker that speaks NSQ's protocols.")


# a flag's value as click hands it over (lists: the repeats of a repeatable flag)
FlagArg = str | list[str] | None


def _serve(config: Optional[str], version: bool, **flags: FlagArg) -> None:
    if version:
        typer.echo(f"pybroker v{__version__} (nsqd protocol v{NSQ_COMPAT_VERSION})")
        raise typer.Exit(0)
    from pybroker.start import serve

    raise typer.Exit(serve(config, flags))


_METAVARS = {"int": "INT", "float": "FLOAT", "bool": "true|false", "duration": "DURATION",
             "list": "TEXT", "str": "TEXT", "tls_required": "true|false|tcp-https"}
_PATH_KEYS = {"data_path", "tls_cert", "tls_key", "tls_root_ca_file"}

SERVE_EPILOG = (
    "DURATION values are Go-style: 250ms, 60s, 15m, 1h30m (units ns, us, ms, s, m, h). "
    "In a TOML file a bare number is milliseconds, as in nsqd (msg_timeout = 60000 "
    "is 60s); on the command line the unit is required. Flags given more than once "
    "(--lookupd-tcp-address) add to the list. Go's spellings work too: -tcp-address=ADDR, "
    "a bare --snappy or -deflate (true), and nsqd's no-op --verbose and --worker-id; "
    "pybroker-nsqd takes nsqd's whole command line.")


def metavar(key: str, kind: str) -> str:
    """The placeholder --help shows for an option's value (its type, not "<str>")."""
    if key.endswith("_address") or key.endswith("_addresses"):
        return "HOST:PORT"
    if key in _PATH_KEYS:
        return "PATH"
    return _METAVARS.get(kind, "TEXT")


def _help_and_default(text: str, kind: str, default: OptionValue | None) -> tuple[str, str]:
    """An option's help and its default as click shows every other command's
    (``  [default: X]``), in the words a user types (``false``, ``1m``), never Python's."""
    if text.endswith(")") and "(default: " in text:     # a default said in words
        text, _, said = text.rpartition(" (default: ")
        return text, f"  [default: {said[:-1]}]"
    if default in (None, "", []):
        return text, ""
    if kind == "duration" and isinstance(default, int):
        return text, f"  [default: {format_duration(default)}]"
    if kind == "tls_required":
        return text, "  [default: false]" if not default else f"  [default: {default}]"
    shown = str(default).lower() if isinstance(default, bool) else str(default)
    if shown != shown.strip():
        shown = f'"{shown}"'      # a prefix's trailing space, visible
    return text, f"  [default: {shown}]"


def _build_serve() -> Callable[..., None]:
    """A typer command whose flags are generated from config.SPECS (one per option)."""
    params = [
        inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[str],
                          default=typer.Option(None, "--config", "-c", metavar="PATH",
                                               help="TOML config file (nsqd config names)")),
        inspect.Parameter("version", inspect.Parameter.KEYWORD_ONLY, annotation=bool,
                          default=typer.Option(False, "--version", help="print the version")),
    ]
    for spec in SPECS:
        annotation: object = Optional[List[str]] if spec.kind == "list" else Optional[str]
        help_text, shown = _help_and_default(spec.help, spec.kind, spec.default)
        params.append(inspect.Parameter(
            spec.key, inspect.Parameter.KEYWORD_ONLY, annotation=annotation,
            default=typer.Option(None, spec.flag_name, help=help_text + shown,
                                 metavar=metavar(spec.key, spec.kind), show_default=False)))

    def serve(config: Optional[str] = None, version: bool = False, **kw: FlagArg) -> None:
        """Run the broker (nsqd's TCP protocol V2) until SIGTERM or SIGINT."""
        flags = {k: (v or None) if isinstance(v, list) else v for k, v in kw.items()}
        _serve(config, version, **flags)

    serve.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    return serve


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"pybroker v{__version__} (nsqd protocol v{NSQ_COMPAT_VERSION})")
        raise typer.Exit(0)


@app.callback()
def _group(version: bool = typer.Option(False, "--version", is_eager=True,
                                        callback=_print_version,
                                        help="Print the version and exit.")) -> None:
    """pybroker: a message broker that speaks NSQ's protocols."""


app.command("serve", help="Run the broker until SIGTERM or SIGINT.",
            epilog=SERVE_EPILOG)(_build_serve())


_registered = False


def full_app() -> typer.Typer:
    """The command line with every command (serve alone needs none of the others)."""
    _register_subcommands()
    return app


def _register_subcommands() -> None:
    """The tools (tail, to-file, pub, stat), bench and spark: each package adds its own
    commands; spark imports pyspark only when its command runs."""
    global _registered
    if _registered:
        return
    _registered = True
    from pybroker.bench.cli import register as register_bench
    from pybroker.cluster.status import register as register_cluster
    from pybroker.spark.cli import register as register_spark
    from pybroker.tools import register as register_tools

    for register in (register_tools, register_bench, register_spark, register_cluster):
        register(app)


def run_typer(args: list[str]) -> None:
    """The whole command line (launch.py hands over what it does not start itself)."""
    if args[:1] != ["serve"]:
        _register_subcommands()
    app(args=args, prog_name="pybroker")
