"""A replica's bounded summary of its trie, kept current from the cache's KV events.

:class:`CacheSummary` is a cache listener (``cache.add_listener(summary.listener)``): every
``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` updates an insertion-ordered set of
the chained page hashes the trie holds (the same Dynamo-compatible hashes the router computes
from a request's tokens with :func:`radixkv.cache.hashing.page_hashes`). ``snapshot()`` turns it
into the :class:`~radixkv.cluster.affinity.ReplicaSummary` a deployment returns from
``record_routing_stats()``.

Threading: the listener runs on the engine's step thread, ``snapshot`` on the replica's event
loop; a lock guards the set. The listener is O(pages in the event) and never raises.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from radixkv.cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from radixkv.cluster.affinity import ReplicaSummary


class CacheSummary:
    """Which page hashes a cache holds, most recently stored last (``snapshot`` reverses)."""

    def __init__(self, page_size: int, *, max_hashes: int = 2048) -> None:
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
        if not isinstance(max_hashes, int) or max_hashes < 0:
            raise ValueError(f"max_hashes must be an int >= 0, got {max_hashes!r}")
        self.page_size = page_size
        self.max_hashes = max_hashes
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self._lock = threading.Lock()
        self._version = 0

    def listener(self, event: Any) -> None:
        """Apply one cache event (registered with ``cache.add_listener``)."""
        with self._lock:
            if isinstance(event, BlockStored):
                for h in event.block_hashes:
                    self._blocks[h] = None
                    self._blocks.move_to_end(h)
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    self._blocks.pop(h, None)
            elif isinstance(event, AllBlocksCleared):
                self._blocks.clear()
            else:
                return
            self._version += 1

    def __len__(self) -> int:
        with self._lock:
            return len(self._blocks)

    def __contains__(self, h: object) -> bool:
        with self._lock:
            return h in self._blocks

    def snapshot(self, *, queue_len: int = 0, replica: str = "") -> ReplicaSummary:
        """The bounded summary: at most ``max_hashes`` hashes, most recently stored first."""
        with self._lock:
            n = len(self._blocks)
            take = min(n, self.max_hashes)
            hashes: list[int] = []
            if take:
                it = reversed(self._blocks)
                hashes = [next(it) for _ in range(take)]
            version = self._version
        return ReplicaSummary(
            block_hashes=hashes,
            cached_tokens=n * self.page_size,
            queue_len=queue_len,
            page_size=self.page_size,
            truncated=take < n,
            version=version,
            replica=replica,
        )
