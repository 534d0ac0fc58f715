"""nsqlookupd's HTTP API from the client side: ``/lookup`` polling and small queries.

``LookupdPoller`` is owned by a Consumer: a thread that asks ``/lookup?topic=`` every
``lookupd_poll_interval`` (after a random jitter, as go-nsq does), round-robin over the
configured lookupds, retrying the next one up to three times, and hands the producers'
``broadcast_address:tcp_port`` to the consumer. While a query leaves the consumer with
no connection (its nsqd went away and the topic's new home is not registered yet, or
the topic is not yet anywhere) it asks again soon: after FAST_RETRY_S, doubling up to
the poll interval, so a consumer is back within moments of a failover, not a minute.
The helpers below serve the tools.
"""
from __future__ import annotations

import json
import logging
import random
import ssl
import threading
import urllib.error
import urllib.parse
import urllib.request
from typing import Callable, Mapping

from pybroker.client.config import Config

log = logging.getLogger("pybroker.client")

ACCEPT_V1 = "application/vnd.nsq; version=1.0"


def _join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def build_lookup_url(address: str, topic: str) -> str:
    """go-nsq's buildLookupAddr: add a scheme, default the path to /lookup, add topic.

    Raises:
        ValueError: the address has no port.
    """
    url = address if "://" in address else "http://" + address
    parts = urllib.parse.urlsplit(url)
    if parts.port is None:
        raise ValueError(f"missing port in lookupd address {address!r}")
    path = parts.path if parts.path not in ("", "/") else "/lookup"
    query = urllib.parse.parse_qsl(parts.query)
    query.append(("topic", topic))
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path,
                                    urllib.parse.urlencode(query), ""))


def get_json(url: str, timeout_s: float, context: ssl.SSLContext | None = None) -> object:
    """GET a v1 NSQ endpoint; unwrap the pre-1.0 ``{"data": ...}`` envelope.

    Raises:
        OSError (URLError, HTTPError), ValueError: unreachable, non-200 or not JSON.
    """
    req = urllib.request.Request(url, headers={"Accept": ACCEPT_V1})
    with urllib.request.urlopen(req, timeout=timeout_s, context=context) as resp:
        body = resp.read()
    data = json.loads(body)
    if isinstance(data, dict) and "status_code" in data and "data" in data:
        data = data["data"]
    return data


def http_url(address: str, path: str, scheme: str = "http") -> str:
    base = address if "://" in address else f"{scheme}://{address}"
    return base.rstrip("/") + path


def _json_list(data: object, key: str) -> list[object]:
    """``data[key]`` of a JSON object answer, a list ([] when absent or null).

    Raises:
        ValueError: the answer is not an object, or ``key`` is not a list.
    """
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    value = data.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise ValueError(f"{key!r} is not a list")
    return value


def producers_of(data: object) -> list[dict[str, object]]:
    """The ``producers`` of a ``/lookup`` answer.

    Raises:
        ValueError: not the shape nsqlookupd answers with.
    """
    producers = _json_list(data, "producers")
    if not all(isinstance(p, dict) for p in producers):
        raise ValueError("'producers' holds a non-object")
    return [p for p in producers if isinstance(p, dict)]


def lookup_producers(address: str, topic: str,
                     timeout_s: float = 5.0) -> list[dict[str, object]]:
    """The ``producers`` a lookupd lists for ``topic`` (empty if it does not know it).

    Raises:
        OSError, ValueError: unreachable, non-200 other than 404, or not /lookup's shape.
    """
    try:
        data = get_json(build_lookup_url(address, topic), timeout_s)
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return []
        raise
    return producers_of(data)


def _producer_address(p: Mapping[str, object], port_key: str) -> str:
    host, port = p.get("broadcast_address"), p.get(port_key)
    if not isinstance(host, str) or not host or not isinstance(port, (int, str)):
        raise ValueError(f"producer without broadcast_address and {port_key}: {p!r:.200}")
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"producer {port_key} is not a number: {port!r:.50}") from None
    if not 0 < number < 65536:
        raise ValueError(f"producer {port_key} out of range: {str(number)[:50]}")
    return _join_host_port(host, number)


def producer_tcp_address(p: Mapping[str, object]) -> str:
    """``broadcast_address:tcp_port`` of a /lookup producer.

    Raises:
        ValueError: a field is missing or of the wrong type.
    """
    return _producer_address(p, "tcp_port")


def producer_http_address(p: Mapping[str, object]) -> str:
    """``broadcast_address:http_port`` of a /lookup producer (ValueError as above)."""
    return _producer_address(p, "http_port")


def lookupd_topics(address: str, timeout_s: float = 5.0) -> list[str]:
    """Every topic a lookupd knows (``/topics``).

    Raises:
        OSError, ValueError: unreachable, non-200, or not /topics' shape.
    """
    data = get_json(http_url(address, "/topics"), timeout_s)
    return [str(t) for t in _json_list(data, "topics")]


FAST_RETRY_S = 0.1


class LookupdPoller:
    """Polls nsqlookupd for a Consumer. Owned by the Consumer; runs its own thread."""

    def __init__(self, topic: str, config: Config, on_producers: Callable[[list[str]], None],
                 stop: threading.Event, connections: Callable[[], int] | None = None) -> None:
        self.topic = topic
        self.config = config
        self.on_producers = on_producers
        self.connections = connections     # the consumer's live connections
        self._stop = stop
        self._lock = threading.Lock()
        self._urls: list[str] = []
        self._index = 0
        self._recheck = threading.Event()
        self._thread: threading.Thread | None = None
        self.queries = 0

    def has_addresses(self) -> bool:
        with self._lock:
            return bool(self._urls)

    def add(self, address: str) -> None:
        """Add a lookupd; the first one triggers a query now and starts the poll thread."""
        url = build_lookup_url(address, self.topic)
        with self._lock:
            if url in self._urls:
                return
            self._urls.append(url)
            first = len(self._urls) == 1
        if first:
            self.query()
            self._thread = threading.Thread(target=self._run, name=f"nsq-lookupd-{self.topic}",
                                            daemon=True)
            self._thread.start()

    def remove(self, address: str) -> None:
        url = build_lookup_url(address, self.topic)
        with self._lock:
            if url not in self._urls:
                raise ValueError(f"not using lookupd {address}")
            if len(self._urls) == 1:
                raise ValueError(f"cannot remove the only lookupd {address}")
            self._urls.remove(url)

    def recheck(self) -> None:
        """Query again soon (a connection closed)."""
        self._recheck.set()

    def _alone(self) -> bool:
        return self.connections is not None and self.connections() == 0

    def _run(self) -> None:
        interval = self.config.lookupd_poll_interval
        fast = FAST_RETRY_S if self._alone() else 0.0
        jitter = random.random() * self.config.lookupd_poll_jitter * interval
        wait = min(fast, jitter) if fast else jitter
        jittering = True        # the first wait: the poll starts after it (go-nsq's)
        while not self._stop.is_set():
            woke = self._recheck.wait(wait)
            if self._stop.is_set():
                return
            if jittering and not woke and not fast:
                jittering, wait = False, interval
                continue
            jittering = False
            self._recheck.clear()
            self.query()
            # no connection after this answer: ask again soon, backing off to interval
            fast = min(interval, max(FAST_RETRY_S, fast * 2)) if self._alone() else 0.0
            wait = fast or interval

    def _next_url(self) -> str:
        with self._lock:
            if self._index >= len(self._urls):
                self._index = 0
            url = self._urls[self._index]
            self._index = (self._index + 1) % len(self._urls)
            return url

    def query(self) -> None:
        """One round: ask a lookupd (the next ones on failure, 3 tries) and connect."""
        for _ in range(3):
            url = self._next_url()
            log.info("querying nsqlookupd %s", url)
            self.queries += 1
            try:
                data = get_json(url, self.config.lookupd_poll_timeout)
            except urllib.error.HTTPError as e:
                if e.code == 404:      # the topic is not registered (yet)
                    return
                log.error("error querying nsqlookupd (%s) - %s", url, e)
                continue
            except (OSError, ValueError) as e:
                log.error("error querying nsqlookupd (%s) - %s", url, e)
                continue
            try:
                addrs = [producer_tcp_address(p) for p in producers_of(data)]
            except ValueError as e:
                log.error("bad answer from nsqlookupd (%s) - %s", url, e)
                continue
            self.on_producers(addrs)
            return
