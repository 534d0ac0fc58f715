"""GET and PUT /config/:opt: an option by nsqd's config name, in nsqd's JSON types.

Like nsqd: GET answers any option (durations in nanoseconds, ``log_level`` as nsqd's
number, strings as plain text); PUT changes ``nsqlookupd_tcp_addresses`` (a JSON list)
and ``log_level`` only, and answers the new value. Runs on the HTTP thread.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from pybroker.config import SPEC_BY_KEY
from pybroker.http.request import Request
from pybroker.http.response import Response, error, ok_json, ok_text

if TYPE_CHECKING:
    from pybroker.http.views import ServerView
    from pybroker.optiontypes import OptionValue
    from pybroker.server.services import HttpHost


LOG_LEVELS = {"debug": 1, "info": 2, "warn": 3, "warning": 3, "error": 4, "fatal": 5}
_PY_LEVELS = {1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR,
              5: logging.CRITICAL}
_LEVEL_NAMES = {1: "debug", 2: "info", 3: "warn", 4: "error", 5: "fatal"}
# nsqd keeps tls_min_version as Go's uint16 constant (tls1.0 by default)
_TLS_VERSIONS = {"": 0x0301, "ssl3.0": 0x0300, "tls1.0": 0x0301, "tls1.1": 0x0302,
                 "tls1.2": 0x0303, "tls1.3": 0x0304}


class ConfigEndpoint:
    """Owned by the Api; ``handle`` serves both methods of /config/:opt."""

    def __init__(self, runtime: HttpHost, server: ServerView) -> None:
        self.opts = runtime.options
        self.broker = runtime.broker
        self.server = server
        self.setters: dict[str, Callable[[bytes], bool]] = {
            "nsqlookupd_tcp_addresses": self._set_lookupd, "log_level": self._set_log_level}
        # nsqd keeps a PUT of JSON null as a nil list, which it answers as null (the
        # broker itself keeps an empty list)
        self._lookupd_null = False

    def value(self, key: str) -> tuple[bool, OptionValue | None]:
        """(known, value) of an option by nsqd's config name, in nsqd's JSON types."""
        if key not in SPEC_BY_KEY:
            return False, None
        value = getattr(self.opts, key)
        if key == "log_level":
            return True, LOG_LEVELS.get(str(value).lower(), 2)
        if key == "nsqlookupd_tcp_addresses" and self._lookupd_null:
            return True, None
        if key == "tls_min_version":
            return True, _TLS_VERSIONS.get(str(value).lower(), 0x0301)
        if key == "statsd_prefix":
            return True, self.server.statsd_prefix()
        if key in ("broadcast_tcp_port", "broadcast_http_port") and not value:
            # matches nsqd: an unset broadcast port reads as the port listened on
            return True, self.server.tcp_port if key == "broadcast_tcp_port" else self.server.port
        return True, value

    def handle(self, req: Request) -> Response:
        key = req.param
        if req.method == b"PUT":
            body = req.body_bytes()
            # matches nsqd: the body is checked before the option's name
            if not body or len(body) > self.opts.max_msg_size:
                return error(413, "INVALID_VALUE")
            setter = self.setters.get(key)
            if setter is None:
                return error(400, "INVALID_OPTION")
            if not setter(body):
                return error(400, "INVALID_VALUE")
            if key == "nsqlookupd_tcp_addresses":
                self.broker.notify_changed()  # wakes the lookupd registrar to reconnect
        known, value = self.value(key)
        if not known:
            return error(400, "INVALID_OPTION")
        if isinstance(value, str):
            return ok_text(value.encode())  # nsqd's V1: a string is sent as it is
        return ok_json(value)

    def _set_lookupd(self, body: bytes) -> bool:
        try:
            value = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            return False
        if value is not None and (not isinstance(value, list)
                                  or not all(isinstance(v, str) for v in value)):
            return False
        self.opts.nsqlookupd_tcp_addresses = list(value or [])
        self._lookupd_null = value is None
        return True

    def _set_log_level(self, body: bytes) -> bool:
        level = LOG_LEVELS.get(body.decode("utf-8", "replace").lower())
        if level is None:
            return False
        self.opts.log_level = _LEVEL_NAMES[level]
        logging.getLogger("pybroker").setLevel(_PY_LEVELS[level])
        return True
