"""The two stream compressions nsqd negotiates, sans-IO: bytes in, bytes out.

snappy is the snappy *framing* format (go-nsq's and pynsq's), through cramjam; deflate is
raw DEFLATE (zlib, wbits -15) with a sync flush after every write, as Go's flate writer
is flushed by nsqd and go-nsq. ``compress`` takes one whole buffer (a flushed write),
``decompress`` any slice of the stream. No sockets; shared by the server and the client.
"""
from __future__ import annotations

import zlib
from typing import Any

import cramjam

_SNAPPY_HEADER = b"\xff\x06\x00\x00sNaPpY"


class CorruptStream(ValueError):
    """The peer's compressed stream cannot be decoded."""


class Snappy:
    """One direction pair of a snappy-framed stream."""

    name = "snappy"

    def __init__(self) -> None:
        self._buf = b""

    def compress(self, data: bytes) -> bytes:
        # every write starts with the stream identifier chunk: the format allows it
        # anywhere, and each write then decodes on its own
        return bytes(cramjam.snappy.compress(data))

    def decompress(self, data: bytes) -> bytes:
        """Whole chunks go to cramjam; a partial one waits for the rest."""
        buf = self._buf + data if self._buf else data
        end, n = 0, len(buf)
        while end + 4 <= n:  # walk the chunk headers only: [type][24-bit length]
            size = 4 + int.from_bytes(buf[end + 1:end + 4], "little")
            if end + size > n:
                break
            end += size
        self._buf = buf[end:]
        if not end:
            return b""
        chunks = buf[:end]
        if not chunks.startswith(_SNAPPY_HEADER):
            chunks = _SNAPPY_HEADER + chunks
        try:
            return bytes(cramjam.snappy.decompress(chunks))
        except Exception as e:  # cramjam raises its own DecompressionError
            raise CorruptStream(f"snappy: corrupt input ({e})") from None


class Deflate:
    """One direction pair of a raw DEFLATE stream at ``level``."""

    name = "deflate"

    def __init__(self, level: int) -> None:
        self.level = level
        self._zip: Any = zlib.compressobj(level, zlib.DEFLATED, -15)
        self._unzip: Any = zlib.decompressobj(-15)

    def compress(self, data: bytes) -> bytes:
        return bytes(self._zip.compress(data) + self._zip.flush(zlib.Z_SYNC_FLUSH))

    def decompress(self, data: bytes) -> bytes:
        try:
            return bytes(self._unzip.decompress(data))
        except zlib.error as e:
            raise CorruptStream(f"flate: corrupt input ({e})") from None
