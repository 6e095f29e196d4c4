"""KV events for KV-aware routers (Dynamo-style) and a synchronous listener list.

``BlockStored`` is emitted when pages join the trie, ``BlockRemoved`` when pages leave it
(eviction, reset), ``AllBlocksCleared`` when a reset empties the whole trie. Block hashes are
the chained per-page hashes of radixkv.cache.hashing.page_hashes, so a router can rebuild the
cache's content from the stream: ``parent_block_hash`` is the hash of the page before the
first stored page (None when the stored run starts at the beginning of the sequence).

``medium`` says which tier the event is about, as in vLLM's events of the same names: None (the
default) is the cache's own device pool, the only tier a cache without a host tier has, so
consumers that ignore the field see exactly what they always saw from such a cache;
``"CPU"`` (radixkv.cache.tiers.HOST_MEDIUM) is the host tier. With a host tier, each medium's
events describe that medium's content on their own: a page backed up to host memory gives a
``BlockStored(medium="CPU")``; evicting it from the device while its host copy stays gives a
``BlockRemoved`` with ``medium=None`` and nothing for the host; loading it back gives a
``BlockStored`` with ``medium=None``. A consumer tracking only the device filters on
``medium is None``. ``AllBlocksCleared`` (a reset that emptied the trie) clears both tiers.
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
    medium: str | None = None  # None: the device pool; "CPU": the host tier


class BlockRemoved(msgspec.Struct, frozen=True, tag=True):
    block_hashes: list[int]
    namespace: Any = None
    medium: str | None = None  # None: the device pool; "CPU": the host tier


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
