"""The switch of a client's transport after IDENTIFY: TLS, then snappy or deflate.

As nsqd's IDENTIFY does it (client_v2.go UpgradeTLS, UpgradeSnappy, UpgradeDeflate):
the IDENTIFY answer goes out in plaintext, then the TLS handshake and ``OK`` over TLS,
then ``OK`` compressed. The handshake has nsqd's 5 s deadline; a stalled or failed one
gets nsqd's plaintext ``E_IDENTIFY_FAILED`` and closes that connection only.

Handshake slots: each loop runs at most ``MAX_HANDSHAKES`` unfinished handshakes; a
client past that waits, its socket unread (its ClientHello stays in the kernel), for a
slot, within the same deadline. So stalled handshakes cost a socket each, not an SSL
object with its buffers. Owned by the client's loop thread.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from pybroker.protocol.encoder import OK_FRAME, encode_error
from pybroker.server.transport import HandshakeSlots, Transport, TransportError

if TYPE_CHECKING:
    import ssl

    from pybroker.server.ports import Conn, Loop

log = logging.getLogger("pybroker")
HANDSHAKE_TIMEOUT_NS = 5_000_000_000  # matches nsqd's 5 s deadline in UpgradeTLS
MAX_HANDSHAKES = 64                   # unfinished TLS handshakes per loop


_SLOTS: dict[Loop, HandshakeSlots] = {}  # per loop; each entry touched by its loop only


def _slots_of(loop: Loop) -> HandshakeSlots:
    slots = _SLOTS.get(loop)
    if slots is None:
        slots = _SLOTS[loop] = HandshakeSlots()
    return slots


def release_slot(c: Conn) -> None:
    """c's handshake finished, failed or its connection closed: give its slot to the
    next waiting client (on c's loop)."""
    t: Transport = c.transport
    slots, t.slot = t.slot, None
    if slots is None:
        return
    slots.running -= 1
    now = time.monotonic_ns()
    while slots.waiting and slots.running < MAX_HANDSHAKES:
        nc, begin = slots.waiting.popleft()
        if nc.closed or now >= nc.transport.handshake_deadline_ns:
            continue  # gone, or about to fail at its deadline (this very turn)
        slots.running += 1
        nc.transport.slot = slots
        nc.transport.tls_queued = False
        begin()
        nc.release_input()


def upgrade(c: Conn, ctx: ssl.SSLContext | None, snappy: bool, deflate_level: int) -> None:
    """Switch a client's transport after its IDENTIFY answer, as nsqd's IDENTIFY does.

    The answer already queued on ``c`` goes out in plaintext; then the TLS handshake (if
    ctx) and ``OK`` over TLS; then snappy or deflate (level > 0) and ``OK`` compressed.
    The client reads no further commands until every upgrade is in place. The handshake
    has nsqd's deadline from here, waiting for a slot (MAX_HANDSHAKES) included.
    """
    t: Transport = c.transport
    t.send(c.out)
    c.out = []
    c.out_bytes = 0
    c.loop.to_flush[c] = None

    def finish() -> None:
        if ctx is not None:
            c.loop.cancel(timer)
            release_slot(c)
            log.info("[%s] TLS handshake done (%s %s)", c, t.tls_stats.get("tls_version"),
                     t.tls_stats.get("tls_cipher_suite"))
            t.send([OK_FRAME])
            c.session.tls = True
        if snappy:
            log.info("PROTOCOL(V2): [%s] upgrading connection to snappy", c)
            t.start_snappy()
            t.send([OK_FRAME])
        elif deflate_level:
            log.info("PROTOCOL(V2): [%s] upgrading connection to deflate (level %d)", c,
                     deflate_level)
            t.start_deflate(deflate_level)
            t.send([OK_FRAME])
        c.session.release()
        c.loop.to_flush[c] = None
        if not c.closed:
            c.process()

    c.session.hold()
    if ctx is None:
        finish()
        return
    log.info("PROTOCOL(V2): [%s] upgrading connection to TLS", c)

    def stalled() -> None:
        if (t.handshaking or t.tls_queued) and not c.closed:
            try:
                local = "%s:%s" % c.sock.getsockname()[:2]
            except OSError:
                local = "?"
            handshake_failed(c, TransportError(f"read tcp {local}->{c.remote_address}: "
                                               "i/o timeout"))

    timer = c.loop.call_later(HANDSHAKE_TIMEOUT_NS, stalled)
    t.handshake_deadline_ns = time.monotonic_ns() + HANDSHAKE_TIMEOUT_NS
    slots = _slots_of(c.loop)
    if slots.running < MAX_HANDSHAKES:
        slots.running += 1
        t.slot = slots
        t.start_tls(ctx, finish)
        return
    # no slot: its ClientHello stays in the socket until one frees up
    t.tls_queued = True
    c.hold_input()
    slots.waiting.append((c, lambda: t.start_tls(ctx, finish)))


# OpenSSL's reasons for common handshake failures, in the words of Go's crypto/tls
_GO_TLS_ERRORS = {
    "PEER_DID_NOT_RETURN_A_CERTIFICATE": "tls: client didn't provide a certificate",
    "CERTIFICATE_VERIFY_FAILED":
        "tls: failed to verify certificate: x509: certificate signed by unknown authority",
    "WRONG_VERSION_NUMBER": "tls: first record does not look like a TLS handshake",
    "HTTP_REQUEST": "tls: first record does not look like a TLS handshake",
    "UNSUPPORTED_PROTOCOL": "tls: client offered only unsupported versions",
}


def handshake_failed(c: Conn, err: OSError) -> None:
    """nsqd answers a failed handshake with a plaintext E_IDENTIFY_FAILED, then closes."""
    t: Transport = c.transport
    text = str(err)
    reason = text[5:] if text.startswith("tls: ") else text
    text = _GO_TLS_ERRORS.get(reason, text)
    payload = f"E_IDENTIFY_FAILED IDENTIFY failed {text}".encode()
    log.error("[%s] - %s", c, payload.decode())
    t.tls_queued = False
    t._ssl = None  # the frame goes out as nsqd's does: on the raw socket, after the alert
    t.handshaking = False
    t.send([encode_error(payload)])
    c.close("TLS handshake failed")
