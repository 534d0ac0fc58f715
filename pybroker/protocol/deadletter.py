"""Dead letters: where a channel's dead letters go, and the envelope they travel in.

A dead letter is one message of the dead-letter topic whose body is a header, one line
of JSON, then ``\\n``, then the original body byte for byte (docs/dead-letters.md)::

    {"v":1,"topic":"orders","channel":"billing","id":"000000000000002a","attempts":5,
     "first_delivery_ms":...,"last_delivery_ms":...,"dead_at_ms":...,"published_ms":...,
     "body_len":11}\\n<the original body>

The header is ASCII (json.dumps escapes everything else) and never holds a newline, so
the first ``\\n`` always ends it, whatever bytes the body holds. Pure functions, no I/O.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pybroker.protocol.names import is_ephemeral, is_valid_name

ENVELOPE_VERSION = 1
DEFAULT_SUFFIX = ".dead"
MAX_ATTEMPTS = 65535     # the wire's attempts field is 16 bits
HEADER_KEYS = ("v", "topic", "channel", "id", "attempts", "first_delivery_ms",
               "last_delivery_ms", "dead_at_ms", "published_ms", "body_len")


def default_dead_letter_topic(topic: str) -> str:
    return topic + DEFAULT_SUFFIX


def dead_letter_target(topic: str, configured: str) -> str | None:
    """The topic a channel of ``topic`` dead-letters to: ``configured``, or
    ``<topic>.dead`` when that is empty; None when the name is not a valid, durable
    topic name other than ``topic`` itself (then nothing is dead-lettered)."""
    name = configured or default_dead_letter_topic(topic)
    if not is_valid_name(name) or is_ephemeral(name) or name == topic:
        return None
    return name


def check_dead_letter_topic(topic: str, configured: str) -> str | None:
    """Why ``configured`` cannot be the dead-letter topic of ``topic``, or None."""
    name = configured or default_dead_letter_topic(topic)
    if not is_valid_name(name):
        if configured:
            return f"{configured!r} is not a valid topic name"
        return f"the default {name!r} is not a valid topic name (name one)"
    if is_ephemeral(name):
        return "a dead-letter topic cannot be #ephemeral"
    if name == topic:
        return "a topic cannot be its own dead-letter topic"
    return None


def dead_letter_settings(extra: dict[str, Any]) -> dict[str, Any]:
    """A channel's own settings from its ``nsqd.dat`` entry (extra keys nsqd ignores);
    a value of the wrong shape is dropped (the default applies)."""
    out: dict[str, Any] = {}
    n = extra.get("max_attempts")
    if isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= MAX_ATTEMPTS:
        out["max_attempts"] = n
    name = extra.get("dead_letter_topic")
    if isinstance(name, str) and (name == "" or is_valid_name(name)):
        out["dead_letter_topic"] = name
    return out


def is_dead_letter_topic(name: str, configured_default: str) -> bool:
    """True for a topic the config's defaults do not apply to: a default dead-letter
    topic (``*.dead``) or the configured one. Its channels dead-letter only when set
    one by one, so dead letters never cascade on their own."""
    return name.endswith(DEFAULT_SUFFIX) or (bool(configured_default)
                                             and name == configured_default)


def envelope(*, topic: str, channel: str, offset: int, attempts: int,
             first_delivery_ms: int, last_delivery_ms: int, dead_at_ms: int,
             published_ms: int, body: bytes) -> bytes:
    """The dead-letter message body for one message."""
    header = {"v": ENVELOPE_VERSION, "topic": topic, "channel": channel,
              "id": f"{offset:016x}", "attempts": attempts,
              "first_delivery_ms": first_delivery_ms, "last_delivery_ms": last_delivery_ms,
              "dead_at_ms": dead_at_ms, "published_ms": published_ms, "body_len": len(body)}
    return json.dumps(header, separators=(",", ":")).encode("ascii") + b"\n" + body


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A parsed envelope: the header's fields and the original body."""

    topic: str
    channel: str
    id: str
    attempts: int
    first_delivery_ms: int
    last_delivery_ms: int
    dead_at_ms: int
    published_ms: int
    body: bytes
    header: dict[str, Any]


class EnvelopeError(ValueError):
    """A message that is not a dead-letter envelope this version can read."""


def parse_envelope(data: bytes) -> DeadLetter:
    """Split a dead-letter message into header and body; raises EnvelopeError."""
    nl = data.find(b"\n")
    if nl < 0:
        raise EnvelopeError("no header line")
    try:
        header = json.loads(data[:nl])
    except (UnicodeDecodeError, ValueError) as e:
        raise EnvelopeError(f"header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise EnvelopeError("header is not a JSON object")
    if header.get("v") != ENVELOPE_VERSION:
        raise EnvelopeError(f"unknown envelope version {header.get('v')!r}")
    body = data[nl + 1:]
    try:
        ints = {k: header[k] for k in ("attempts", "first_delivery_ms", "last_delivery_ms",
                                        "dead_at_ms", "published_ms", "body_len")}
        strs = {k: header[k] for k in ("topic", "channel", "id")}
    except KeyError as e:
        raise EnvelopeError(f"header has no {e.args[0]!r}") from None
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in ints.values()) or \
            not all(isinstance(v, str) for v in strs.values()):
        raise EnvelopeError("header field of the wrong type")
    if ints["body_len"] != len(body):
        raise EnvelopeError(f"body is {len(body)} bytes, header says {ints['body_len']}")
    return DeadLetter(topic=strs["topic"], channel=strs["channel"], id=strs["id"],
                      attempts=ints["attempts"], first_delivery_ms=ints["first_delivery_ms"],
                      last_delivery_ms=ints["last_delivery_ms"], dead_at_ms=ints["dead_at_ms"],
                      published_ms=ints["published_ms"], body=body, header=header)
