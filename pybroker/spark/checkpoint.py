"""Read a Structured Streaming checkpoint to learn which of a run's offsets are committed.

Spark writes ``offsets/<batch>`` (the planned end offset of every source, one JSON line
each after a version line and a metadata line) before running a batch, and
``commits/<batch>`` after the sink has committed it. The newest batch present in both
is durably done. The stream source uses this where Spark does not call ``commit()``:
for the last batch before a stop, and while the topic is idle (Spark commits batch N
only when it plans batch N+1). Local paths and ``file:`` URIs only; no pyspark here.
"""
from __future__ import annotations

import json
import os
from urllib.parse import urlsplit


def local_path(location: str) -> str | None:
    """The local directory of a checkpoint location; None for a remote file system."""
    if not location:
        return None
    parts = urlsplit(location)
    if parts.scheme in ("", "file"):
        return parts.path if parts.scheme else location
    if len(parts.scheme) == 1:          # a Windows drive letter, not a scheme
        return location
    return None


def _batch_ids(directory: str) -> list[int]:
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(int(n) for n in names if n.isdigit())


def _committed_offsets(location: str) -> list[dict[str, object]]:
    """The source offsets (JSON objects) of the newest batch the checkpoint shows
    committed; [] if the checkpoint is remote, unreadable, or commits nothing."""
    root = local_path(location)
    if root is None:
        return []
    committed = _batch_ids(os.path.join(root, "commits"))
    if not committed:
        return []
    try:
        with open(os.path.join(root, "offsets", str(committed[-1])), encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines[2:]:               # version, metadata, then one line per source
        try:
            offset = json.loads(line)
        except ValueError:
            continue
        if isinstance(offset, dict):
            out.append(offset)
    return out


def committed_seq(location: str, run: str) -> int | None:
    """The highest ``seq`` of run ``run`` in a batch the checkpoint shows committed.

    Returns None if the checkpoint is remote, unreadable, or commits nothing of this run.
    Batches run one after another, and a run's batches follow the previous run's: if the
    newest committed batch is not this run's, nothing of this run is committed.
    """
    best: int | None = None
    for offset in _committed_offsets(location):
        if offset.get("run") == run:
            seq = offset.get("seq")
            if isinstance(seq, int) and (best is None or seq > best):
                best = seq
    return best


def committed_offset(location: str, topic: str) -> int | None:
    """The end offset of ``topic`` (the partitioned source's ``{"topic", "offset"}``) in
    the newest batch the checkpoint shows committed; None if unknown."""
    for offset in _committed_offsets(location):
        value = offset.get("offset")
        if offset.get("topic") == topic and isinstance(value, int) and "run" not in offset:
            return value
    return None
