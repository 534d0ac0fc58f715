"""Wire constants of NSQ protocol V2: magic, frame types, canned responses."""
from __future__ import annotations

import enum

MAGIC_V2 = b"  V2"
MSG_ID_LENGTH = 16
MSG_HEADER_LENGTH = 26  # int64 timestamp + uint16 attempts + 16-byte id
# nsqd reads command lines through a 16 KiB bufio.Reader; a longer line cannot be read.
MAX_LINE = 16 * 1024


class FrameType(enum.IntEnum):
    RESPONSE = 0
    ERROR = 1
    MESSAGE = 2


class ClientState(enum.IntEnum):
    """Client states as /stats reports them (nsqd's stateInit .. stateClosing)."""

    INIT = 0
    DISCONNECTED = 1
    CONNECTED = 2
    SUBSCRIBED = 3
    CLOSING = 4


OK = b"OK"
CLOSE_WAIT = b"CLOSE_WAIT"
HEARTBEAT = b"_heartbeat_"
