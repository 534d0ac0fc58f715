"""``pybroker rewind``: deliver a channel's messages again from an offset or a time.

A pybroker extension (nsqd has no replay): it posts to ``/channel/rewind`` on each
pybroker HTTP address given and prints the new position, or the server's error.
Rewinding works within what the topic's log still holds (see ``retention_time`` and
``retention_bytes``).
"""
from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import List, Optional

import typer

from pybroker.client.lookupd import http_url
from pybroker.tools._common import fatal, opt


def rewind(address: str, topic: str, channel: str, offset: int | None,
           ts_ms: int | None, timeout_s: float = 10.0) -> dict[str, int]:
    """POST /channel/rewind; returns the server's answer (offset, oldest, newest).

    Raises:
        ValueError: the server refused (its error code is the message).
        OSError: the server could not be reached.
    """
    query = {"topic": topic, "channel": channel}
    if offset is not None:
        query["offset"] = str(offset)
    if ts_ms is not None:
        query["ts"] = str(ts_ms)
    url = http_url(address, "/channel/rewind?" + urllib.parse.urlencode(query))
    req = urllib.request.Request(url, data=b"", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return dict(json.loads(resp.read()))
    except urllib.error.HTTPError as e:
        try:
            code = json.loads(e.read()).get("message", str(e.code))
        except ValueError:
            code = str(e.code)
        raise ValueError(code) from None


def rewind_command(
    topic: str = opt("", "topic", help="NSQ topic"),
    channel: str = opt("", "channel", help="NSQ channel"),
    offset: Optional[int] = opt(None, "offset", help="deliver again from this topic-log "
                                "offset (a message id is its offset in hex)", min=0,
                                metavar="INT"),
    ts: Optional[int] = opt(None, "ts", help="deliver again from the first message "
                            "published at or after this time (Unix milliseconds)", min=0,
                            metavar="INT"),
    nsqd_http_address: List[str] = opt([], "nsqd-http-address", help="pybroker HTTP "
                                       "address (may be given multiple times)"),
) -> None:
    """Rewind a channel so that its messages are delivered again (pybroker only)."""
    if not topic or not channel:
        fatal("--topic and --channel are required")
    if (offset is None) == (ts is None):
        fatal("give exactly one of --offset and --ts")
    if not nsqd_http_address:
        fatal("--nsqd-http-address required")
    failed = False
    for addr in nsqd_http_address:
        try:
            got = rewind(addr, topic, channel, offset, ts)
        except (OSError, ValueError) as e:
            typer.echo(f"{addr}: rewind failed: {e}", err=True)
            failed = True
            continue
        typer.echo(f"{addr}: {topic}/{channel} rewound to offset {got['offset']} "
                   f"(retained: {got['oldest_offset']}..{got['newest_offset']})")
    if failed:
        raise typer.Exit(1)
