"""CommandDecoder: commands out of bytes, fed whole, byte by byte and with trailing bytes.

Inputs are built by hand here (struct), never by pybroker's encoder. The C or the pure
scanner is used as PYBROKER_PURE says; CI runs this file both ways.
"""
from __future__ import annotations

import struct

import pytest

from pybroker.errors import BadBody, BadMessage, ClientError, Invalid
from pybroker.protocol.decoder import Command, CommandDecoder


def body(data: bytes) -> bytes:
    return struct.pack(">i", len(data)) + data


def mpub(*parts: bytes) -> bytes:
    inner = struct.pack(">i", len(parts)) + b"".join(body(p) for p in parts)
    return b"MPUB t\n" + body(inner)


STREAM = (b"NOP\n" + b"PUB t\n" + body(b"hello") + b"RDY 5\r\n" + b"FIN 0123456789abcdef\n"
          + mpub(b"a", b"bb") + b"DPUB t 100\n" + body(b"later") + b"IDENTIFY\n" + body(b"{}"))
EXPECT = [([b"NOP"], None), ([b"PUB", b"t"], b"hello"), ([b"RDY", b"5"], None),
          ([b"FIN", b"0123456789abcdef"], None),
          ([b"MPUB", b"t"], struct.pack(">i", 2) + body(b"a") + body(b"bb")),
          ([b"DPUB", b"t", b"100"], b"later"), ([b"IDENTIFY"], b"{}")]


def drain(d: CommandDecoder) -> list[Command]:
    out = []
    while (c := d.next_command()) is not None:
        out.append(c)
    return out


def complete(cmds: list[Command]) -> list[tuple[list[bytes], bytes | None]]:
    """Complete commands, with FIN batches spelled out one FIN per id."""
    out: list[tuple[list[bytes], bytes | None]] = []
    for c in cmds:
        if c.fin_offsets is not None:
            out.extend(([b"FIN", c.fin_id(i)], None) for i in range(len(c.fin_offsets)))
        elif not c.pending:
            out.append((c.params, c.body))
    return out


def test_whole() -> None:
    d = CommandDecoder(1024, 4096)
    d.receive(STREAM)
    assert complete(drain(d)) == EXPECT
    assert d.buffered() == 0


def test_byte_by_byte_gives_the_same_commands_and_announces_pending_once() -> None:
    d = CommandDecoder(1024, 4096)
    got: list[Command] = []
    for i in range(len(STREAM)):
        d.receive(STREAM[i:i + 1])
        got.extend(drain(d))
    assert complete(got) == EXPECT
    pending = [c.params for c in got if c.pending]
    # every body command's line is announced exactly once before its body is complete
    assert pending == [[b"PUB", b"t"], [b"MPUB", b"t"], [b"DPUB", b"t", b"100"], [b"IDENTIFY"]]


def test_idle_means_nothing_buffered_and_nothing_ready() -> None:
    """idle() (what the lanes ask) agrees with buffered() and ready() at every step."""
    d = CommandDecoder(1024, 4096)
    seen = []
    for i in range(len(STREAM)):
        d.receive(STREAM[i:i + 1])
        seen.append(d.idle())
        assert d.idle() == (not d.buffered() and not d.ready())
        while d.next_command() is not None:
            assert d.idle() == (not d.buffered() and not d.ready())
    assert d.idle() and not any(seen)    # a byte just received is never idle


def test_trailing_partial_command_is_kept() -> None:
    d = CommandDecoder(1024, 4096)
    d.receive(STREAM + b"PUB t\n" + struct.pack(">i", 10) + b"abc")
    cmds = drain(d)
    assert complete(cmds) == EXPECT
    assert cmds[-1].pending and cmds[-1].params == [b"PUB", b"t"]
    d.receive(b"defghij")
    assert complete(drain(d)) == [([b"PUB", b"t"], b"abcdefghij")]


def test_large_body_in_many_chunks() -> None:
    payload = bytes(range(256)) * 400
    data = b"PUB big\n" + body(payload)
    d = CommandDecoder(1 << 20, 1 << 21)
    got: list[Command] = []
    for i in range(0, len(data), 1000):
        d.receive(data[i:i + 1000])
        got.extend(drain(d))
    assert complete(got) == [([b"PUB", b"big"], payload)]


@pytest.mark.parametrize("data,exc,text", [
    (b"PUB t\n" + struct.pack(">i", 0), BadMessage, "PUB invalid message body size 0"),
    (b"PUB t\n" + struct.pack(">i", -3), BadMessage, "PUB invalid message body size -3"),
    (b"DPUB t 5\n" + struct.pack(">i", 2000), BadMessage, "DPUB message too big 2000 > 1024"),
    (b"MPUB t\n" + struct.pack(">i", 5000), BadBody, "MPUB body too big 5000 > 4096"),
    (b"IDENTIFY\n" + struct.pack(">i", 0), BadBody, "IDENTIFY invalid body size 0"),
    (b"AUTH\n" + struct.pack(">i", 9999), BadBody, "AUTH body too big 9999 > 4096"),
])
def test_size_errors_ride_on_their_command(data: bytes, exc: type[ClientError], text: str) -> None:
    d = CommandDecoder(1024, 4096)
    d.receive(b"NOP\n" + data + b"NOP\n")
    assert d.next_command().params == [b"NOP"]  # type: ignore[union-attr]
    cmd = d.next_command()
    assert cmd is not None and isinstance(cmd.body_error, exc)
    assert str(cmd.body_error) == text
    with pytest.raises(exc):
        d.next_command()
    d.receive(b"NOP\n")  # nothing after a framing error is parsed
    assert d.next_command() is None


def test_line_too_long_is_invalid_after_earlier_commands() -> None:
    d = CommandDecoder(1024, 4096, max_line=100)
    d.receive(b"NOP\n" + b"X" * 200)
    assert d.next_command().params == [b"NOP"]  # type: ignore[union-attr]
    with pytest.raises(Invalid):
        d.next_command()


def test_fin_ids_that_are_not_lowercase_hex_have_no_offset() -> None:
    d = CommandDecoder(1024, 4096)
    ids = [b"000000000000000a", b"000000000000000A", b"zzzzzzzzzzzzzzzz", b"ffffffffffffffff"]
    for start in (b"", b"NOP\n"):      # the fast path at the start, and after a command
        d.receive(start + b"".join(b"FIN " + i + b"\n" for i in ids))
        fins = [c for c in drain(d) if c.fin_offsets is not None]
        assert len(fins) == 1
        assert list(fins[0].fin_offsets or []) == [10, -1, -1, -1]
        assert [fins[0].fin_id(i) for i in range(4)] == ids


def test_params_split_like_nsqd() -> None:
    d = CommandDecoder(1024, 4096)
    d.receive(b"SUB  t c\n\n")
    assert [c.params for c in drain(d)] == [[b"SUB", b"", b"t", b"c"], [b""]]


def test_consecutive_fins_become_one_batch_in_order() -> None:
    d = CommandDecoder(1024, 4096)
    ids = [b"%016x" % i for i in range(5)]
    d.receive(b"".join(b"FIN " + i + b"\n" for i in ids[:3]) + b"NOP\n"
              + b"".join(b"FIN " + i + b"\n" for i in ids[3:]) + b"FIN short\n"
              + b"FIN 0123456 89abcdef\n")
    cmds = drain(d)

    def batch(c: Command) -> list[bytes] | None:
        if c.fin_offsets is None:
            return None
        assert list(c.fin_offsets) == [int(c.fin_id(i), 16) for i in range(len(c.fin_offsets))]
        return [c.fin_id(i) for i in range(len(c.fin_offsets))]

    assert [batch(c) for c in cmds[:3]] == [ids[:3], None, ids[3:]]
    # malformed FIN lines keep nsqd's parameter split (and so its errors)
    assert [c.params for c in cmds[3:]] == [[b"FIN", b"short"], [b"FIN", b"0123456", b"89abcdef"]]


def test_more_commands_than_a_batch_come_out_in_order() -> None:
    """receive parses PARSE_BATCH commands at most; the rest wait as bytes and are
    parsed as next_command takes them, the trailing partial one announced once."""
    from pybroker.protocol.decoder import PARSE_BATCH

    n = 3 * PARSE_BATCH + 7
    d = CommandDecoder(1024, 4096)
    d.receive(STREAM * n + b"PUB t\n" + struct.pack(">i", 10) + b"abc")
    assert d.ready() >= 1 and not d.idle()
    cmds = drain(d)
    assert complete(cmds) == EXPECT * n
    assert cmds[-1].pending and cmds[-1].params == [b"PUB", b"t"]
    assert [c.params for c in cmds if c.pending] == [[b"PUB", b"t"]]
    assert d.ready() == 0 and d.at_eof() is not None      # the cut PUB, at EOF
    d.receive(b"defghij")
    assert complete(drain(d)) == [([b"PUB", b"t"], b"abcdefghij")]
    assert d.idle()
