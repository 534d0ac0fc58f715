"""Exceptions raised by the client (go-nsq's ErrNotConnected, ErrStopped, ErrProtocol...)."""
from __future__ import annotations


class NSQError(Exception):
    """Base class of every client error."""


class NotConnectedError(NSQError):
    """The connection is gone (or never came up); the command was not acknowledged."""


class StoppedError(NSQError):
    """The producer or consumer has been stopped."""


class IdentifyError(NSQError):
    """The server refused IDENTIFY (or the handshake broke)."""


class AuthError(NSQError):
    """The server requires AUTH and refused it (or no secret was configured)."""


class ProtocolError(NSQError):
    """The server answered with an error frame, e.g. ``E_BAD_TOPIC``.

    Attributes:
        code: the ``E_*`` code as text.
        description: the rest of the frame.
    """

    def __init__(self, data: bytes) -> None:
        text = data.decode("utf-8", "replace")
        code, _, desc = text.partition(" ")
        super().__init__(text)
        self.code = code
        self.description = desc

    @property
    def is_fatal(self) -> bool:
        """nsqd closes the connection after every error except these three."""
        return self.code not in ("E_FIN_FAILED", "E_REQ_FAILED", "E_TOUCH_FAILED")
