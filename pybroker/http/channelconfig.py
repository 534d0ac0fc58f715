"""``/channel/config``: a channel's dead-letter settings (beyond nsqd).

``GET /channel/config?topic=&channel=`` answers the channel's current values;
``POST`` with ``max_attempts=`` and/or ``dead_letter_topic=`` sets them for that channel
(kept in ``nsqd.dat`` across restarts). An empty ``dead_letter_topic`` means the default
``<topic>.dead``. Errors in nsqd's shape: 400 ``MISSING_ARG_TOPIC``, 404
``CHANNEL_NOT_FOUND``, 400 ``INVALID_ARG_MAX_ATTEMPTS``, 400
``INVALID_ARG_DEAD_LETTER_TOPIC``, 400 ``MISSING_ARG_MAX_ATTEMPTS_OR_DEAD_LETTER_TOPIC``,
400 ``DEAD_LETTER_CYCLE`` (the dead letters would come back to this topic through the
dead-letter settings of the channels as they are now). The change is made on the
channel's owner loop. See docs/dead-letters.md.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, TypedDict

from pybroker.protocol.deadletter import (MAX_ATTEMPTS, DeadLetterSettings, check_dead_letter_topic, closes_cycle,
                                          dead_letter_target)
from pybroker.http.gather import Gather
from pybroker.http.request import Request, first
from pybroker.http.response import Response, error, ok_json

if TYPE_CHECKING:
    from pybroker.core.channel import Channel
    from pybroker.http.views import ApiView


class ChannelConfig(TypedDict):
    """What /channel/config answers."""

    topic: str
    channel: str
    max_attempts: int
    dead_letter_topic: str
    dead_letter_count: int
    configured: DeadLetterSettings


def settings_of(ch: Channel) -> ChannelConfig:
    """What GET answers (and POST, after the change)."""
    return {"topic": ch.topic_name, "channel": ch.name, "max_attempts": ch.max_attempts,
            "dead_letter_topic": ch.dead_letter_topic or "",
            "dead_letter_count": ch.dead_letter_count,
            "configured": ch.dl_settings.copy()}


def _configure(ch: Channel, settings: DeadLetterSettings) -> ChannelConfig:
    """On ch's owner loop: take the new settings; requeued messages now out of
    attempts go at the next dispatch."""
    if not ch.deleted:
        ch.configure_dead_letters(settings)
        ch.owner.mark_dirty(ch)
    return settings_of(ch)


def _targets_of(api: ApiView, topic: str) -> list[str]:
    """Where the channels of ``topic`` dead-letter to (those with max_attempts), as
    they are now (read from the HTTP thread: a setting changing meanwhile is seen
    before or after, either is a fair answer)."""
    t = api.broker.topics.get(topic)
    if t is None:
        return []
    return [c.dead_letter_topic for c in list(t.channels.values())
            if c.max_attempts and c.dead_letter_topic is not None]


def get_config(api: ApiView, req: Request) -> Response:
    ch = api._existing_channel(req)
    return ok_json(settings_of(ch))


def post_config(api: ApiView, req: Request) -> Response | Gather[Response]:
    ch = api._existing_channel(req)
    q = api._params(req)
    raw_max, raw_topic = first(q, b"max_attempts"), first(q, b"dead_letter_topic")
    if raw_max is None and raw_topic is None:
        return error(400, "MISSING_ARG_MAX_ATTEMPTS_OR_DEAD_LETTER_TOPIC")
    settings = ch.dl_settings.copy()
    if raw_max is not None:
        if not raw_max.isdigit() or len(raw_max) > 5 or int(raw_max) > MAX_ATTEMPTS:
            return error(400, "INVALID_ARG_MAX_ATTEMPTS")
        settings["max_attempts"] = int(raw_max)
    if raw_topic is not None:
        try:
            name = raw_topic.decode("ascii")
        except UnicodeDecodeError:
            return error(400, "INVALID_ARG_DEAD_LETTER_TOPIC")
        settings["dead_letter_topic"] = name
    max_attempts = settings.get("max_attempts", ch.topic.dl_defaults[0])
    name = settings.get("dead_letter_topic", ch.topic.dl_defaults[1])
    if (raw_topic is not None or max_attempts) and \
            check_dead_letter_topic(ch.topic_name, name) is not None:
        return error(400, "INVALID_ARG_DEAD_LETTER_TOPIC")
    target = dead_letter_target(ch.topic_name, name)
    if max_attempts and target is not None and \
            closes_cycle(ch.topic_name, target, lambda t: _targets_of(api, t)):
        return error(400, "DEAD_LETTER_CYCLE")

    def done(results: list[object]) -> Response:
        api.broker.notify_changed()   # saved in nsqd.dat at once, as a pause is
        got = results[0] if results and isinstance(results[0], dict) else settings_of(ch)
        return ok_json(got)

    return Gather([(ch.owner, _configure, (ch, settings))], done)
