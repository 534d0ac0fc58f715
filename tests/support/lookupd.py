"""A small fake nsqlookupd HTTP server (http.server in a thread) for discovery tests.

It answers what clients and tools read from nsqlookupd 1.3: ``/ping``, ``/lookup?topic=``
(``{"channels": [...], "producers": [...]}``, or 404 ``TOPIC_NOT_FOUND``), ``/topics``
and ``/nodes``. Tests register producers by hand and can count ``/lookup`` queries.
"""
from __future__ import annotations

import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.support.broker import BrokerProcess


class FakeLookupd:
    """A fake nsqlookupd on 127.0.0.1:<ephemeral>; use as a context manager."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._producers: dict[str, list[dict[str, Any]]] = {}
        self._channels: dict[str, list[str]] = {}
        self.lookups: list[str] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="fake-lookupd", daemon=True)

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> "FakeLookupd":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def __enter__(self) -> "FakeLookupd":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def http_hostport(self) -> str:
        return f"127.0.0.1:{self._server.server_port}"

    # -- registry --------------------------------------------------------------------
    def add_producer(self, topic: str, broker: BrokerProcess) -> None:
        """List ``broker`` as a producer of ``topic`` (as nsqd's REGISTER would)."""
        assert broker.tcp_address is not None
        http_port = broker.http_address[1] if broker.http_address else 0
        entry = {"remote_address": f"127.0.0.1:{broker.tcp_address[1]}",
                 "hostname": "localhost", "broadcast_address": broker.tcp_address[0],
                 "tcp_port": broker.tcp_address[1], "http_port": http_port,
                 "version": "1.3.0"}
        with self._lock:
            self._producers.setdefault(topic, []).append(entry)

    def remove_producers(self, topic: str) -> None:
        with self._lock:
            self._producers.pop(topic, None)

    def lookup_count(self, topic: str) -> int:
        with self._lock:
            return sum(1 for t in self.lookups if t == topic)

    # -- HTTP ------------------------------------------------------------------------
    def _answer(self, path: str, query: dict[str, list[str]]) -> tuple[int, Any]:
        with self._lock:
            if path == "/ping":
                return 200, "OK"
            if path == "/lookup":
                topic = (query.get("topic") or [""])[0]
                if not topic:
                    return 400, {"message": "MISSING_ARG_TOPIC"}
                self.lookups.append(topic)
                if topic not in self._producers:
                    return 404, {"message": "TOPIC_NOT_FOUND"}
                return 200, {"channels": list(self._channels.get(topic, [])),
                             "producers": list(self._producers[topic])}
            if path == "/topics":
                return 200, {"topics": sorted(self._producers)}
            if path == "/nodes":
                seen: dict[tuple[str, int], dict[str, Any]] = {}
                for topic, entries in self._producers.items():
                    for e in entries:
                        node = seen.setdefault((e["broadcast_address"], e["tcp_port"]),
                                               dict(e, topics=[], tombstones=[]))
                        node["topics"].append(topic)
                        node["tombstones"].append(False)
                return 200, {"producers": list(seen.values())}
        return 404, {"message": "NOT_FOUND"}

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                parts = urllib.parse.urlsplit(self.path)
                status, payload = fake._answer(parts.path, urllib.parse.parse_qs(parts.query))
                body = (payload if isinstance(payload, str) else json.dumps(payload)).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json; charset=utf-8")
                self.send_header("X-NSQ-Content-Type", "nsq; version=1.0")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        return Handler
