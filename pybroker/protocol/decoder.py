"""CommandDecoder: incremental NSQ V2 command parser. Owns a buffer; performs no I/O.

``receive(data)`` appends bytes and finds every complete command with one call into the
frame scanner (C, or the pure-Python spec with PYBROKER_PURE=1); ``next_command()``
returns them in order. A command whose line is complete but whose body is not yet here is
returned once with ``pending=True`` so the handler can check state and parameters in
nsqd's order (nsqd validates the line before it reads the body). A body-size error is
attached to its command (``body_error``) and raised by the handler at the body step, again
in nsqd's order. Other framing errors are raised after the commands before them.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from pybroker import _native
from pybroker.errors import BadBody, BadMessage, ClientError, Invalid
from pybroker.protocol.wire import MAX_LINE


_HEX_LOWER = frozenset(b"0123456789abcdef")


def id_offset(mid: bytes) -> int:
    """The value of a 16-lowercase-hex-digit message id (a log offset, < 2**63), else -1."""
    if len(mid) != 16 or not _HEX_LOWER.issuperset(mid):
        return -1
    v = int(mid, 16)
    return v if v < 1 << 63 else -1


class Command:
    """One command: ``params`` as nsqd splits the line (params[0] is the verb).

    A batch of consecutive well-formed ``FIN <id>`` lines (the consumer's hot path) runs
    in order as one command with params [b"FIN"]: ``fin_offsets`` holds each id's value
    (``id_offset``) and ``fin_id(i)`` the id as sent.
    """

    __slots__ = ("params", "body", "pending", "body_error", "fin_offsets", "_fin_ids",
                 "_fin_raw")

    def __init__(self, params: list[bytes], body: bytes | None, pending: bool = False,
                 body_error: ClientError | None = None) -> None:
        self.params = params
        self.body = body
        self.pending = pending
        self.body_error = body_error
        self.fin_offsets: Sequence[int] | None = None
        self._fin_ids: list[bytes] | None = None
        self._fin_raw = b""

    @classmethod
    def fins(cls, offsets: Sequence[int], ids: list[bytes] | None = None,
             raw: bytes = b"") -> "Command":
        """A FIN batch: ids as a list, or raw 21-byte "FIN <id>\\n" lines."""
        cmd = cls([b"FIN"], None)
        cmd.fin_offsets = offsets
        cmd._fin_ids = ids
        cmd._fin_raw = raw
        return cmd

    def fin_id(self, i: int) -> bytes:
        """The id of FIN i of a batch, as the client sent it."""
        if self._fin_ids is not None:
            return self._fin_ids[i]
        return self._fin_raw[21 * i + 4:21 * i + 20]

    @property
    def verb(self) -> bytes:
        return self.params[0]

    def describe(self) -> str:
        """The command as nsqd's debug log prints it: ``[PUB events]``."""
        if self.fin_offsets is not None:
            n = len(self.fin_offsets)
            first = self.fin_id(0).decode("ascii", "replace") if n else ""
            return f"[FIN {first}]" + (f" and {n - 1} more FINs" if n > 1 else "")
        return "[" + " ".join(p.decode("utf-8", "replace") for p in self.params) + "]"

    def __repr__(self) -> str:
        extra = " pending" if self.pending else ""
        size = "" if self.body is None else f" +{len(self.body)}B"
        return f"Command({b' '.join(self.params)!r}{size}{extra})"


def size_error(verb: bytes, code: int, size: int, max_msg: int, max_body: int) -> ClientError:
    """nsqd's text for a body size that can never be valid."""
    v = verb.decode("ascii", "replace")
    if code == _native.E_MSG_SIZE:  # PUB, DPUB
        if size <= 0:
            return BadMessage(f"{v} invalid message body size {size}")
        return BadMessage(f"{v} message too big {size} > {max_msg}")
    if size <= 0:
        return BadBody(f"{v} invalid body size {size}")
    return BadBody(f"{v} body too big {size} > {max_body}")


def size_mismatch(detail: str) -> ClientError:
    """An MPUB body whose size and messages disagree: framed by its size here, read on
    past it by nsqd (so nsqd's answer depends on what follows: the one known difference
    of answers, docs/dropin.md)."""
    return BadBody(f"MPUB body size does not match its messages ({detail})")


def mpub_error(e: "_native.ScanError", max_msg: int) -> ClientError:
    """nsqd's answer to an MPUB body that does not parse (read as a stream, in order)."""
    code, i, v = e.code, e.index, e.value
    if code == _native.E_MPUB_COUNT_READ:
        return BadBody("MPUB failed to read message count")
    if code == _native.E_MPUB_COUNT:
        return BadBody(f"MPUB invalid message count {v}")
    if code == _native.E_MPUB_PART_READ:
        return BadMessage(f"MPUB failed to read message({i}) body size")
    if code == _native.E_MPUB_PART_SIZE:
        return BadMessage(f"MPUB invalid message({i}) body size {v}")
    if code == _native.E_MPUB_PART_BIG:
        return BadMessage(f"MPUB message too big {v} > {max_msg}")
    if code == _native.E_MPUB_PART_SHORT:
        return BadMessage("MPUB failed to read message body")
    return size_mismatch(f"{v} bytes left over")


def mpub_body_error(e: "_native.ScanError", max_msg: int, size: int) -> ClientError:
    """The answer to a whole MPUB body (``size`` bytes, as its header said) that does not
    parse: nsqd's, except where the body ends before its messages do. nsqd reads an
    MPUB's messages from the stream whatever the size said, on into the next command's
    bytes, so its answer then depends on what follows; pybroker frames the body by its
    size and says that the two disagree (E_BAD_BODY)."""
    code, i = e.code, e.index
    where = ("the message count" if code == _native.E_MPUB_COUNT_READ
             else f"message({i})'s size" if code == _native.E_MPUB_PART_READ
             else f"message({i})'s body" if code == _native.E_MPUB_PART_SHORT else "")
    if where:
        return size_mismatch(f"its {size} bytes end inside {where}")
    return mpub_error(e, max_msg)


# commands a call of ``receive`` or ``next_command`` parses at most; the rest of the
# complete ones wait as bytes (Connection._run's budget then bounds the parsing too)
PARSE_BATCH = 256

_SHORT_READ = {b"PUB": True, b"DPUB": True, b"IDENTIFY": False, b"AUTH": False,
               b"MPUB": False}   # verb -> is its body a message (E_BAD_MESSAGE)


class CommandDecoder:
    """Bytes in, Commands out. One per connection; never shared between threads."""

    def __init__(self, max_msg_size: int, max_body_size: int, max_line: int = MAX_LINE) -> None:
        self.max_msg_size = max_msg_size
        self.max_body_size = max_body_size
        self._scanner = _native.Scanner(max_line, max_msg_size, max_body_size)
        self._buf = b""
        self._chunks: list[bytes] = []  # bytes held back until a known body is complete
        self._held = 0
        self._need = 0  # total bytes the pending command needs; 0 if unknown
        self._ready: deque[Command] = deque()
        self._error: ClientError | None = None
        self._announced = False  # the pending command at _buf[0] was already returned
        self._failed = False  # a framing error was found: ignore everything after it
        # complete commands left unparsed in _buf (PARSE_BATCH): parsed by next_command
        self._more = False

    def receive(self, data: bytes) -> None:
        """Append bytes and parse complete commands, at most PARSE_BATCH of them (one
        scanner call); the rest are parsed as ``next_command`` takes these."""
        if self._failed:
            return
        if self._need:
            # a large body is arriving: hold chunks until it is whole (no O(n^2) joins)
            self._chunks.append(data)
            self._held += len(data)
            if len(self._buf) + self._held < self._need:
                return
            data = b"".join(self._chunks)
            self._chunks.clear()
            self._held = 0
            self._need = 0
        self._parse(self._buf + data if self._buf else data)

    def _parse(self, buf: bytes) -> None:
        self._more = False
        ready = self._ready
        if buf.startswith(b"FIN "):
            # a consumer's FINs: one C call turns the run into offsets
            offsets, n = self._scanner.fins(buf)
            if offsets:
                ready.append(Command.fins(offsets, raw=buf[:n]))
                buf = buf[n:]
                self._announced = False
                if not buf:
                    self._buf = b""
                    return
        spans, used, stop = self._scanner.scan(buf, PARSE_BATCH)
        fins: list[bytes] | None = None
        for line_off, line_len, body_off, body_len in spans:
            if line_len == 20 and buf.startswith(b"FIN ", line_off):
                mid = buf[line_off + 4:line_off + 20]
                if b" " not in mid:
                    if fins is None:
                        fins = [mid]
                    else:
                        fins.append(mid)
                    continue
            if fins is not None:
                ready.append(Command.fins([id_offset(m) for m in fins], fins))
                fins = None
            params = buf[line_off:line_off + line_len].split(b" ")
            ready.append(Command(params, buf[body_off:body_off + body_len] if body_off else None))
        if fins is not None:
            ready.append(Command.fins([id_offset(m) for m in fins], fins))
        if used:
            self._announced = False
        status, line_off, line_len, value = stop
        self._buf = buf[used:] if used < len(buf) else b""
        if status == _native.FULL:
            # enough for now: the rest stays bytes until these are taken (64 KB of
            # NOPs made 16,384 commands in one call, ~15 ms past any turn budget)
            self._more = True
        elif status == _native.NEED_MORE:
            if line_len and not self._announced:
                self._announced = True
                ready.append(Command(buf[line_off:line_off + line_len].split(b" "), None, True))
            if line_len:
                self._need = self._needed(self._buf)
        elif status == _native.E_LINE_TOO_LONG:
            self._error = Invalid("command line too long")
            self._failed = True
        else:
            params = buf[line_off:line_off + line_len].split(b" ")
            err = size_error(params[0], status, value, self.max_msg_size, self.max_body_size)
            ready.append(Command(params, None, False, err))
            self._error = err
            self._failed = True

    @staticmethod
    def _needed(buf: bytes) -> int:
        """Total bytes of a pending body command at buf[0], once its size is known."""
        nl = buf.find(b"\n")
        if nl < 0 or len(buf) < nl + 5:
            return 0
        size = int.from_bytes(buf[nl + 1:nl + 5], "big", signed=True)
        return nl + 5 + size if size > 0 else 0

    def next_command(self) -> Command | None:
        """The next command; None means "need more bytes". Raises a fatal ClientError
        for framing errors once the commands before them were returned."""
        if self._ready:
            return self._ready.popleft()
        if self._more:
            self._parse(self._buf)
            if self._ready:
                return self._ready.popleft()
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        return None

    def at_eof(self) -> ClientError | None:
        """The peer closed its side: nsqd's error for a command whose line was complete
        but whose body was cut short (nsqd reads bodies with io.ReadFull and answers a
        short read), else None (a cut line is dropped silently, as nsqd does)."""
        if self._failed or not self._announced or self._ready or self._more:
            return None
        data = self._buf + b"".join(self._chunks)
        nl = data.find(b"\n")
        if nl < 0:
            return None
        verb = data[:nl].rstrip(b"\r").split(b" ")[0]
        message = _SHORT_READ.get(verb)
        if message is None:
            return None
        v = verb.decode()
        rest = data[nl + 1:]
        if len(rest) < 4:
            if message:
                return BadMessage(f"{v} failed to read message body size")
            return BadBody(f"{v} failed to read body size")
        if verb == b"MPUB":
            # nsqd reads an MPUB body message by message: the first part it cannot read
            try:
                _native.mpub_parts(rest[4:], self.max_msg_size, (self.max_body_size - 4) // 5)
            except _native.ScanError as e:
                return mpub_error(e, self.max_msg_size)
            # the messages are all there, short of the size: nsqd would have taken them
            # and read on (see mpub_body_error)
            size = int.from_bytes(rest[:4], "big", signed=True)
            return size_mismatch(f"they end after {len(rest) - 4} of its {size} bytes")
        if message:
            return BadMessage(f"{v} failed to read message body")
        return BadBody(f"{v} failed to read body")

    def buffered(self) -> int:
        return len(self._buf) + self._held

    def ready(self) -> int:
        """Commands waiting for next_command: those parsed, plus one if complete ones
        wait unparsed (so at least this many; 0: none)."""
        return len(self._ready) + self._more

    def idle(self) -> bool:
        """Nothing buffered and no command waiting (not buffered() and not ready())."""
        return not (self._buf or self._held or self._ready)
