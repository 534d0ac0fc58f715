"""The two stream compressions nsqd negotiates, sans-IO, with an output budget.

snappy is the snappy *framing* format (go-nsq's and pynsq's), through cramjam; deflate is
raw DEFLATE (zlib, wbits -15) with a sync flush after every write, as Go's flate writer
is flushed by nsqd and go-nsq. ``compress`` takes one whole buffer (a flushed write).
No sockets, clocks or logging; shared by the server and the client library.

Reading: bytes in, bounded bytes out
------------------------------------
``feed(data)`` hands over compressed bytes; ``read(limit)`` returns at most ``limit``
decompressed bytes (b"": nothing more without new input); ``backlog`` says whether
``read`` has more to give without another ``feed``. A reader that feeds only when
``backlog`` is false, and hands each ``read`` to its consumer before the next, never holds
more than:

- deflate: the input of one ``feed`` (its unread part), zlib's 32 KiB window, and what
  one ``read`` returns (``limit``). A 16 KB bomb that inflates to 16 MiB costs
  ``limit`` bytes at a time, never 16 MiB (zlib's ``max_length`` and
  ``unconsumed_tail``).
- snappy: the input of one ``feed`` plus at most one partial chunk (a chunk is at most
  ``MAX_CHUNK`` = 76,494 bytes, the format's bound for 64 KiB of data, as Go's reader
  refuses longer ones before reading them), and one batch of decoded chunks (at most
  ``limit`` + 64 KiB), handed out ``limit`` bytes at a time.

The snappy stream is checked as the framing spec and golang/snappy's Reader do: the
stream identifier first, every chunk length bounded, reserved unskippable chunk types
(0x02-0x7f) refused, skippable ones (0x80-0xfe) skipped, a compressed chunk's decoded
length at most 64 KiB, and every data chunk's masked CRC-32C verified (cramjam's framed
decoder checks it, in Rust, on each batch). Errors are ``CorruptStream`` with Go's words
(``snappy: corrupt input``, ``snappy: unsupported input``, ``flate: corrupt input
before offset N``).
"""
from __future__ import annotations

import zlib

import cramjam

STREAM_ID = b"\xff\x06\x00\x00sNaPpY"
MAX_BLOCK = 65536                   # decoded bytes of one snappy chunk
MAX_CHUNK = 76490 + 4               # Go: MaxEncodedLen(MAX_BLOCK) + the checksum
_IN_STEP = 32 * 1024                # compressed bytes given to zlib per call
SNAPPY_CORRUPT = "snappy: corrupt input"
SNAPPY_UNSUPPORTED = "snappy: unsupported input"


class CorruptStream(ValueError):
    """The peer's compressed stream cannot be decoded (Go's error text)."""


class Snappy:
    """One direction pair of a snappy-framed stream."""

    name = "snappy"

    def __init__(self) -> None:
        self._in = b""       # framed bytes received; self._pos is the first not decoded
        self._pos = 0
        self._out = b""      # decoded bytes not handed out yet, from self._out_pos
        self._out_pos = 0
        self._started = False  # the stream identifier was seen

    def compress(self, data: bytes | bytearray) -> bytes:
        # every write starts with the stream identifier chunk: the format allows it
        # anywhere, and each write then decodes on its own
        return bytes(cramjam.snappy.compress(data))

    # -- reading ------------------------------------------------------------------------
    def feed(self, data: bytes) -> None:
        if self._pos:
            self._in = self._in[self._pos:] + data
            self._pos = 0
        else:
            self._in = self._in + data if self._in else data

    @property
    def backlog(self) -> bool:
        """``read`` has more to give (decoded bytes, or a whole chunk or a bad header)."""
        if self._out_pos < len(self._out):
            return True
        buf, i = self._in, self._pos
        if len(buf) - i < 4:
            return False
        size = buf[i + 1] | buf[i + 2] << 8 | buf[i + 3] << 16
        return len(buf) - i >= 4 + size or size > MAX_CHUNK or not self._started

    def buffered(self) -> int:
        """Bytes held: compressed input not decoded, decoded output not handed out."""
        return len(self._in) - self._pos + len(self._out) - self._out_pos

    def read(self, limit: int) -> bytes:
        """At most ``limit`` decoded bytes; b"" when no whole chunk is waiting."""
        while self._out_pos >= len(self._out):
            if not self.backlog:
                return b""
            self._out = self._decode_batch(limit)
            self._out_pos = 0
        out = self._out
        start = self._out_pos
        if start == 0 and len(out) <= limit:
            self._out = b""
            return out
        end = min(start + limit, len(out))
        self._out_pos = end
        if end == len(out):
            self._out, self._out_pos = b"", 0
        return out[start:end]

    def _decode_batch(self, limit: int) -> bytes:
        """Validate whole chunks from self._pos until they decode to ``limit`` bytes or
        more (or none is whole), and decode them in one call."""
        buf = self._in
        n = len(buf)
        start = i = self._pos
        total = 0
        data = False  # a data chunk is among them (its checksum must be checked)
        while n - i >= 4 and total < limit:
            kind = buf[i]
            size = buf[i + 1] | buf[i + 2] << 8 | buf[i + 3] << 16
            if not self._started:
                if kind != 0xFF:
                    raise CorruptStream(SNAPPY_CORRUPT)
                self._started = True
            if size > MAX_CHUNK:
                raise CorruptStream(SNAPPY_UNSUPPORTED)
            end = i + 4 + size
            if kind <= 0x01:  # compressed (0x00) or uncompressed (0x01) data
                if size < 4:
                    raise CorruptStream(SNAPPY_CORRUPT)
                if end > n:
                    break
                data = True
                if kind == 0x00:
                    total += _decoded_len(buf, i + 8, end)
                elif size - 4 > MAX_BLOCK:
                    raise CorruptStream(SNAPPY_CORRUPT)
                else:
                    total += size - 4
            elif kind == 0xFF:
                if size != 6:
                    raise CorruptStream(SNAPPY_CORRUPT)
                if end > n:
                    break
                if buf[i + 4:end] != b"sNaPpY":
                    raise CorruptStream(SNAPPY_CORRUPT)
            elif kind <= 0x7F:
                raise CorruptStream(SNAPPY_UNSUPPORTED)  # reserved unskippable
            elif end > n:  # padding (0xfe) or reserved skippable (0x80-0xfd)
                break
            i = end
        if i == start:
            return b""
        self._pos = i
        if i == n:
            self._in, self._pos = b"", 0
        batch = buf[start:i]
        if not data:
            return b""  # only identifiers, padding and skippable chunks
        if not batch.startswith(STREAM_ID):
            batch = STREAM_ID + batch
        try:
            return bytes(cramjam.snappy.decompress(batch))
        except Exception:  # cramjam's DecompressionError: bad checksum or block
            raise CorruptStream(SNAPPY_CORRUPT) from None

    def decompress(self, data: bytes) -> bytes:
        """Everything ``data`` completes, however large (the client library's reader;
        the broker reads through ``feed``/``read``)."""
        self.feed(data)
        parts = []
        while self.backlog:
            parts.append(self.read(1 << 20))
        return b"".join(parts)


def _decoded_len(buf: bytes, i: int, end: int) -> int:
    """The uvarint decoded length of a compressed chunk's block at buf[i:end]."""
    value = shift = 0
    while i < end and shift < 35:
        b = buf[i]
        value |= (b & 0x7F) << shift
        if b < 0x80:
            if value > MAX_BLOCK:
                raise CorruptStream(SNAPPY_CORRUPT)
            return value
        i += 1
        shift += 7
    raise CorruptStream(SNAPPY_CORRUPT)


class Deflate:
    """One direction pair of a raw DEFLATE stream at ``level``."""

    name = "deflate"

    def __init__(self, level: int) -> None:
        self.level = level
        self._zip = zlib.compressobj(level, zlib.DEFLATED, -15)
        self._unzip = zlib.decompressobj(-15)
        self._in = b""        # compressed input; self._pos is the first byte not consumed
        self._pos = 0
        self._more = False    # the last read filled its limit: zlib may hold more output
        self._consumed = 0    # compressed bytes consumed so far (for Go's error text)
        self.eof = False      # the peer ended the DEFLATE stream (a final block)

    def compress(self, data: bytes | bytearray) -> bytes:
        return bytes(self._zip.compress(data) + self._zip.flush(zlib.Z_SYNC_FLUSH))

    # -- reading ------------------------------------------------------------------------
    def feed(self, data: bytes) -> None:
        if self.eof:
            return
        if self._pos < len(self._in):
            self._in = self._in[self._pos:] + data
        else:
            self._in = data
        self._pos = 0

    @property
    def backlog(self) -> bool:
        return not self.eof and (self._pos < len(self._in) or self._more)

    def buffered(self) -> int:
        return len(self._in) - self._pos

    def read(self, limit: int) -> bytes:
        """At most ``limit`` inflated bytes; b"" when the input gave nothing more."""
        while self.backlog:
            pos = self._pos
            step = memoryview(self._in)[pos:pos + _IN_STEP]
            try:
                out = self._unzip.decompress(step, limit)
            except zlib.error:
                raise CorruptStream(
                    f"flate: corrupt input before offset {self._consumed}") from None
            used = len(step) - len(self._unzip.unconsumed_tail)
            step.release()
            self._consumed += used
            self._pos = pos + used
            if self._pos >= len(self._in):
                self._in, self._pos = b"", 0
            self._more = len(out) >= limit
            if self._unzip.eof:
                self.eof = True  # Go's flate reader then answers io.EOF: the stream ended
                self._in, self._pos, self._more = b"", 0, False
            if out:
                return bytes(out)
        return b""

    def decompress(self, data: bytes) -> bytes:
        """Everything ``data`` completes, however large (the client library's reader)."""
        self.feed(data)
        parts = []
        while self.backlog:
            parts.append(self.read(1 << 20))
        return b"".join(parts)
