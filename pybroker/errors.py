"""The error family: ClientError (an E_* code sent to one client) and BrokerError (domain).

core/ raises BrokerError subclasses and never sees an E_* code; protocol and server code
translate them into ClientError subclasses, whose ``fatal`` flag copies nsqd's: only
E_FIN_FAILED, E_REQ_FAILED and E_TOUCH_FAILED leave the connection open.
"""
from __future__ import annotations

from typing import ClassVar


class ClientError(Exception):
    """An error answered to one client as an Error frame ``CODE description``."""

    code: ClassVar[bytes] = b"E_INVALID"
    fatal: ClassVar[bool] = True

    def payload(self) -> bytes:
        return self.code + b" " + str(self).encode("utf-8", "replace")


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
