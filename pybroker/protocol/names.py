"""Topic and channel name rules (nsqd's IsValidTopicName / IsValidChannelName)."""
from __future__ import annotations

import re

_NAME_RE = re.compile(rb"^[.a-zA-Z0-9_-]+(#ephemeral)?$")
EPHEMERAL_SUFFIX = "#ephemeral"


def is_valid_name(name: bytes | str) -> bool:
    """True for 1..64 characters of [.a-zA-Z0-9_-], optionally ending in '#ephemeral'."""
    raw = name.encode() if isinstance(name, str) else name
    # fullmatch: "$" alone would also accept a trailing newline (Go's "$" does not)
    return 0 < len(raw) <= 64 and _NAME_RE.fullmatch(raw) is not None


def is_ephemeral(name: str) -> bool:
    return name.endswith(EPHEMERAL_SUFFIX)
