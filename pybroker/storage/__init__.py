"""pybroker.storage: disk queues, broker metadata, nsqd data import (stdlib only).

Imports nothing from the rest of pybroker; the core reaches it through a Protocol.
"""
from .backend import Backend, NullBackend
from .diskqueue import DiskQueue, list_queues
from .errors import (
    DiskFullError,
    MetadataError,
    QueueClosedError,
    StorageAccessError,
    StorageError,
    StorageIOError,
    UnsupportedFormatError,
)

__all__ = [
    "Backend",
    "DiskFullError",
    "DiskQueue",
    "MetadataError",
    "NullBackend",
    "QueueClosedError",
    "StorageAccessError",
    "StorageError",
    "StorageIOError",
    "UnsupportedFormatError",
    "list_queues",
]
