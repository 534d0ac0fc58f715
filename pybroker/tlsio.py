"""NonBlockingTls: an SSLSocket with a plain non-blocking socket's manners (stdlib only).

Shared by the client library's connections (pybroker/client/transport.py) and the HTTPS
server (pybroker/server/tls.py): ``recv``/``send`` raise BlockingIOError where an
SSLSocket would want to read or write, ``recv`` also returns every record already
decrypted (a selector cannot see those: the socket is not readable any more;
``recv_into`` fills a buffer the caller keeps and ``pending`` tells what is left), and a
TLS close_notify reads as the end of the stream. Owned by whichever thread owns the
connection.
"""
from __future__ import annotations

import ssl


class NonBlockingTls:
    def __init__(self, sock: ssl.SSLSocket) -> None:
        self.ssl = sock

    def fileno(self) -> int:
        return self.ssl.fileno()

    def recv(self, n: int) -> bytes:
        try:
            data = self.ssl.recv(n)
            while data and self.ssl.pending():
                data += self.ssl.recv(self.ssl.pending())
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            raise BlockingIOError() from None
        except ssl.SSLZeroReturnError:
            return b""
        return data

    def recv_into(self, buf: memoryview) -> int:
        """``recv`` into a buffer the caller keeps: records already decrypted are
        drained until buf is full (then ``pending`` says how many bytes still wait)."""
        try:
            n = self.ssl.recv_into(buf)
            while n and n < len(buf) and self.ssl.pending():
                n += self.ssl.recv_into(buf[n:])
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            raise BlockingIOError() from None
        except ssl.SSLZeroReturnError:
            return 0
        return n

    def pending(self) -> int:
        """Plaintext already decrypted and not yet received (the selector cannot see it)."""
        return self.ssl.pending()

    def send(self, data: bytes | bytearray | memoryview) -> int:
        try:
            return self.ssl.send(data)
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            raise BlockingIOError() from None

    def shutdown(self, how: int) -> None:
        self.ssl.shutdown(how)

    def close(self) -> None:
        self.ssl.close()
