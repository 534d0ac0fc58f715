"""The broker's log lines, in nsqd's format: ``<prefix>2006/01/02 15:04:05.000000 INFO: ...``.

Owns the ``pybroker`` logger's handler. Shared by ``pybroker serve`` (prefix
``[pybroker] ``) and ``pybroker-nsqd`` (nsqd's ``[nsqd] ``, or ``--log-prefix``); imports
only ``logging``, so either command sets it up before the heavy imports.
"""
from __future__ import annotations

import logging
import sys
import time

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warn": logging.WARNING,
          "warning": logging.WARNING, "error": logging.ERROR, "fatal": logging.CRITICAL}


class NsqFormatter(logging.Formatter):
    """nsqd's log line: ``[pybroker] 2006/01/02 15:04:05.000000 INFO: message``."""

    def __init__(self, prefix: str = "[pybroker] ") -> None:
        super().__init__()
        self.prefix = prefix

    def format(self, record: logging.LogRecord) -> str:
        t = time.localtime(record.created)
        stamp = time.strftime("%Y/%m/%d %H:%M:%S", t) + f".{int((record.created % 1) * 1e6):06d}"
        level = {"WARNING": "WARN", "CRITICAL": "FATAL"}.get(record.levelname, record.levelname)
        text = f"{self.prefix}{stamp} {level}: {record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


def setup_logging(level: str, prefix: str = "[pybroker] ") -> logging.Logger:
    """The ``pybroker`` logger, writing nsqd's lines to stderr at ``level``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(NsqFormatter(prefix))
    root = logging.getLogger("pybroker")
    root.handlers[:] = [handler]
    root.setLevel(LEVELS.get(level.lower(), logging.INFO))
    root.propagate = False
    return root
