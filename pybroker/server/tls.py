"""TLS settings as nsqd builds them (nsqd.go buildTLSConfig) and TLS facts for /stats.

Owns no socket: it turns Options into an ``ssl.SSLContext`` shared by the TCP transports
and the HTTPS listener, and describes a finished handshake the way nsqd's
``prettyConnectionState`` does. Imports only the stdlib and config.
"""
from __future__ import annotations

import os
import socket
import ssl

from pybroker.config import Options
from pybroker.errors import ConfigError
from pybroker.tlsio import NonBlockingTls

_MIN_VERSIONS = {"tls1.0": ssl.TLSVersion.TLSv1, "tls1.1": ssl.TLSVersion.TLSv1_1,
                 "tls1.2": ssl.TLSVersion.TLSv1_2, "tls1.3": ssl.TLSVersion.TLSv1_3}
# nsqd 1.3.0 names only these suites in /stats ("Unknown <id>" otherwise, TLS 1.3 too)
_GO_SUITES = {
    0x0005: "TLS_RSA_WITH_RC4_128_SHA", 0x000A: "TLS_RSA_WITH_3DES_EDE_CBC_SHA",
    0x002F: "TLS_RSA_WITH_AES_128_CBC_SHA", 0x0035: "TLS_RSA_WITH_AES_256_CBC_SHA",
    0xC007: "TLS_ECDHE_ECDSA_WITH_RC4_128_SHA", 0xC009: "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA",
    0xC00A: "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA", 0xC011: "TLS_ECDHE_RSA_WITH_RC4_128_SHA",
    0xC012: "TLS_ECDHE_RSA_WITH_3DES_EDE_CBC_SHA", 0xC013: "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA",
    0xC014: "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA", 0xC02F: "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256",
    0xC02B: "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256",
}
_HTTP_ON_HTTPS = b"HTTP/1.0 400 Bad Request\r\n\r\nClient sent an HTTP request to an HTTPS server.\n"
_GO_VERSIONS = {"TLSv1": "TLS1.0", "TLSv1.1": "TLS1.1", "TLSv1.2": "TLS1.2", "TLSv1.3": "TLS1.3"}


def server_context(o: Options) -> ssl.SSLContext | None:
    """The server context for tls_cert/tls_key, or None when TLS is not configured.

    Matches nsqd: no policy asks for no client certificate; ``require`` and
    ``require-verify`` both demand one. Raises ConfigError naming the bad file.
    """
    if not o.tls_cert and not o.tls_key:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = _MIN_VERSIONS.get(o.tls_min_version, ssl.TLSVersion.TLSv1)
    if ctx.minimum_version < ssl.TLSVersion.TLSv1_2:
        # OpenSSL's default security level refuses TLS 1.0/1.1 even when allowed
        ctx.set_ciphers("DEFAULT:@SECLEVEL=0")
    try:
        ctx.load_cert_chain(o.tls_cert, o.tls_key)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"tls_cert: failed to build TLS config - {e}") from None
    if o.tls_client_auth_policy:
        # Go's RequireAnyClientCert takes any certificate; OpenSSL verifies what it asks
        # for, so "require" checks the chain against tls_root_ca_file (or the system CAs)
        ctx.verify_mode = ssl.CERT_REQUIRED
        if not o.tls_root_ca_file:
            ctx.load_default_certs(ssl.Purpose.CLIENT_AUTH)
    if o.tls_root_ca_file:
        try:
            ctx.load_verify_locations(cafile=o.tls_root_ca_file)
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(f"tls_root_ca_file: failed to build TLS config - {e}") from None
    return ctx


def _suite_ids() -> dict[str, int]:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.set_ciphers("ALL:@SECLEVEL=0")
    except ssl.SSLError:
        pass
    return {c["name"]: c["id"] & 0xFFFF for c in ctx.get_ciphers()}


_SUITE_IDS = _suite_ids()


def describe(obj: ssl.SSLObject | ssl.SSLSocket) -> dict[str, object]:
    """The /stats TLS fields of a finished handshake, spelled as nsqd 1.3.0 spells them."""
    cipher = obj.cipher()
    name = cipher[0] if cipher else ""
    suite = _SUITE_IDS.get(name, 0)
    version = obj.version() or ""
    return {
        "tls": True,
        "tls_cipher_suite": _GO_SUITES.get(suite, f"Unknown {suite}"),
        "tls_version": _GO_VERSIONS.get(version, f"Unknown {version}"),
        "tls_negotiated_protocol": obj.selected_alpn_protocol() or "",
        # Go (since 1.16) always reports the negotiated protocol as mutual
        "tls_negotiated_protocol_is_mutual": True,
    }


def peer_common_name(obj: ssl.SSLObject | ssl.SSLSocket) -> str:
    """The common name of the client certificate, as nsqd passes it to the auth server."""
    try:
        cert = obj.getpeercert()
    except (ValueError, ssl.SSLError):
        return ""
    if not cert:
        return ""
    subject = cert.get("subject", ())
    for rdn in subject if isinstance(subject, tuple) else ():
        for pair in rdn:
            if pair[0] == "commonName":
                return str(pair[1])
    return ""


class TlsSocket(NonBlockingTls):
    """A non-blocking server-side TLS socket with plain-socket manners, for HTTPS.

    ``recv``/``send`` raise BlockingIOError where an SSLSocket would want to read or
    write (the handshake runs inside them, driven by the selector loop), ``recv``
    returns every record already decrypted (the selector cannot see those), and the
    handshake's failure is an OSError that closes this connection only.
    Owned by the HTTP thread.
    """

    def __init__(self, ctx: ssl.SSLContext, sock: socket.socket) -> None:
        super().__init__(ctx.wrap_socket(sock, server_side=True,
                                         do_handshake_on_connect=False))
        self.done = False

    def _handshake(self) -> None:
        try:
            self.ssl.do_handshake()
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            raise BlockingIOError() from None
        except ssl.SSLError as e:
            if e.reason == "HTTP_REQUEST":
                # matches Go's net/http: plain HTTP on the HTTPS port gets a plain 400
                fd = self.ssl.fileno()
                try:
                    os.write(fd, _HTTP_ON_HTTPS)
                    while os.read(fd, 65536):  # unread request bytes would make the
                        pass                   # close a reset that loses the answer
                except OSError:
                    pass
            raise
        self.done = True

    def recv(self, n: int) -> bytes:
        if not self.done:
            self._handshake()
        return super().recv(n)

    def recv_into(self, buf: memoryview) -> int:
        if not self.done:
            self._handshake()
        return super().recv_into(buf)

    def send(self, data: bytes | bytearray | memoryview) -> int:
        if not self.done:
            self._handshake()
        return super().send(data)
