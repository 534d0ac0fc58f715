"""Frames -> bytes. Message frames come from the topic log's records (storage.topiclog,
built by the C codec in one call per batch)."""
from __future__ import annotations

import struct

from pybroker.protocol.wire import CLOSE_WAIT, HEARTBEAT, OK, FrameType

__all__ = ["encode_frame", "encode_response", "encode_error", "ok_frames",
           "OK_FRAME", "HEARTBEAT_FRAME", "CLOSE_WAIT_FRAME"]

_HEAD = struct.Struct(">ii")


def encode_frame(frame_type: int, data: bytes) -> bytes:
    """[int32 size = len(data) + 4][int32 frame type][data]."""
    return _HEAD.pack(len(data) + 4, frame_type) + data


def encode_response(data: bytes) -> bytes:
    return encode_frame(FrameType.RESPONSE, data)


def encode_error(payload: bytes) -> bytes:
    """An Error frame; payload is ``CODE description``."""
    return encode_frame(FrameType.ERROR, payload)


OK_FRAME = encode_response(OK)
HEARTBEAT_FRAME = encode_response(HEARTBEAT)
CLOSE_WAIT_FRAME = encode_response(CLOSE_WAIT)


def ok_frames(n: int) -> bytes:
    """The answers to n commands that each succeed: n OK frames."""
    return OK_FRAME if n == 1 else OK_FRAME * n
