"""PageStore: KV pages in a storage backend, looked up by prefix and checked on the way back.

It turns "pages ``start..stop`` of this token sequence under this namespace" into keys and
objects (page_format.py) and back: ``fetch`` reads a run of pages in chain order and stops at
the first page that is missing, corrupt or forged (its MAC is not the deployment secret's:
deleted, so nobody reads it again), or not the one asked for (a key collision, or another
format); ``store`` writes a run.

Healing. The shared ``KnownKeys`` lets the writer skip pages already stored, so it must not
outlive the data: when a lookup misses a page believed stored, the backend lost data (a
restart, eviction, a flush) and every later page of that lookup is forgotten too (a chain
lookup never reads past its first miss, so it cannot tell which of them survived), so the
next request that computes the prefix writes it back whole, not one page per request. The payloads are plain
bytes (the kv layer turns host pages into bytes and back), so this stays torch-free.

Not thread-safe: the storage tier gives each of its threads its own PageStore (over
``backend.clone()``), sharing one ``KnownKeys`` so that the writer skips pages the reader just
found in storage or the writer already wrote.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any

from radixkv.cache.storage.backend import StorageBackend
from radixkv.cache.storage.page_format import (
    FormatMismatch,
    ObjectCorrupt,
    decode_page,
    encode_page,
    page_keys,
    prefix_digests,
)

__all__ = ["KnownKeys", "PageStore"]

_FETCH_BATCH = 8  # pages per backend call: a miss early in a long run wastes little


class KnownKeys:
    """A bounded, thread-safe set of keys known to be in storage (recently read or written)."""

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, keys: list[str]) -> None:
        with self._lock:
            for k in keys:
                self._keys[k] = None
                self._keys.move_to_end(k)
            while len(self._keys) > self.capacity:
                self._keys.popitem(last=False)

    def discard(self, key: str) -> None:
        with self._lock:
            self._keys.pop(key, None)

    def discard_many(self, keys: list[str]) -> None:
        with self._lock:
            for k in keys:
                self._keys.pop(k, None)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._keys


class PageStore:
    """Runs of KV pages of one format in ``backend``.

    Args:
        backend: where the objects live.
        format_id: the KV format's identity (page_format.kv_format_id).
        page_size: tokens per page.
        payload_bytes: bytes of one page's K/V (an object of another size is not ours).
        known: keys known to be stored (shared between a reader and a writer).
        secret: the deployment's storage secret (secret.load_storage_secret): objects are
            MAC'd with it; one that fails is corrupt (counted, deleted, a miss).
    """

    def __init__(
        self,
        backend: StorageBackend,
        format_id: bytes,
        page_size: int,
        payload_bytes: int,
        known: KnownKeys | None = None,
        *,
        secret: bytes,
    ) -> None:
        if not isinstance(secret, bytes) or len(secret) < 16:
            raise ValueError("the storage secret must be at least 16 bytes")
        self.backend = backend
        self._secret = secret
        self.format_id = format_id
        self.page_size = page_size
        self.payload_bytes = payload_bytes
        self.known = known if known is not None else KnownKeys()
        # counters (read by the storage tier's stats)
        self.found_pages = 0
        self.corrupt_objects = 0  # damaged or forged (failed their MAC): deleted
        self.mismatched_objects = 0  # sound, but another format or prefix under the key
        self.stored_pages = 0
        self.skipped_known = 0  # not written: known to be stored already
        self.calls = 0  # backend calls that succeeded (a caller tells "no call" from "worked")

    def fetch(
        self,
        namespace: Any,
        key_bytes: bytes,
        start: int,
        stop: int,
        deadline: float | None = None,
    ) -> list[memoryview]:
        """Payloads of pages ``start, start + 1, ...`` (< ``stop``) of the sequence
        ``key_bytes`` (tokens in the cache's key encoding, from the first token), up to the
        first page not found intact; stops early (with what it has) once
        ``time.monotonic()`` passes ``deadline``. Raises StorageError if the backend fails."""
        pb = self.page_size * 8
        prefix = key_bytes[: stop * pb]
        keys = page_keys(self.format_id, namespace, prefix, self.page_size, start)
        digests = prefix_digests(self.format_id, namespace, prefix, self.page_size, start)
        out: list[memoryview] = []
        for i in range(0, len(keys), _FETCH_BATCH):
            if deadline is not None and time.monotonic() > deadline:
                break
            batch = keys[i : i + _FETCH_BATCH]
            found = self.backend.get_many(batch)
            self.calls += 1
            for j, data in enumerate(found):
                key = batch[j]
                if data is None:
                    self.known.discard_many(keys[i + j :])  # see "Healing" above
                    return out
                try:
                    out.append(
                        decode_page(
                            data,
                            self.format_id,
                            digests[i + j],
                            self.payload_bytes,
                            key=key,
                            secret=self._secret,
                        )
                    )
                except ObjectCorrupt:
                    self.corrupt_objects += 1
                    self.known.discard_many(keys[i + j :])
                    self.backend.delete([key])
                    return out
                except FormatMismatch:
                    self.mismatched_objects += 1
                    return out
                self.found_pages += 1
            self.known.add(batch)
        return out

    def store(self, namespace: Any, key_bytes: bytes, payloads: list[bytes | memoryview]) -> int:
        """Write the last ``len(payloads)`` pages of the sequence ``key_bytes`` (whole pages,
        from the first token); pages known to be stored are skipped. Returns the number written.
        Raises StorageError if the backend fails (nothing is then known to be stored)."""
        n = len(key_bytes) // (self.page_size * 8)
        start = n - len(payloads)
        keys = page_keys(self.format_id, namespace, key_bytes, self.page_size, start)
        todo = [i for i, k in enumerate(keys) if k not in self.known]
        self.skipped_known += len(keys) - len(todo)
        if not todo:
            return 0
        digests = prefix_digests(self.format_id, namespace, key_bytes, self.page_size, start)
        items = [
            (
                keys[i],
                encode_page(
                    self.format_id, digests[i], payloads[i], key=keys[i], secret=self._secret
                ),
            )
            for i in todo
        ]
        self.backend.put_many(items)
        self.calls += 1
        self.known.add([k for k, _ in items])
        self.stored_pages += len(items)
        return len(items)
