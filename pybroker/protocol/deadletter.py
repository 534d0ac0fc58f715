"""Dead letters: where a channel's dead letters go, and the envelope they travel in.

A dead letter is one message of the dead-letter topic whose body is a header, one line
of JSON, then ``\\n``, then the original body byte for byte (docs/dead-letters.md)::

    {"v":1,"topic":"orders","channel":"billing","id":"000000000000002a","attempts":5,
     "first_delivery_ms":...,"last_delivery_ms":...,"dead_at_ms":...,"published_ms":...,
     "from":["orders"],"hops":[],"body_len":11}\\n<the original body>

The header is ASCII (json.dumps escapes everything else) and never holds a newline, so
the first ``\\n`` always ends it, whatever bytes the body holds.

A dead letter that is dead-lettered again is not wrapped again: ``wrap`` extends its
header (the newest hop on top, the earlier ones in ``hops``, every topic it left in
``from``) around the same original body, and refuses (None) a move into a topic it
already left, which ends dead-letter cycles. Pure functions, no I/O.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypedDict

from pybroker.protocol.names import is_ephemeral, is_valid_name

ENVELOPE_VERSION = 1
DEFAULT_SUFFIX = ".dead"
MAX_ATTEMPTS = 65535     # the wire's attempts field is 16 bits
HEADER_KEYS = ("v", "topic", "channel", "id", "attempts", "first_delivery_ms",
               "last_delivery_ms", "dead_at_ms", "published_ms", "from", "hops", "body_len")
# the fields of one hop (the top of the header, and each entry of "hops")
HOP_KEYS = ("topic", "channel", "id", "attempts", "first_delivery_ms", "last_delivery_ms",
            "dead_at_ms", "published_ms")
# the channel kept on every dead-letter topic, so dead letters wait for a human
KEEP_CHANNEL = "dead-letters"
# a header line longer than this is not taken for an envelope's (wrap reads it in full)
MAX_HEADER = 64 * 1024


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


class DeadLetterSettings(TypedDict, total=False):
    """A channel's own dead-letter settings (a missing key: the topic's default)."""

    max_attempts: int
    dead_letter_topic: str


def dead_letter_settings(extra: dict[str, object]) -> DeadLetterSettings:
    """A channel's own settings from its ``nsqd.dat`` entry (extra keys nsqd ignores);
    a value of the wrong shape is dropped (the default applies)."""
    out: DeadLetterSettings = {}
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


def _hop(topic: str, channel: str, offset: int, attempts: int, first_delivery_ms: int,
         last_delivery_ms: int, dead_at_ms: int, published_ms: int) -> dict[str, object]:
    return {"topic": topic, "channel": channel, "id": f"{offset:016x}", "attempts": attempts,
            "first_delivery_ms": first_delivery_ms, "last_delivery_ms": last_delivery_ms,
            "dead_at_ms": dead_at_ms, "published_ms": published_ms}


def _build(hop: dict[str, object], from_: list[str], hops: list[dict[str, object]],
           body: bytes) -> bytes:
    header = {"v": ENVELOPE_VERSION, **hop, "from": from_, "hops": hops,
              "body_len": len(body)}
    return json.dumps(header, separators=(",", ":")).encode("ascii") + b"\n" + body


def envelope(*, topic: str, channel: str, offset: int, attempts: int,
             first_delivery_ms: int, last_delivery_ms: int, dead_at_ms: int,
             published_ms: int, body: bytes) -> bytes:
    """The dead-letter message body for one message (its first hop)."""
    hop = _hop(topic, channel, offset, attempts, first_delivery_ms, last_delivery_ms,
               dead_at_ms, published_ms)
    return _build(hop, [topic], [], body)


def wrap(*, topic: str, channel: str, offset: int, attempts: int, first_delivery_ms: int,
         last_delivery_ms: int, dead_at_ms: int, published_ms: int, body: bytes,
         target: str) -> bytes | None:
    """The dead letter of a message given up on in topic/channel, going to ``target``.
    A body that is itself a dead letter keeps its original body: its header gets this
    hop on top and the earlier top in ``hops``. None when the message was already
    dead-lettered from ``target`` (moving it would close a cycle)."""
    hop = _hop(topic, channel, offset, attempts, first_delivery_ms, last_delivery_ms,
               dead_at_ms, published_ms)
    try:
        prior = parse_envelope(body, MAX_HEADER)
    except EnvelopeError:
        return None if target == topic else _build(hop, [topic], [], body)
    from_ = list(prior.from_topics) + [topic]
    if target in from_:
        return None
    hops = list(prior.hops) + [{k: prior.header[k] for k in HOP_KEYS}]
    return _build(hop, from_, hops, prior.body)


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
    header: dict[str, object]
    from_topics: tuple[str, ...] = ()     # every topic it was dead-lettered from
    hops: tuple[dict[str, object], ...] = ()  # the hops before the newest, oldest first


class EnvelopeError(ValueError):
    """A message that is not a dead-letter envelope this version can read."""


def parse_envelope(data: bytes, max_header: int = -1) -> DeadLetter:
    """Split a dead-letter message into header and body; raises EnvelopeError (also
    when the header line is longer than max_header, if given)."""
    nl = data.find(b"\n", 0, None if max_header < 0 else max_header + 1)
    if nl < 0:
        raise EnvelopeError("no header line")
    try:
        header = json.loads(data[:nl])
    except (UnicodeDecodeError, ValueError, RecursionError) as e:   # deep nesting: RecursionError
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
    # "from" and "hops" came later: an envelope without them left only its "topic"
    from_ = header.get("from", [strs["topic"]])
    hops = header.get("hops", [])
    if not isinstance(from_, list) or not all(isinstance(t, str) for t in from_) or \
            not isinstance(hops, list) or not all(
                isinstance(h, dict) and all(k in h for k in HOP_KEYS) for h in hops):
        raise EnvelopeError("header field of the wrong type")
    return DeadLetter(topic=strs["topic"], channel=strs["channel"], id=strs["id"],
                      attempts=ints["attempts"], first_delivery_ms=ints["first_delivery_ms"],
                      last_delivery_ms=ints["last_delivery_ms"], dead_at_ms=ints["dead_at_ms"],
                      published_ms=ints["published_ms"], body=body, header=header,
                      from_topics=tuple(from_), hops=tuple(hops))


def closes_cycle(topic: str, target: str, targets_of: Callable[[str], list[str]],
                 limit: int = 10_000) -> bool:
    """Whether dead letters of ``topic`` going to ``target`` could come back to
    ``topic``: following, from ``target``, the dead-letter topics of each topic's
    channels (``targets_of``; those with max_attempts set) reaches ``topic``. At most
    ``limit`` topics are visited (the walk is bounded whatever the configuration)."""
    seen = {target}
    todo = [target]
    while todo and len(seen) <= limit:
        for nxt in targets_of(todo.pop()):
            if nxt == topic:
                return True
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return False
