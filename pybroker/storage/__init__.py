"""pybroker.storage: topic logs, broker metadata, the data-path lock, nsqd data import
and the reader of pybroker's earlier queue format (stdlib only).

Imports nothing from the rest of pybroker; the core reaches it through a Protocol.
"""
from .errors import (
    DiskFullError,
    MetadataError,
    StorageAccessError,
    StorageError,
    StorageIOError,
)

__all__ = [
    "DiskFullError",
    "MetadataError",
    "StorageAccessError",
    "StorageError",
    "StorageIOError",
]
