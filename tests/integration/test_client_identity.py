"""A client's identity in /stats before and after IDENTIFY, as nsqd shows it.

nsqd sets a connection's client_id and hostname to the remote host when it accepts it
(IDENTIFY then replaces both, with whatever the client sends, "" included). nsqadmin's
channel page and /stats' text lines ("127.0.0.1:57222 ua") are built from them. The same
raw V2 clients (no IDENTIFY; IDENTIFY with both fields; IDENTIFY with neither) run
against pybroker and a real nsqd, and their /stats entries, JSON and text, must agree.
"""
from __future__ import annotations

import json
import re
import urllib.request
from typing import Any

from tests.support import wire
from tests.support.broker import BrokerProcess, unique_name, wait_until


def _stats(b: BrokerProcess, topic: str, fmt: str) -> bytes:
    url = f"http://{b.http_hostport}/stats?format={fmt}&topic={topic}"
    with urllib.request.urlopen(url, timeout=10) as r:
        data: bytes = r.read()
        return data


def _identities(b: BrokerProcess) -> dict[str, Any]:
    """Connect three raw V2 consumers and read how /stats shows each."""
    topic = unique_name("ident")
    clients: dict[str, wire.WireClient] = {}
    try:
        for name, identify in (("none", None),
                               ("both", {"client_id": "cid-1", "hostname": "host-1",
                                         "user_agent": "ua/1"}),
                               ("empty", {"feature_negotiation": False})):
            c = wire.WireClient.connect(b.tcp_address)  # type: ignore[arg-type]
            if identify is not None:
                c.send(wire.identify(**identify))
                c.expect_response(b"OK")
            c.send(wire.sub(topic, "ch"))
            c.expect_response(b"OK")
            clients[name] = c

        def entries() -> list[dict[str, Any]] | None:
            doc = json.loads(_stats(b, topic, "json"))
            found = [c for t in doc["topics"] for ch in t["channels"]
                     for c in ch["clients"] or ()]
            return found if len(found) == 3 else None

        found: Any = wait_until(entries, what="three clients in /stats")
        text = _stats(b, topic, "text").decode()
        out: dict[str, Any] = {}
        for name, c in clients.items():
            host, port = c.sock.getsockname()[:2]
            remote = f"{host}:{port}"
            entry = next(e for e in found if e["remote_address"] == remote)
            # nsqd's text line: "[V2 <hostname>:<port> <user agent>   ] state: ..."
            line = re.search(r"\[V2 ([^\]]*?:" + str(port) + r"\b[^\]]*?)\s*\]", text)
            assert line is not None, f"no text line for {remote}:\n{text}"
            out[name] = {"client_id": entry["client_id"], "hostname": entry["hostname"],
                         "remote_address": entry["remote_address"].replace(str(port), "PORT"),
                         "text": line.group(1).replace(str(port), "PORT")}
        return out
    finally:
        for c in clients.values():
            c.close()


def test_client_identity_before_and_after_identify(broker: BrokerProcess,
                                                   nsqd: BrokerProcess) -> None:
    mine = _identities(broker)
    theirs = _identities(nsqd)
    # nsqd: the remote host until IDENTIFY, then exactly what IDENTIFY said
    assert theirs["none"]["client_id"] == theirs["none"]["hostname"] == "127.0.0.1"
    assert mine == theirs


def test_no_identify_shows_the_remote_host(any_broker: BrokerProcess) -> None:
    """Without nsqd on PATH this still checks pybroker on its own."""
    got = _identities(any_broker)["none"]
    assert got == {"client_id": "127.0.0.1", "hostname": "127.0.0.1",
                   "remote_address": "127.0.0.1:PORT", "text": "127.0.0.1:PORT"}


def test_identify_overrides(broker: BrokerProcess) -> None:
    got = _identities(broker)
    assert (got["both"]["client_id"], got["both"]["hostname"]) == ("cid-1", "host-1")
    assert got["both"]["text"] == "host-1:PORT ua/1"
    assert (got["empty"]["client_id"], got["empty"]["hostname"]) == ("", "")
