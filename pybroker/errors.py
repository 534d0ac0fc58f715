"""The error family: ClientError (an E_* code sent to one client) and BrokerError (domain).

core/ raises BrokerError subclasses and never sees an E_* code; protocol and server code
translate them into ClientError subclasses, whose ``fatal`` flag copies nsqd's: only
E_FIN_FAILED, E_REQ_FAILED and E_TOUCH_FAILED leave the connection open.
"""
from __future__ import annotations

from typing import ClassVar


_GO_ESCAPES = {"\a": "\\a", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r",
               "\t": "\\t", "\v": "\\v", '"': '\\"', "\\": "\\\\"}


def go_quote(value: bytes | str) -> str:
    """Go's ``%q`` of a string (strconv.Quote), as nsqd's error texts quote names:
    printable characters as they are, ``\\"``, ``\\\\`` and the ``\\n`` family escaped,
    other control characters as ``\\xNN``, other non-printable ones as ``\\uNNNN`` or
    ``\\UNNNNNNNN``, and each byte that is not part of valid UTF-8 as ``\\xNN``."""
    text = value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else value
    out = ['"']
    for ch in text:
        o = ord(ch)
        esc = _GO_ESCAPES.get(ch)
        if esc is not None:
            out.append(esc)
        elif 0xDC80 <= o <= 0xDCFF:          # a byte that was not UTF-8 (surrogateescape)
            out.append(f"\\x{o - 0xDC00:02x}")
        elif ch.isprintable():              # Go's IsPrint: L, M, N, P, S and the space
            out.append(ch)
        elif o < 0x20 or o == 0x7F:
            out.append(f"\\x{o:02x}")
        elif o < 0x10000:
            out.append(f"\\u{o:04x}")
        else:
            out.append(f"\\U{o:08x}")
    out.append('"')
    return "".join(out)


def raw_text(value: bytes) -> str:
    """Bytes a client sent, to be written back as they were in an error text (nsqd's
    ``%s``): ``ClientError.payload`` turns them back into the same bytes."""
    return value.decode("utf-8", "surrogateescape")


class ClientError(Exception):
    """An error answered to one client as an Error frame ``CODE description``."""

    code: ClassVar[bytes] = b"E_INVALID"
    fatal: ClassVar[bool] = True

    def payload(self) -> bytes:
        text = str(self)
        try:   # bytes carried by raw_text go back as they came
            body = text.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:
            body = text.encode("utf-8", "replace")
        return self.code + b" " + body


class BadProtocol(ClientError):
    code = b"E_BAD_PROTOCOL"


class Invalid(ClientError):
    code = b"E_INVALID"


class BadBody(ClientError):
    code = b"E_BAD_BODY"


class BadTopic(ClientError):
    code = b"E_BAD_TOPIC"


class BadChannel(ClientError):
    code = b"E_BAD_CHANNEL"


class BadMessage(ClientError):
    code = b"E_BAD_MESSAGE"


class IdentifyFailed(ClientError):
    code = b"E_IDENTIFY_FAILED"


class PubFailed(ClientError):
    code = b"E_PUB_FAILED"


class MpubFailed(ClientError):
    code = b"E_MPUB_FAILED"


class DpubFailed(ClientError):
    code = b"E_DPUB_FAILED"


class SubFailed(ClientError):
    code = b"E_SUB_FAILED"


class AuthDisabled(ClientError):
    code = b"E_AUTH_DISABLED"


class FinFailed(ClientError):
    code, fatal = b"E_FIN_FAILED", False


class ReqFailed(ClientError):
    code, fatal = b"E_REQ_FAILED", False


class TouchFailed(ClientError):
    code, fatal = b"E_TOUCH_FAILED", False


class BrokerError(Exception):
    """A domain error raised by core/; the message text is what nsqd would say."""


class NotInFlight(BrokerError):
    def __init__(self) -> None:
        super().__init__("ID not in flight")


class NotOwner(BrokerError):
    def __init__(self) -> None:
        super().__init__("client does not own message")


class Exiting(BrokerError):
    def __init__(self, what: str = "exiting") -> None:
        super().__init__(what)


class TopicNotFound(BrokerError):
    pass


class ChannelNotFound(BrokerError):
    pass


class TooManyConsumers(BrokerError):
    pass


class ConfigError(Exception):
    """A bad configuration value; the message names the key."""
