"""KV events for KV-aware routers (Dynamo-style) and a synchronous listener list.

``BlockStored`` is emitted when pages join the trie, ``BlockRemoved`` when pages leave it
(eviction, reset), ``AllBlocksCleared`` when a reset empties the whole trie. Block hashes are
the chained per-page hashes of radixkv.cache.hashing.page_hashes, so a router can rebuild the
cache's content from the stream: ``parent_block_hash`` is the hash of the page before the
first stored page (None when the stored run starts at the beginning of the sequence).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec


class BlockStored(msgspec.Struct, frozen=True, tag=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    page_size: int
    namespace: Any = None


class BlockRemoved(msgspec.Struct, frozen=True, tag=True):
    block_hashes: list[int]
    namespace: Any = None


class AllBlocksCleared(msgspec.Struct, frozen=True, tag=True):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
Listener = Callable[[KVEvent], None]


class EventEmitter:
    """Calls every listener synchronously, in registration order, with each event.

    Events are emitted after the cache state is consistent again; an exception raised by a
    listener propagates to the caller of the cache operation.

    ``listeners`` is the registered list itself, read-only for others: the cache tests it for
    emptiness on its hot paths (no call), and changes it only through ``add``/``remove``.
    """

    __slots__ = ("listeners",)

    def __init__(self) -> None:
        self.listeners: list[Listener] = []

    def add(self, fn: Listener) -> None:
        if not callable(fn):
            raise TypeError(f"listener must be callable, got {fn!r}")
        self.listeners.append(fn)

    def remove(self, fn: Listener) -> None:
        try:
            self.listeners.remove(fn)
        except ValueError:
            raise ValueError(f"{fn!r} is not a registered listener") from None

    def __bool__(self) -> bool:
        return bool(self.listeners)

    def emit(self, event: KVEvent) -> None:
        for fn in list(self.listeners):
            fn(event)
