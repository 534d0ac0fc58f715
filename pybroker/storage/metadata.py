"""Broker metadata (topics, channels, paused flags, extras): nsqd-compatible JSON.

Owns the metadata file: its schema, atomic replacement and recovery from damage.
The schema is nsqd 1.3's ``nsqd.dat``,
``{"topics":[{"name","paused","channels":[{"name","paused"}]}],"version":"1.3.0"}``;
pybroker may add keys anywhere (``extra``), which nsqd ignores when it reads the file
and which are kept here on a load/save round trip, so either program can read the
other's file. stdlib only.

Writing: temp file in the same directory, fsync, rename over the file, fsync the
directory; the copy being replaced is first kept as ``<file>.bak`` (if it parses).
Loading: a damaged file is moved aside to ``<file>.bad``, logged, and ``<file>.bak``
is used instead; if that is damaged too, the result is empty metadata. An unreadable
file (permissions, I/O error) raises MetadataError instead: falling back then would
let the next save overwrite metadata that is still there.

Ownership: saves run on the ``storage`` thread only; loading runs at start-up on the
main thread, before any other thread exists.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field

from ._fsutil import atomic_write, tmp_path, unique_aside
from .errors import MetadataError, from_oserror

log = logging.getLogger("pybroker.storage.metadata")

NSQD_VERSION = "1.3.0"
_TOPIC_KEYS = ("name", "paused", "channels")
_CHANNEL_KEYS = ("name", "paused")
_TOP_KEYS = ("topics", "version")


@dataclass(slots=True)
class ChannelMeta:
    name: str
    paused: bool = False
    extra: dict[str, object] = field(default_factory=dict)


@dataclass(slots=True)
class TopicMeta:
    name: str
    paused: bool = False
    channels: list[ChannelMeta] = field(default_factory=list)
    extra: dict[str, object] = field(default_factory=dict)


@dataclass(slots=True)
class BrokerMetadata:
    """Everything the broker persists besides messages. ``extra`` holds pybroker keys
    (e.g. deferred-message state) at the top level of the file."""
    topics: list[TopicMeta] = field(default_factory=list)
    version: str = NSQD_VERSION
    extra: dict[str, object] = field(default_factory=dict)


@dataclass(slots=True)
class MetadataLoad:
    """What load_metadata found: ``source`` is "primary", "backup" or "empty";
    ``problems`` lists the damage found (empty when all was well)."""
    metadata: BrokerMetadata
    source: str
    problems: list[str] = field(default_factory=list)


class MetadataFormatError(ValueError):
    """The JSON does not follow the schema."""


def _merge(base: dict[str, object], extra: dict[str, object], reserved: tuple[str, ...],
           what: str) -> dict[str, object]:
    clash = [k for k in extra if k in reserved]
    if clash:
        raise ValueError(f"{what} extra keys {clash} clash with the nsqd schema")
    base.update(extra)
    return base


def to_json(meta: BrokerMetadata) -> bytes:
    """Encode metadata as nsqd-compatible JSON (extras merged in as extra keys)."""
    topics = []
    for t in meta.topics:
        chans = [_merge({"name": c.name, "paused": c.paused}, c.extra, _CHANNEL_KEYS,
                        f"channel {c.name!r}") for c in t.channels]
        topics.append(_merge({"name": t.name, "paused": t.paused, "channels": chans},
                             t.extra, _TOPIC_KEYS, f"topic {t.name!r}"))
    doc = _merge({"topics": topics, "version": meta.version}, meta.extra, _TOP_KEYS,
                 "top-level")
    return json.dumps(doc, separators=(",", ":"), sort_keys=False).encode() + b"\n"


def _name_paused(d: object, what: str) -> tuple[str, bool, dict[str, object]]:
    if not isinstance(d, dict):
        raise MetadataFormatError(f"{what} is not an object: {d!r}")
    name = d.get("name")
    if not isinstance(name, str) or not name:
        raise MetadataFormatError(f"{what} has no name")
    paused = d.get("paused", False)
    if not isinstance(paused, bool):
        raise MetadataFormatError(f"{what} {name!r}: paused must be true/false")
    return name, paused, d


def _list(v: object, what: str) -> list[object]:
    if v is None:               # Go marshals an empty slice that was never set as null
        return []
    if not isinstance(v, list):
        raise MetadataFormatError(f"{what} must be a list")
    return v


def from_json(raw: bytes) -> BrokerMetadata:
    """Decode and validate metadata JSON. Raises MetadataFormatError."""
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise MetadataFormatError(f"not JSON: {e}") from e
    if not isinstance(doc, dict):
        raise MetadataFormatError("not a JSON object")
    topics = []
    for t in _list(doc.get("topics"), "topics"):
        name, paused, td = _name_paused(t, "topic")
        chans = []
        for c in _list(td.get("channels"), f"topic {name!r} channels"):
            cname, cpaused, cd = _name_paused(c, f"channel of topic {name!r}")
            chans.append(ChannelMeta(cname, cpaused,
                                     {k: v for k, v in cd.items() if k not in _CHANNEL_KEYS}))
        topics.append(TopicMeta(name, paused, chans,
                                {k: v for k, v in td.items() if k not in _TOPIC_KEYS}))
    version = doc.get("version", "")
    if not isinstance(version, str):
        raise MetadataFormatError("version must be a string")
    return BrokerMetadata(topics, version,
                          {k: v for k, v in doc.items() if k not in _TOP_KEYS})


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise MetadataError(str(from_oserror("cannot read metadata", path, e)),
                            path=path, errno=e.errno) from e


def load_metadata(path: str | os.PathLike[str]) -> MetadataLoad:
    """Load the metadata file at path, recovering from damage (see module docstring).

    A missing file (fresh data dir) gives empty metadata with source "empty".
    Raises MetadataError only when a file exists but cannot be read.
    """
    path = os.fspath(path)
    problems: list[str] = []
    for source, candidate in (("primary", path), ("backup", path + ".bak")):
        raw = _read(candidate)
        if raw is None:
            if source == "primary" and os.path.exists(path + ".bak"):
                problems.append(f"{path} is missing")
                log.warning("metadata %s is missing; trying %s.bak", path, path)
            continue
        try:
            return MetadataLoad(from_json(raw), source, problems)
        except MetadataFormatError as e:
            aside = unique_aside(candidate, ".bad")
            try:
                os.replace(candidate, aside)
            except OSError as oe:
                raise MetadataError(f"damaged metadata {candidate} ({e}) cannot be moved "
                                    f"aside: {oe}", path=candidate, errno=oe.errno) from oe
            problems.append(f"{candidate}: {e} (moved to {aside})")
            log.error("damaged metadata %s (%s): moved to %s", candidate, e, aside)
    if problems:
        log.error("no usable metadata in %s: starting with no topics", path)
    return MetadataLoad(BrokerMetadata(), "empty", problems)


def save_metadata(path: str | os.PathLike[str], meta: BrokerMetadata) -> None:
    """Atomically replace the metadata file; keep the replaced copy as ``.bak``.

    Raises:
        ValueError: an extra key clashes with the nsqd schema.
        MetadataError: the file could not be written (the old one is intact).
    """
    path = os.fspath(path)
    data = to_json(meta)
    try:
        old = _read(path)
        if old is not None and _parses(old):
            bak_tmp = tmp_path(path + ".bak")
            try:
                os.link(path, bak_tmp)
            except OSError:     # no hard links here: copy instead
                with open(bak_tmp, "wb") as f:
                    f.write(old)
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(bak_tmp, path + ".bak")
        atomic_write(path, data)
    except OSError as e:
        raise MetadataError(str(from_oserror("cannot write metadata", path, e)),
                            path=path, errno=e.errno) from e


def _parses(raw: bytes) -> bool:
    try:
        from_json(raw)
    except MetadataFormatError:
        return False
    return True
