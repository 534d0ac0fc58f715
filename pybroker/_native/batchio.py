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

import array
import errno
import socket
from collections.abc import Sequence

from pybroker._native import BACKEND, _ffi, _lib

EAGAIN = errno.EAGAIN
_C = BACKEND == "c" and hasattr(_lib, "nsqf_send_many")


def _grow(a: "array.array[int]", n: int) -> None:
    if len(a) < n:
        a.extend([0] * (n - len(a)))


class BatchIO:
    """One loop's batched reads and writes (see the module)."""

    __slots__ = ("starts", "got", "sent")

    def __init__(self) -> None:
        self.starts = array.array("I")
        self.got = array.array("i")
        self.sent = array.array("i")

    def recv_many(self, socks: Sequence[socket.socket], fds: "array.array[int]",
                  buf: bytearray, piece: int) -> int:
        """Read each socket once (at most ``piece`` bytes) into ``buf``, packed from 0:
        socket i's bytes are ``buf[starts[i]:starts[i] + got[i]]`` (``got[i]`` <= 0: 0,
        the peer closed, or -errno). Stops before a socket whose piece could pass the end
        of ``buf``; returns how many were read."""
        n = len(socks)
        _grow(self.starts, n)
        _grow(self.got, n)
        if _C:
            with _ffi.from_buffer("int32_t[]", fds) as fp, \
                    _ffi.from_buffer("uint8_t[]", buf) as bp, \
                    _ffi.from_buffer("uint32_t[]", self.starts) as sp, \
                    _ffi.from_buffer("int32_t[]", self.got) as gp:
                return int(_lib.nsqf_recv_many(fp, n, bp, len(buf), piece, sp, gp))
        view = memoryview(buf)
        starts, got = self.starts, self.got
        pos = 0
        for i, sock in enumerate(socks):
            if piece > len(buf) - pos:
                return i
            starts[i] = pos
            try:
                k = sock.recv_into(view[pos:pos + piece])
            except OSError as e:
                got[i] = -(e.errno or errno.EIO)
                continue
            got[i] = k
            pos += k
        return n

    def send_many(self, socks: Sequence[socket.socket], fds: "array.array[int]",
                  data: bytes, starts: "array.array[int]", lens: "array.array[int]"
                  ) -> "array.array[int]":
        """Send socket i ``data[starts[i]:starts[i] + lens[i]]`` (one send each);
        ``sent[i]`` = bytes taken, or -errno."""
        n = len(socks)
        _grow(self.sent, n)
        sent = self.sent
        if _C:
            with _ffi.from_buffer("int32_t[]", fds) as fp, \
                    _ffi.from_buffer("uint8_t[]", data) as dp, \
                    _ffi.from_buffer("uint32_t[]", starts) as sp, \
                    _ffi.from_buffer("uint32_t[]", lens) as lp, \
                    _ffi.from_buffer("int32_t[]", sent) as op:
                _lib.nsqf_send_many(fp, n, dp, sp, lp, op)
            return sent
        view = memoryview(data)
        for i, sock in enumerate(socks):
            try:
                sent[i] = sock.send(view[starts[i]:starts[i] + lens[i]])
            except OSError as e:
                sent[i] = -(e.errno or errno.EIO)
        return sent


__all__ = ["EAGAIN", "BatchIO"]
