"""The command line (typer): flags -> Options -> server.runtime.run(); nothing else.

``pybroker serve`` takes every nsqd option as a flag with nsqd's name (``--mem-queue-size``)
and a TOML file with nsqd's config names (``-c conf/prod.toml``); flags override the file.
A bad configuration stops start-up with one line naming the key, and exit status 2.
"""
from __future__ import annotations

import inspect
import logging
import sys
import time
from typing import Any, List, Optional

import typer

from pybroker import NSQ_COMPAT_VERSION, __version__
from pybroker.config import SPECS, format_duration, load_toml, resolve
from pybroker.errors import ConfigError

# click's plain help layout: every flag name whole and help wrapped beside it at any width
# (rich's table cuts long flag names with an ellipsis at 80 columns)
app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="pybroker: a message broker that speaks NSQ's protocols.")

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warn": logging.WARNING,
           "warning": logging.WARNING, "error": logging.ERROR, "fatal": logging.CRITICAL}


class _NsqFormatter(logging.Formatter):
    """nsqd's log line: ``[pybroker] 2006/01/02 15:04:05.000000 INFO: message``."""

    def format(self, record: logging.LogRecord) -> str:
        t = time.localtime(record.created)
        stamp = time.strftime("%Y/%m/%d %H:%M:%S", t) + f".{int((record.created % 1) * 1e6):06d}"
        level = {"WARNING": "WARN", "CRITICAL": "FATAL"}.get(record.levelname, record.levelname)
        text = f"[pybroker] {stamp} {level}: {record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_NsqFormatter())
    root = logging.getLogger("pybroker")
    root.handlers[:] = [handler]
    root.setLevel(_LEVELS.get(level.lower(), logging.INFO))
    root.propagate = False


def _serve(config: Optional[str], version: bool, **flags: Any) -> None:
    if version:
        typer.echo(f"pybroker v{__version__} (nsqd protocol v{NSQ_COMPAT_VERSION})")
        raise typer.Exit(0)
    try:
        file_values = load_toml(config) if config else {}
        options = resolve(file_values, flags)
        if options.log_level.lower() not in _LEVELS:
            raise ConfigError(f"log_level: unknown level {options.log_level!r}")
    except ConfigError as e:
        typer.echo(f"pybroker: bad configuration: {e}", err=True)
        raise typer.Exit(2) from None
    setup_logging(options.log_level)
    from pybroker.server.runtime import run

    raise typer.Exit(run(options))


_METAVARS = {"int": "INT", "float": "FLOAT", "bool": "true|false", "duration": "DURATION",
             "list": "TEXT", "str": "TEXT"}
_PATH_KEYS = {"data_path", "tls_cert", "tls_key", "tls_root_ca_file"}

SERVE_EPILOG = (
    "DURATION values are Go-style: 250ms, 60s, 15m, 1h30m (units ns, us, ms, s, m, h). "
    "In a TOML file a bare number is milliseconds, as in nsqd (msg_timeout = 60000 "
    "is 60s); on the command line the unit is required. Flags given more than once "
    "(--lookupd-tcp-address) add to the list.")


def metavar(key: str, kind: str) -> str:
    """The placeholder --help shows for an option's value (its type, not "<str>")."""
    if key.endswith("_address") or key.endswith("_addresses"):
        return "HOST:PORT"
    if key in _PATH_KEYS:
        return "PATH"
    return _METAVARS.get(kind, "TEXT")


def _build_serve() -> Any:
    """A typer command whose flags are generated from config.SPECS (one per option)."""
    params = [
        inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[str],
                          default=typer.Option(None, "--config", "-c", metavar="PATH",
                                               help="TOML config file (nsqd config names)")),
        inspect.Parameter("version", inspect.Parameter.KEYWORD_ONLY, annotation=bool,
                          default=typer.Option(False, "--version", help="print the version")),
    ]
    for spec in SPECS:
        annotation: Any = Optional[List[str]] if spec.kind == "list" else Optional[str]
        default = spec.default
        if default in (None, "", []):
            shown = ""
        elif spec.kind == "duration":
            shown = f" (default: {format_duration(default)})"
        else:
            shown = f" (default: {str(default).lower() if isinstance(default, bool) else default})"
        params.append(inspect.Parameter(
            spec.key, inspect.Parameter.KEYWORD_ONLY, annotation=annotation,
            default=typer.Option(None, spec.flag_name, help=spec.help + shown,
                                 metavar=metavar(spec.key, spec.kind), show_default=False)))

    def serve(**kw: Any) -> None:
        """Run the broker (nsqd's TCP protocol V2) until SIGTERM or SIGINT."""
        config = kw.pop("config")
        version = kw.pop("version")
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


def _register_subcommands() -> None:
    """The tools (tail, to-file, pub, stat), bench and spark: each package adds its own
    commands; spark imports pyspark only when its command runs."""
    from pybroker.bench.cli import register as register_bench
    from pybroker.spark.cli import register as register_spark
    from pybroker.tools import register as register_tools

    for register in (register_tools, register_bench, register_spark):
        register(app)


_register_subcommands()


def main() -> None:
    app()
