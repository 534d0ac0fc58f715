"""Read an nsqd 1.x data directory: its metadata and go-diskqueue files (read-only).

Owns the nsqd on-disk formats (as of nsqd 1.3.0 / go-diskqueue 1.1.0):
- ``nsqd.dat``: the metadata JSON (see metadata.py). nsqd 1.0 and 1.1 also kept
  ``nsqd.<node-id>.dat`` in parallel, and 0.3.x kept only that one.
- ``<name>.diskqueue.%06d.dat``: records ``[int32 BE size][data]``; name is the topic,
  or ``topic:channel`` for a channel. No checksum.
- ``<name>.diskqueue.meta.dat``: text ``depth\\nreadFileNum,readPos\\nwriteFileNum,writePos\\n``.
- data is an nsqd message: ``[int64 BE ts_ns][uint16 BE attempts][16-byte id][body]``.
Pending records are read from (readFileNum, readPos) to the end of every later file,
as nsqd 1.3 itself would (it also salvages bytes past a stale writePos). Damage is
handled like go-diskqueue (a size outside [26, max_msg_size + 26] or a short read
skips the rest of that file, with a log line), except that nothing is renamed or
deleted: the source directory is never modified. stdlib only.

Runs on the main thread at start-up (server/importer.py), before the loops start.
"""
from __future__ import annotations

import logging
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

from .metadata import (
    BrokerMetadata,
    ChannelMeta,
    MetadataFormatError,
    TopicMeta,
    from_json,
)

log = logging.getLogger("pybroker.storage.nsqd_import")

MSG_HEADER = struct.Struct(">qH16s")      # ts_ns, attempts, id
MIN_MSG_SIZE = MSG_HEADER.size            # 26, nsqd's minValidMsgLength
DEFAULT_MAX_MSG_SIZE = 1024 * 1024        # nsqd --max-msg-size
_SIZE = struct.Struct(">i")
_DATA_RE = re.compile(r"(.+)\.diskqueue\.(\d{6,})\.dat")
_META_RE = re.compile(r"(.+)\.diskqueue\.meta\.dat")
_OLD_META_RE = re.compile(r"nsqd\.(\d+)\.dat")


@dataclass(frozen=True, slots=True)
class NsqdMessage:
    id: bytes
    ts_ns: int
    attempts: int
    body: bytes


def decode_message(record: bytes) -> NsqdMessage:
    """Decode one nsqd message record. Raises ValueError if shorter than 26 bytes."""
    if len(record) < MIN_MSG_SIZE:
        raise ValueError(f"nsqd message record too short ({len(record)} bytes)")
    ts_ns, attempts, msg_id = MSG_HEADER.unpack_from(record)
    return NsqdMessage(msg_id, ts_ns, attempts, record[MIN_MSG_SIZE:])


@dataclass(frozen=True, slots=True)
class GoDiskQueueMeta:
    depth: int
    read_file: int
    read_pos: int
    write_file: int
    write_pos: int


def parse_diskqueue_meta(text: str) -> GoDiskQueueMeta:
    """Parse ``depth\\nreadFile,readPos\\nwriteFile,writePos\\n``. Raises ValueError."""
    lines = text.split("\n")
    if len(lines) < 3:
        raise ValueError(f"diskqueue meta has {len(lines)} lines")
    rf, rp = (int(x) for x in lines[1].split(","))
    wf, wp = (int(x) for x in lines[2].split(","))
    return GoDiskQueueMeta(int(lines[0]), rf, rp, wf, wp)


class GoDiskQueue:
    """A read-only view of one go-diskqueue (``name`` is a topic or ``topic:channel``)."""

    def __init__(self, data_path: str, name: str, files: list[int],
                 max_msg_size: int = DEFAULT_MAX_MSG_SIZE) -> None:
        self.data_path = data_path
        self.name = name
        self.files = sorted(files)
        self.max_record = max_msg_size + MIN_MSG_SIZE   # as nsqd passes it
        self.meta: GoDiskQueueMeta | None = None
        meta_path = os.path.join(data_path, f"{name}.diskqueue.meta.dat")
        try:
            with open(meta_path, encoding="ascii") as f:
                self.meta = parse_diskqueue_meta(f.read())
        except FileNotFoundError:
            if self.files:
                log.warning("DISKQUEUE(%s) no meta file: reading all %d data files",
                            name, len(self.files))
        except (OSError, ValueError) as e:
            log.error("DISKQUEUE(%s) unreadable meta file %s (%s): reading all data files",
                      name, meta_path, e)

    def file_path(self, num: int) -> str:
        return os.path.join(self.data_path, f"{self.name}.diskqueue.{num:06d}.dat")

    @property
    def depth(self) -> int | None:
        """The depth nsqd recorded (None without a meta file)."""
        return self.meta.depth if self.meta else None

    def records(self) -> Iterator[bytes]:
        """Pending records (from the read position), oldest first."""
        start_file, start_pos = 0, 0
        if self.meta is not None:
            start_file, start_pos = self.meta.read_file, self.meta.read_pos
        for num in self.files:
            if num < start_file:
                continue
            yield from self._file_records(num, start_pos if num == start_file else 0)

    def messages(self) -> Iterator[NsqdMessage]:
        """Pending records decoded as nsqd messages."""
        for rec in self.records():
            yield decode_message(rec)

    def _file_records(self, num: int, pos: int) -> Iterator[bytes]:
        path = self.file_path(num)
        try:
            with open(path, "rb", buffering=1 << 20) as f:
                yield from self._parse(f, pos, path)
        except OSError as e:
            log.error("DISKQUEUE(%s) cannot read %s (%s): skipping the rest of it",
                      self.name, path, e)

    def _parse(self, f: BinaryIO, pos: int, path: str) -> Iterator[bytes]:
        size_total = os.fstat(f.fileno()).st_size
        if pos > size_total:
            log.error("DISKQUEUE(%s) read position %d beyond the end of %s (%d): "
                      "skipping it", self.name, pos, path, size_total)
            return
        f.seek(pos)
        while pos < size_total:
            head = f.read(4)
            if len(head) < 4:
                log.error("DISKQUEUE(%s) short read at %d of %s: skipping the rest",
                          self.name, pos, path)
                return
            (size,) = _SIZE.unpack(head)
            if size < MIN_MSG_SIZE or size > self.max_record:
                # matches go-diskqueue: no reasonable guarantee where the next record
                # begins, so the rest of the file is skipped
                log.error("DISKQUEUE(%s) invalid message size %d at %d of %s: skipping "
                          "the rest of the file", self.name, size, pos, path)
                return
            data = f.read(size)
            if len(data) < size:
                log.error("DISKQUEUE(%s) truncated record at %d of %s: skipping the rest",
                          self.name, pos, path)
                return
            pos += 4 + size
            yield data


@dataclass(slots=True)
class ImportedChannel:
    name: str
    paused: bool
    queue: GoDiskQueue


@dataclass(slots=True)
class ImportedTopic:
    name: str
    paused: bool
    queue: GoDiskQueue
    channels: list[ImportedChannel] = field(default_factory=list)


class NsqdDataDir:
    """An nsqd data directory opened for import (never modified).

    Args:
        path: nsqd's --data-path.
        max_msg_size: nsqd's --max-msg-size when the data was written.
        node_id: picks ``nsqd.<node_id>.dat`` when several old-style files exist.
    Attributes:
        metadata: topics and channels from the metadata file; if that is missing or
            damaged, derived from the disk queue files (all unpaused).
        metadata_file: the file used, or None.
        problems: what was wrong with the metadata, for the caller to report.
    """

    def __init__(self, path: str | os.PathLike[str], *,
                 max_msg_size: int = DEFAULT_MAX_MSG_SIZE, node_id: int | None = None) -> None:
        self.path = os.fspath(path)
        self.max_msg_size = max_msg_size
        self.problems: list[str] = []
        self._files: dict[str, list[int]] = {}
        for entry in os.listdir(self.path):
            if m := _DATA_RE.fullmatch(entry):
                self._files.setdefault(m.group(1), []).append(int(m.group(2)))
            elif m := _META_RE.fullmatch(entry):
                self._files.setdefault(m.group(1), [])
        self.metadata_file = self._pick_metadata_file(node_id)
        self.metadata = self._load_metadata()

    def _pick_metadata_file(self, node_id: int | None) -> str | None:
        new = os.path.join(self.path, "nsqd.dat")
        old = sorted((os.path.join(self.path, e) for e in os.listdir(self.path)
                      if _OLD_META_RE.fullmatch(e)), key=os.path.getmtime)
        if node_id is not None:
            wanted = os.path.join(self.path, f"nsqd.{node_id}.dat")
            old = [p for p in old if p == wanted] or old
        if os.path.exists(new):
            if old and _read(old[-1]) != _read(new):
                log.warning("%s and %s differ; using %s as nsqd >= 1.2 does",
                            new, old[-1], new)
            return new
        if len(old) > 1:
            log.warning("several old-style metadata files %s; using the newest, %s",
                        [os.path.basename(p) for p in old], old[-1])
        return old[-1] if old else None

    def _load_metadata(self) -> BrokerMetadata:
        if self.metadata_file is not None:
            try:
                return from_json(_read(self.metadata_file))
            except (OSError, MetadataFormatError) as e:
                self.problems.append(f"{self.metadata_file}: {e}")
                log.error("cannot use nsqd metadata %s (%s): deriving topics and "
                          "channels from the disk queue files", self.metadata_file, e)
        elif self._files:
            self.problems.append("no metadata file")
            log.warning("no nsqd metadata file in %s: deriving topics and channels "
                        "from the disk queue files", self.path)
        topics: dict[str, TopicMeta] = {}
        for qname in sorted(self._files):
            tname, _, cname = qname.partition(":")
            topic = topics.setdefault(tname, TopicMeta(tname))
            if cname:
                topic.channels.append(ChannelMeta(cname))
        return BrokerMetadata(list(topics.values()))

    def queue(self, name: str) -> GoDiskQueue:
        """The disk queue named ``topic`` or ``topic:channel`` (empty if absent)."""
        return GoDiskQueue(self.path, name, self._files.get(name, []), self.max_msg_size)

    def topics(self) -> Iterator[ImportedTopic]:
        """Each topic in the metadata with its channels, paused flags and queues."""
        for t in self.metadata.topics:
            yield ImportedTopic(t.name, t.paused, self.queue(t.name), [
                ImportedChannel(c.name, c.paused, self.queue(f"{t.name}:{c.name}"))
                for c in t.channels])

    def orphan_queues(self) -> list[str]:
        """Disk queues on disk whose topic/channel is not in the metadata (nsqd would
        leave them dormant until a topic/channel of that name is created)."""
        known = {t.name for t in self.metadata.topics}
        known.update(f"{t.name}:{c.name}" for t in self.metadata.topics for c in t.channels)
        return sorted(set(self._files) - known)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
