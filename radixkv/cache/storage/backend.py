"""The storage backend interface: a shared store of named byte strings, nothing more.

A backend knows nothing about KV, tokens or formats (page_format.py builds keys and objects;
page_store.py checks them). It must be usable from one thread at a time per instance (the
storage tier gives the reader and the writer one instance each, see ``clone``), may be shared
with other processes and machines, and may lose any object at any time (quota, TTL, another
process deleting it): a missing object is a miss, never an error.

Errors: anything that keeps an operation from completing (server down, timeout, disk full,
permission denied) raises StorageError, whose ``kind`` names the cause for logs and metrics.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

__all__ = ["StorageBackend", "StorageError"]


class StorageError(RuntimeError):
    """A storage operation failed (not a miss). ``kind``: "unreachable", "timeout",
    "disk_full", "permission", "io" or "config"."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class StorageBackend(ABC):
    """A key -> bytes store. Keys are short ASCII strings (hex digests)."""

    #: where the store is, for logs (no password)
    url: str = ""

    @abstractmethod
    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """The values of ``keys`` in order; None for each missing one."""

    @abstractmethod
    def put_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        """Store every ``(key, value)``; a value replaces any older one. Readers never see a
        partial value (a file backend writes a temp file and renames it)."""

    @abstractmethod
    def delete(self, keys: Sequence[str]) -> None:
        """Remove ``keys`` (missing ones are ignored)."""

    def clone(self) -> StorageBackend:
        """An instance on the same store for another thread (the default: ``self``, for
        backends whose methods are thread-safe)."""
        return self

    def close(self) -> None:  # noqa: B027 (optional hook: most backends hold nothing)
        """Release connections and files (idempotent)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"
