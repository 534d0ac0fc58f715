"""``pybroker dead-letters``: list, show and republish a dead-letter topic's messages.

The dead letters are read through a channel of their own (``dead-letters``, which the
broker creates on every dead-letter topic so that they wait for someone) with the
client's Consumer: everything the channel holds is taken in flight at once (up to
``--max``), then ``list`` and ``show`` give every message back (REQ without delay, after
CLS so none comes back to this run), and ``republish`` publishes the chosen ones to
their original topic with the Producer and FINs each only after its publish was
answered OK; the rest are given back. Nothing is FIN'd that was not republished (a
duplicate, the same original topic and id twice, is FIN'd after its first copy was
republished). Envelope format: docs/dead-letters.md.
"""
from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import List, Optional

import typer

from pybroker.client import Config, Consumer, Message, Producer
from pybroker.client.config import parse_duration
from pybroker.client.lookupd import http_url
from pybroker.protocol.deadletter import DeadLetter, EnvelopeError, parse_envelope
from pybroker.tools._common import GoFlagsCommand, fatal, opt, setup_logging

log = logging.getLogger("pybroker.tools")
PREVIEW = 40
KEEP_CHANNEL = "dead-letters"

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="List, show and republish dead letters (pybroker only).")


@dataclass
class Held:
    """One dead-letter message in flight to this run, and its parsed envelope."""

    message: Message
    letter: DeadLetter | None
    error: str = ""

    @property
    def id(self) -> str:
        return self.message.id.decode("ascii", "replace")


class Session:
    """A consumer that takes the channel's messages in flight and holds them."""

    def __init__(self, address: str, topic: str, channel: str, max_messages: int,
                 wait_s: float, timeout_s: float) -> None:
        self.held: list[Held] = []
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._got = threading.Event()
        cfg = Config(user_agent="pybroker-dead-letters", max_in_flight=max_messages)
        self.consumer = Consumer(topic, channel, self._handle, cfg)
        self.max_messages = max_messages
        self.consumer.connect_to_nsqd(address)
        deadline = time.monotonic() + timeout_s
        # the messages come at once: wait until none came for wait_s, or max were taken
        while time.monotonic() < deadline:
            with self._lock:
                idle = time.monotonic() - self._last
                full = len(self.held) >= max_messages
            if full or idle >= wait_s:
                break
            time.sleep(0.02)
        self.consumer.stop()   # CLS: nothing more comes; what is held is answered next

    def _handle(self, msg: Message) -> None:
        msg.disable_auto_response()
        try:
            held = Held(msg, parse_envelope(msg.body))
        except EnvelopeError as e:
            held = Held(msg, None, str(e))
        with self._lock:
            self.held.append(held)
            self._last = time.monotonic()

    def give_back(self, items: list[Held]) -> None:
        for h in items:
            if not h.message.has_responded():
                h.message.requeue_without_backoff(0)

    def close(self) -> None:
        self.give_back(self.held)
        self.consumer.wait(10.0)
        self.consumer.close(5.0)


def _age(ms: int, now_ms: int) -> str:
    s = max(0, now_ms - ms) // 1000
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m"
    if s < 172800:
        return f"{s // 3600}h"
    return f"{s // 86400}d"


def _preview(body: bytes) -> str:
    text = repr(body[:PREVIEW])[2:-1]
    return text + ("..." if len(body) > PREVIEW else "")


def _matches(h: Held, ids: list[str]) -> bool:
    return h.id in ids or (h.letter is not None and h.letter.id in ids)


def _check_topic(topic: str, http_address: str) -> None:
    """Refuse a topic the broker does not have (a SUB would create it: a misspelt name
    would leave an empty topic behind and list nothing)."""
    query = urllib.parse.urlencode({"format": "json", "topic": topic,
                                    "include_clients": "false"})
    try:
        with urllib.request.urlopen(http_url(http_address, "/stats?" + query),
                                    timeout=10) as resp:
            stats = json.loads(resp.read(8 << 20))
    except (OSError, ValueError) as e:
        fatal(f"cannot read /stats of {http_address}: {e}")
    names = [t.get("topic_name") for t in stats.get("topics") or []]
    if topic not in names:
        fatal(f"no topic {topic} on {http_address}: nothing was dead-lettered to it yet, "
              "or the name is misspelt (a dead-letter topic is <topic>.dead unless "
              "dead_letter_topic names another)")


def _open(topic: str, channel: str, nsqd_tcp_address: str, max_messages: int,
          wait: str, nsqd_http_address: str = "") -> Session:
    if not topic:
        fatal("--topic required (the dead-letter topic, e.g. orders.dead)")
    if not nsqd_tcp_address:
        fatal("--nsqd-tcp-address required")
    if nsqd_http_address:
        _check_topic(topic, nsqd_http_address)
    try:
        wait_s = parse_duration(wait)
    except ValueError as e:
        fatal(f"--wait: {e}")
    setup_logging("warn")
    try:
        return Session(nsqd_tcp_address, topic, channel, max_messages, wait_s, 60.0)
    except (OSError, ValueError) as e:
        fatal(f"cannot read {topic}/{channel}: {e}")


_TOPIC = opt("", "topic", help="the dead-letter topic (e.g. orders.dead)")
_CHANNEL = opt(KEEP_CHANNEL, "channel", help="channel to read it through")
_TCP = opt("", "nsqd-tcp-address", help="pybroker TCP address")
_HTTP = opt("", "nsqd-http-address", help="pybroker HTTP address: when given, a topic the "
            "broker does not have is refused instead of created by the SUB")
# nsqd's default --max-rdy-count: more than the broker's max_rdy_count cannot be in flight
_MAX = opt(2500, "max", help="most dead letters to take at once (at most the broker's "
           "--max-rdy-count)", min=1, max=100000)
_WAIT = opt("1s", "wait", help="stop reading after no message came for this long",
            metavar="DURATION")


@app.command("list", cls=GoFlagsCommand)
def list_command(topic: str = _TOPIC, channel: str = _CHANNEL, nsqd_tcp_address: str = _TCP,
                 max_messages: int = _MAX, wait: str = _WAIT,
                 nsqd_http_address: str = _HTTP) -> None:
    """One line per dead letter: id, original topic/channel/id, attempts, age, body."""
    s = _open(topic, channel, nsqd_tcp_address, max_messages, wait, nsqd_http_address)
    now_ms = int(time.time() * 1000)
    try:
        typer.echo("ID                ORIGINAL                                ATTEMPTS  AGE  BODY")
        for h in s.held:
            if h.letter is None:
                typer.echo(f"{h.id}  (not an envelope: {h.error})")
                continue
            d = h.letter
            where = f"{d.topic}/{d.channel}/{d.id}"
            typer.echo(f"{h.id}  {where:<38}  {d.attempts:>8}  {_age(d.dead_at_ms, now_ms):>4}"
                       f"  {_preview(d.body)}")
        typer.echo(f"{len(s.held)} dead letters")
    finally:
        s.close()


@app.command("show", cls=GoFlagsCommand)
def show_command(msg_id: str = typer.Argument(..., metavar="ID",
                                              help="dead-letter id or original message id"),
                 topic: str = _TOPIC, channel: str = _CHANNEL, nsqd_tcp_address: str = _TCP,
                 max_messages: int = _MAX, wait: str = _WAIT,
                 nsqd_http_address: str = _HTTP) -> None:
    """The header of one dead letter, then its original body."""
    s = _open(topic, channel, nsqd_tcp_address, max_messages, wait, nsqd_http_address)
    try:
        found = [h for h in s.held if _matches(h, [msg_id])]
        if not found:
            typer.echo(f"no dead letter {msg_id} in {topic}/{channel}", err=True)
            raise typer.Exit(1)
        for h in found:
            typer.echo(f"dead letter {h.id}")
            if h.letter is None:
                typer.echo(f"  not an envelope: {h.error}")
                continue
            for key, value in h.letter.header.items():
                typer.echo(f"  {key}: {value}")
            typer.echo("  body:")
            out = typer.get_binary_stream("stdout")
            out.write(h.letter.body + b"\n")
            out.flush()
    finally:
        s.close()


@app.command("republish", cls=GoFlagsCommand)
def republish_command(
        msg_ids: List[str] = opt([], "id", help="dead-letter id or original message id "
                                 "(may be given multiple times)"),
        older_than: Optional[str] = opt(None, "older-than", help="those dead-lettered longer "
                                        "ago than this", metavar="DURATION"),
        all_letters: bool = opt(False, "all", help="every dead letter"),
        topic: str = _TOPIC, channel: str = _CHANNEL, nsqd_tcp_address: str = _TCP,
        max_messages: int = _MAX, wait: str = _WAIT, nsqd_http_address: str = _HTTP) -> None:
    """Publish dead letters to their original topic again, then FIN them."""
    if not msg_ids and older_than is None and not all_letters:
        fatal("choose what to republish: --id, --older-than or --all")
    min_age_ms = 0
    if older_than is not None:
        try:
            min_age_ms = int(parse_duration(older_than) * 1000)
        except ValueError as e:
            fatal(f"--older-than: {e}")
    s = _open(topic, channel, nsqd_tcp_address, max_messages, wait, nsqd_http_address)
    now_ms = int(time.time() * 1000)
    done = dups = failed = 0
    producer = Producer(nsqd_tcp_address)
    try:
        seen: set[tuple[str, str]] = set()
        for h in s.held:
            d = h.letter
            if d is None:
                continue
            if msg_ids and not _matches(h, msg_ids):
                continue
            if older_than is not None and now_ms - d.dead_at_ms < min_age_ms:
                continue
            key = (d.topic, d.id)
            if key in seen:
                h.message.finish()   # a second copy (dead-lettered again after a crash)
                dups += 1
                continue
            try:
                producer.publish(d.topic, d.body)
            except Exception as e:
                typer.echo(f"{h.id}: republishing to {d.topic} failed: {e}", err=True)
                failed += 1
                continue
            h.message.finish()
            seen.add(key)
            done += 1
            typer.echo(f"{h.id}: republished {d.id} to {d.topic}")
    finally:
        producer.stop()
        s.close()
    typer.echo(f"{done} republished, {dups} duplicates dropped, "
               f"{len(s.held) - done - dups} left")
    if failed:
        raise typer.Exit(1)
