"""pybroker's command-line tools for NSQ users: tail, to-file, pub, stat (and
pybroker's own: rewind, dead-letters).

Each mirrors an NSQ tool (nsq_tail, nsq_to_file, to_nsq, nsq_stat) flag for flag and in
its output, so scripts written for those keep working. ``register(app)`` adds them as
sub-commands of the ``pybroker`` command line; ``python -m pybroker.tools`` runs them
standalone.
"""
from __future__ import annotations

import typer

from pybroker.tools._common import GoFlagsCommand


def register(app: typer.Typer) -> None:
    """Add ``tail``, ``to-file``, ``pub`` and ``stat`` to ``app``."""
    from pybroker.tools.dead_letters import app as dead_letters_app
    from pybroker.tools.pub import pub_command
    from pybroker.tools.rewind import rewind_command
    from pybroker.tools.stat import stat_command
    from pybroker.tools.tail import tail_command
    from pybroker.tools.to_file import to_file_command

    app.command("tail", cls=GoFlagsCommand)(tail_command)
    app.command("to-file", cls=GoFlagsCommand)(to_file_command)
    app.command("pub", cls=GoFlagsCommand)(pub_command)
    app.command("stat", cls=GoFlagsCommand)(stat_command)
    app.command("rewind", cls=GoFlagsCommand)(rewind_command)
    app.add_typer(dead_letters_app, name="dead-letters")


def make_app() -> typer.Typer:
    """A typer app holding only the tools."""
    app = typer.Typer(add_completion=False, no_args_is_help=True,
                      help="NSQ command-line tools on pybroker's client.")
    register(app)
    return app
