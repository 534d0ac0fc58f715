"""Batched socket I/O: a loop turn's reads and writes of many plain sockets, one C call
each (``nsqf_recv_many`` / ``nsqf_send_many`` in csrc/nsqio.c, declared in
csrc/nsqframe.h), the GIL released for the call. With the pure-Python codec (or a
compiled module built before these functions existed) the same results come from a
loop of ``recv_into`` / ``send`` on the socket objects.

Why: with one small message per connection per turn (a consumer at RDY 1, a producer
waiting for each OK) a message's trip costs a system call each way, and the Python
call around each (argument parsing, a bytes or int object, the GIL let go and taken
back) was about as much again. Results are per socket, as the system calls give them:
bytes read or sent, 0 read (the peer closed), or ``-errno`` (``-EAGAIN``: not now).
Owned by one event loop (its scratch arrays are reused every call).
"""
from __future__ import annotations

import errno
import socket
from collections.abc import Sequence
from typing import Any

from pybroker._native import BACKEND, _ffi, _lib

EAGAIN = errno.EAGAIN
# below this many sockets a loop of Python calls costs less than setting up the C call
C_FROM = 8
CData = Any     # cffi's cdata (arrays and pointers): untyped, as _native's ffi and lib
_C = BACKEND == "c" and hasattr(_lib, "nsqf_send_many")


class BatchIO:
    """One loop's batched reads and writes (see the module). Its C arrays are made once
    (and grown when a call needs more), and the read buffer's address is kept while the
    same buffer is passed, so a call costs the system calls and little else."""

    __slots__ = ("_cap", "_fds", "_starts", "_lens", "_out", "_buf", "_bufp")

    def __init__(self) -> None:
        self._cap = 0
        self._fds: CData = None
        self._starts: CData = None
        self._lens: CData = None
        self._out: CData = None
        self._buf: bytearray | None = None
        self._bufp: CData = None

    def _room(self, n: int) -> None:
        if n > self._cap:
            self._cap = max(n, 2 * self._cap, 64)
            self._fds = _ffi.new("int32_t[]", self._cap)
            self._starts = _ffi.new("uint32_t[]", self._cap)
            self._lens = _ffi.new("uint32_t[]", self._cap)
            self._out = _ffi.new("int32_t[]", self._cap)

    def recv_many(self, socks: Sequence[socket.socket], fds: list[int], buf: bytearray,
                  piece: int) -> tuple[list[int], list[int]]:
        """Read each socket once (at most ``piece`` bytes) into ``buf``, packed from 0;
        returns (starts, got) for the sockets read: socket i's bytes are
        ``buf[starts[i]:starts[i] + got[i]]`` (``got[i]`` <= 0: 0, the peer closed, or
        -errno). Stops before a socket whose piece could pass the end of ``buf``. The
        buffer must not change size while this BatchIO reads into it."""
        n = len(socks)
        if _C and n >= C_FROM:
            self._room(n)
            if buf is not self._buf:
                self._buf, self._bufp = buf, _ffi.from_buffer("uint8_t[]", buf)
            self._fds[0:n] = fds
            k = _lib.nsqf_recv_many(self._fds, n, self._bufp, len(buf), piece,
                                    self._starts, self._out)
            return _ffi.unpack(self._starts, k), _ffi.unpack(self._out, k)
        view = memoryview(buf)
        starts: list[int] = []
        got: list[int] = []
        pos = 0
        for sock in socks:
            if piece > len(buf) - pos:
                break
            starts.append(pos)
            try:
                k = sock.recv_into(view[pos:pos + piece])
            except OSError as e:
                got.append(-(e.errno or errno.EIO))
                continue
            got.append(k)
            pos += k
        return starts, got

    def send_many(self, socks: Sequence[socket.socket], fds: list[int], data: bytes | bytearray,
                  lens: list[int]) -> list[int]:
        """Send socket i its ``lens[i]`` bytes of ``data`` (the sockets' bytes one after
        another, one send each); returns bytes each socket took, or -errno."""
        n = len(socks)
        if _C and n >= C_FROM:
            self._room(n)
            self._fds[0:n] = fds
            self._lens[0:n] = lens
            _lib.nsqf_send_many(self._fds, n, _ffi.from_buffer("uint8_t[]", data),
                                self._lens, self._out)
            out: list[int] = _ffi.unpack(self._out, n)
            return out
        view = memoryview(data)
        sent: list[int] = []
        at = 0
        for sock, ln in zip(socks, lens):
            try:
                sent.append(sock.send(view[at:at + ln]))
            except OSError as e:
                sent.append(-(e.errno or errno.EIO))
            at += ln
        return sent


_SENDER = _C and hasattr(_lib, "nsqf_sender_new")
# after a job the sender's thread looks for the next this long before it sleeps: longer
# than a loop turn at RDY 1 (about 150 us with 32 consumers), so that the next post
# finds it awake (waking a sleeping thread here cost the poster about 14 us, a futex
# wake-up of an idle core under KVM; docs/io.md)
SENDER_SPIN_NS = 200_000


class Sender:
    """``send_many`` on a thread of its own (``nsqf_sender_*``, csrc/nsqio.c), so a
    turn's writes take another core while the loop goes on: ``post`` hands the job over
    and returns, ``wait`` returns the bytes each socket took once it is done. Between
    the two the caller must write to none of those sockets and close none (their
    descriptors must stay theirs); the data is kept here until then. One job at a time,
    owned by one event loop. ``available()`` is False with the pure-Python codec (or
    when the thread could not be started): the caller writes the job itself."""

    __slots__ = ("_s", "_spin_ns", "_arrays", "_data", "_n")

    def __init__(self, spin_ns: int = SENDER_SPIN_NS) -> None:
        self._s: CData = None
        self._spin_ns = spin_ns
        self._arrays = BatchIO()     # its C arrays (BatchIO._room) carry the job
        self._data: CData = None     # the posted job's buffer, kept alive until wait
        self._n = 0

    @staticmethod
    def possible() -> bool:
        """Can a sender run here at all (the compiled codec, futex)? Starts nothing."""
        return bool(_SENDER)

    def available(self) -> bool:
        if self._s is None and _SENDER:
            s = _lib.nsqf_sender_new(self._spin_ns)
            if s != _ffi.NULL:
                self._s = s      # freed by close (the loop's, at its exit)
        return self._s is not None

    def post(self, fds: list[int], data: bytes | bytearray, lens: list[int]) -> None:
        """Send socket i its ``lens[i]`` bytes of ``data`` (one after another), on the
        sender's thread; ``available()`` must have said yes and no job be posted."""
        assert self._data is None, "a job is posted"
        n = len(fds)
        a = self._arrays
        a._room(n)
        a._fds[0:n] = fds
        a._lens[0:n] = lens
        self._data = _ffi.from_buffer("uint8_t[]", data)
        self._n = n
        _lib.nsqf_sender_post(self._s, a._fds, n, self._data, a._lens, a._out)

    def wait(self) -> list[int]:
        """The posted job's result, as ``BatchIO.send_many``'s (bytes each socket took,
        or -errno), once it is done."""
        assert self._data is not None, "no job is posted"
        _lib.nsqf_sender_wait(self._s)
        self._data = None
        out: list[int] = _ffi.unpack(self._arrays._out, self._n)
        return out

    def busy(self) -> bool:
        """Is the posted job still running (``wait`` would wait)?"""
        return self._data is not None and bool(_lib.nsqf_sender_busy(self._s))

    def close(self) -> None:
        """Stop the thread (after a posted job; its result is dropped)."""
        if self._s is not None:
            s, self._s = self._s, None
            _lib.nsqf_sender_free(s)
        self._data = None


__all__ = ["EAGAIN", "BatchIO", "Sender"]
