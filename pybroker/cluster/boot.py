"""Did this node's machine restart since its last run? (memory durability)

In ``--durability=memory`` a record is acknowledged once the in-sync nodes have written
it, not synced it: a process that dies keeps every such record (the kernel has them),
but a machine that loses power loses the ones still in its page cache, while the
files that say which topics it holds (``.inc``) may survive. Such a node, back within
the lag window, would still be counted in sync and could be elected with a log that
lacks acknowledged records (docs/replication.md, "A replica back with an empty disk").

So a node keeps the kernel's boot id of its last run in ``<data-path>/cluster/boot``
(written and synced at each start). When it differs from this boot's, the node's copies
are not vouched for as they are after a process crash: each leaves the in-sync set and
catches up first (pybroker.cluster.coordinator). A clean stop, once its logs are
synced, marks the file ``clean`` (``stopped_cleanly``): a planned reboot loses
nothing, and its copies count at once. In fsync mode what a node acknowledged was synced, so a
restart of its machine changes nothing.

``PYBROKER_BOOT_ID`` (a test facility, said in the log) stands for the kernel's boot id.
"""
from __future__ import annotations

import logging
import os

from pybroker.storage._fsutil import atomic_write

log = logging.getLogger("pybroker")
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
ENV = "PYBROKER_BOOT_ID"
MAX_BYTES = 256       # a boot id is 36 characters; a longer file is not one
CLEAN = " clean"      # after the boot id: the run that wrote it stopped cleanly


def boot_id() -> str:
    """This boot's id ("" where the kernel does not say)."""
    fake = os.environ.get(ENV, "").strip()
    if fake:
        log.warning("CLUSTER: boot id from %s (a test facility): %s", ENV, fake)
        return fake
    try:
        with open(BOOT_ID_PATH) as f:
            return f.read(MAX_BYTES).strip()
    except OSError:
        return ""


def same_boot(directory: str) -> bool:
    """Read what the node's last run wrote in ``directory`` and write this boot's id
    (synced); True unless that run neither stopped cleanly nor ran on this boot (no
    file: a first run, or a data path from before this file; unreadable: said in the
    log, taken as a restart). Raises OSError if this boot's id cannot be written."""
    now = boot_id()
    path = os.path.join(directory, "boot")
    before: str | None
    try:
        with open(path) as f:
            before = f.read(MAX_BYTES).strip()
    except FileNotFoundError:
        before = None
    except OSError as e:
        log.error("CLUSTER: reading %s failed (%s): taken as a restart of the machine",
                  path, e)
        before = "?"
    clean = before is not None and before.endswith(CLEAN)
    if now and before != now:
        _write(directory, now)
    return before is None or clean or not now or before == now


def stopped_cleanly(directory: str) -> None:
    """The node stopped cleanly, its logs written and synced (``Storage.persist``):
    mark its boot file ``clean``, so that the next run trusts its copies whatever the
    boot. Raises OSError if it cannot be written."""
    _write(directory, boot_id() + CLEAN)


def _write(directory: str, text: str) -> None:
    os.makedirs(directory, exist_ok=True)
    atomic_write(os.path.join(directory, "boot"), text.encode() + b"\n")


__all__ = ["CLEAN", "ENV", "boot_id", "same_boot", "stopped_cleanly"]
