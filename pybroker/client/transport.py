"""The client's side of nsqd's negotiated upgrades: TLS, snappy and deflate.

``tls_context`` builds the context from go-nsq's tls_* options; ``TlsSocket`` gives a
connected SSLSocket plain-socket manners for the IOLoop (BlockingIOError instead of
SSLWantRead/WriteError; ``recv`` drains records already decrypted, which the selector
cannot see). Compression codecs are protocol.compression's, applied by Conn around its
socket reads and writes.
"""
from __future__ import annotations

import ssl
from pybroker.client.config import Config
from pybroker.tlsio import NonBlockingTls

_VERSIONS = {"tls1.0": ssl.TLSVersion.TLSv1, "tls1.1": ssl.TLSVersion.TLSv1_1,
             "tls1.2": ssl.TLSVersion.TLSv1_2, "tls1.3": ssl.TLSVersion.TLSv1_3}


def tls_context(config: Config) -> ssl.SSLContext:
    """go-nsq's tls_config: root CA file (else the system's), client certificate,
    insecure skip verify, minimum version."""
    ctx = ssl.create_default_context(cafile=config.tls_root_ca_file or None)
    if config.tls_min_version:
        ctx.minimum_version = _VERSIONS[config.tls_min_version.lower()]
    if config.tls_cert:
        ctx.load_cert_chain(config.tls_cert, config.tls_key)
    if config.tls_insecure_skip_verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


class TlsSocket(NonBlockingTls):
    """A connected SSLSocket with a plain socket's non-blocking manners (pybroker.tlsio),
    and the blocking calls Conn uses while connecting."""

    def setblocking(self, flag: bool) -> None:
        self.ssl.setblocking(flag)

    def settimeout(self, value: float | None) -> None:
        self.ssl.settimeout(value)

    def setsockopt(self, level: int, option: int, value: int | bytes) -> None:
        self.ssl.setsockopt(level, option, value)

    def sendall(self, data: bytes | bytearray | memoryview) -> None:
        self.ssl.sendall(data)
