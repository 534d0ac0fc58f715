"""The stream decoders against their references, with their output budget (in-process).

Property: fed random, valid or mutated snappy-framed and raw-deflate streams in random
slices, read with a random budget, the decoders (pybroker.protocol.compression) either
produce exactly what the reference produces (python-snappy's StreamDecompressor, zlib)
or raise CorruptStream; no read returns more than its budget, and the bytes held stay
within the documented bound. Then the framing rules one by one, in Go's words.
"""
from __future__ import annotations

import zlib

import pytest
import snappy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pybroker.protocol.compression import (MAX_BLOCK, MAX_CHUNK, STREAM_ID, CorruptStream,
                                           Deflate, Snappy)

PROPS = settings(max_examples=300, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow])


def _chunk(kind: int, payload: bytes) -> bytes:
    return bytes([kind]) + len(payload).to_bytes(3, "little") + payload


def _drain(dec: Snappy | Deflate, stream: bytes, cuts: list[int], budget: int,
           bound: int) -> bytes:
    """Feed stream in the given slices (only when the decoder has no backlog, as the
    transport does) and read everything with ``budget``; check each bound."""
    out = []
    pos = 0
    points = sorted({c % (len(stream) + 1) for c in cuts} | {len(stream)})
    for end in points:
        dec.feed(stream[pos:end])
        pos = end
        while dec.backlog:
            piece = dec.read(budget)
            assert len(piece) <= budget
            assert dec.buffered() <= bound, (dec.buffered(), bound)
            out.append(piece)
    return b"".join(out)


def _reference_snappy(stream: bytes) -> bytes | None:
    try:
        return bytes(snappy.StreamDecompressor().decompress(stream))
    except Exception:
        return None


def _reference_deflate(stream: bytes) -> bytes | None:
    try:
        return zlib.decompressobj(-15).decompress(stream)
    except zlib.error:
        return None


def _mutate(data: bytes, edits: list[tuple[int, int]]) -> bytes:
    b = bytearray(data)
    for pos, value in edits:
        if b:
            b[pos % len(b)] = value
    return bytes(b)


payloads = st.lists(st.one_of(st.binary(max_size=3000),
                              st.builds(lambda b, n: b * n, st.binary(min_size=1, max_size=8),
                                        st.integers(1, 40000))),
                    min_size=1, max_size=5)
edits = st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), max_size=4)
cuts = st.lists(st.integers(0, 1 << 20), max_size=8)
budgets = st.sampled_from([1, 7, 100, 4096, 8192, 65536])


@PROPS
@given(payloads, edits, cuts, budgets)
def test_snappy_matches_reference_or_refuses(parts: list[bytes], muts: list[tuple[int, int]],
                                             slices: list[int], budget: int) -> None:
    stream = _mutate(b"".join(bytes(snappy.StreamCompressor().compress(p)) for p in parts), muts)
    # held: one slice of input (the whole stream at most) and one decoded batch
    bound = len(stream) + budget + MAX_BLOCK
    try:
        got = _drain(Snappy(), stream, slices, budget, bound)
    except CorruptStream as e:
        assert str(e) in ("snappy: corrupt input", "snappy: unsupported input")
        return
    want = _reference_snappy(stream)
    assert want is not None, "accepted what the reference refuses"
    # a stream cut inside a chunk: the reference decodes only whole chunks as well
    assert got == want
    if not muts:
        assert got == b"".join(parts)


@PROPS
@given(st.binary(max_size=4000), cuts, budgets)
def test_snappy_random_bytes(noise: bytes, slices: list[int], budget: int) -> None:
    stream = STREAM_ID + noise
    try:
        got = _drain(Snappy(), stream, slices, budget, len(stream) + budget + MAX_BLOCK)
    except CorruptStream:
        return
    assert got == _reference_snappy(stream)


@PROPS
@given(payloads, edits, cuts, budgets, st.integers(0, 9))
def test_deflate_matches_reference_or_refuses(parts: list[bytes], muts: list[tuple[int, int]],
                                              slices: list[int], budget: int,
                                              level: int) -> None:
    z = zlib.compressobj(level, zlib.DEFLATED, -15)
    stream = b"".join(z.compress(p) + z.flush(zlib.Z_SYNC_FLUSH) for p in parts)
    stream = _mutate(stream, muts)
    try:
        got = _drain(Deflate(6), stream, slices, budget, len(stream))
    except CorruptStream as e:
        assert str(e).startswith("flate: corrupt input before offset ")
        assert _reference_deflate(stream) is None or muts
        return
    want = _reference_deflate(stream)
    assert want is not None and got == want
    if not muts:
        assert got == b"".join(parts)


def test_deflate_bomb_is_read_a_budget_at_a_time() -> None:
    z = zlib.compressobj(9, zlib.DEFLATED, -15)
    bomb = b"".join(z.compress(b"NOP\n" * 65536) for _ in range(64)) + z.flush(zlib.Z_SYNC_FLUSH)
    assert len(bomb) < 20_000
    d = Deflate(6)
    d.feed(bomb)
    total = reads = 0
    while d.backlog:
        piece = d.read(8192)
        assert len(piece) <= 8192 and d.buffered() <= len(bomb)
        total += len(piece)
        reads += 1
    assert total == 16 << 20 and reads >= (16 << 20) // 8192


def test_deflate_end_of_stream_is_eof() -> None:
    z = zlib.compressobj(6, zlib.DEFLATED, -15)
    d = Deflate(6)
    d.feed(z.compress(b"NOP\n") + z.flush(zlib.Z_FINISH) + b"trailing")
    assert d.read(100) == b"NOP\n"
    assert d.eof and not d.backlog and d.read(100) == b""


# -- the framing rules, as golang/snappy's Reader applies them ------------------------------
def _read_all(stream: bytes) -> bytes:
    s = Snappy()
    s.feed(stream)
    out = []
    while s.backlog:
        out.append(s.read(65536))
    return b"".join(out)


def _data_chunk(data: bytes) -> bytes:
    framed = bytes(snappy.StreamCompressor().compress(data))
    return framed[len(STREAM_ID):]


@pytest.mark.parametrize("stream, error", [
    (_data_chunk(b"PUB t\n"), "snappy: corrupt input"),               # no stream identifier
    (b"\xff\x06\x00\x00sNaPpX", "snappy: corrupt input"),             # a wrong identifier
    (b"\xff\x07\x00\x00sNaPpY!", "snappy: corrupt input"),            # a wrong length
    (STREAM_ID + b"\x00\xff\xff\xff", "snappy: unsupported input"),   # 16 MiB announced
    (STREAM_ID + _chunk(0x00, b"\x00" * (MAX_CHUNK + 1)), "snappy: unsupported input"),
    (STREAM_ID + _chunk(0x02, b"x"), "snappy: unsupported input"),    # reserved unskippable
    (STREAM_ID + _chunk(0x7F, b""), "snappy: unsupported input"),
    (STREAM_ID + _chunk(0x00, b"abc"), "snappy: corrupt input"),      # shorter than a CRC
    (STREAM_ID + _chunk(0x01, b"\0\0\0\0" + b"x" * (MAX_BLOCK + 1)), "snappy: corrupt input"),
    (STREAM_ID + _chunk(0x00, b"\0\0\0\0\x81\x80\x04"), "snappy: corrupt input"),  # > 64 KiB
])
def test_snappy_refuses_as_go_does(stream: bytes, error: str) -> None:
    with pytest.raises(CorruptStream) as e:
        _read_all(stream)
    assert str(e.value) == error


def test_snappy_checksum_is_verified() -> None:
    good = bytearray(STREAM_ID + _data_chunk(b"PUB t\n" * 100))
    assert _read_all(bytes(good)) == b"PUB t\n" * 100
    good[len(STREAM_ID) + 4] ^= 1  # the masked CRC-32C
    with pytest.raises(CorruptStream):
        _read_all(bytes(good))


def test_snappy_skips_padding_and_skippable_chunks() -> None:
    stream = (STREAM_ID + _chunk(0xFE, b"\0" * 100) + _data_chunk(b"a" * 1000)
              + _chunk(0x80, b"skip me") + STREAM_ID + _data_chunk(b"b"))
    assert _read_all(stream) == b"a" * 1000 + b"b"


def test_snappy_waits_for_a_whole_chunk_and_holds_at_most_one() -> None:
    s = Snappy()
    chunk = _data_chunk(bytes(range(256)) * 200)
    s.feed(STREAM_ID + chunk[:-1])
    assert s.read(1 << 20) == b"" and not s.backlog
    assert s.buffered() <= MAX_CHUNK + 4
    s.feed(chunk[-1:])
    assert s.read(1 << 20) == bytes(range(256)) * 200
