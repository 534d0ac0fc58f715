"""Starting the broker from resolved command-line values: the options read (a TOML file
and flags, flags winning), every listener bound, then the runtime run.

What it owns: the one start-up sequence both command lines end in (launch.py's plain
route and cli.py's typer route), with its exit statuses. It sits above runtime
and below the command lines, which import it; it imports neither of them.
"""
from __future__ import annotations

import sys
from collections.abc import Mapping

__all__ = ["serve"]


def serve(config: str | None, flags: Mapping[str, object]) -> int:
    """Resolve the options, bind every listener, then import the server and run it;
    returns the exit status (2 for a bad configuration, with one line naming the key)."""
    from pybroker.config import LOG_LEVEL_NAMES, load_toml, resolve
    from pybroker.errors import ConfigError

    try:
        file_values = load_toml(config) if config else {}
        options = resolve(file_values, flags)
        if options.log_level.lower() not in LOG_LEVEL_NAMES:
            raise ConfigError(f"log_level: unknown level {options.log_level!r}")
    except ConfigError as e:
        print(f"pybroker: bad configuration: {e}", file=sys.stderr)
        return 2
    from pybroker.server.sockets import StartupError, bind_listeners

    try:
        bound = bind_listeners(options)  # every listener first: nothing slow before
    except StartupError as e:
        print(f"pybroker: {e}", file=sys.stderr)
        return 2
    from pybroker.logfmt import setup_logging

    setup_logging(options.log_level, options.log_prefix)
    from pybroker.runtime import run

    return run(options, bound)
