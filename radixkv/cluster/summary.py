"""A replica's bounded summary of its trie: the wire format and the listener that keeps it.

:class:`ReplicaSummary` is what a replica returns from ``record_routing_stats()`` and what the
router parses (:class:`~radixkv.cluster.fleet_view.FleetView`). :class:`CacheSummary` is a
cache listener (``cache.add_listener(summary.listener)``): every ``BlockStored`` /
``BlockRemoved`` / ``AllBlocksCleared`` updates an insertion-ordered set of the chained page
hashes the trie holds on the device (the same Dynamo-compatible hashes the router computes
from a request's tokens with :func:`radixkv.cache.hashing.page_hashes`); events about a host
tier (``medium`` set) are ignored, so the summary means the same with or without one.
``snapshot()`` turns it into a :class:`ReplicaSummary`.

Threading: the listener runs on the engine's step thread, ``snapshot`` on the replica's event
loop; a lock guards the set. The listener is O(pages in the event) and never raises.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import msgspec

from radixkv.cache.events import AllBlocksCleared, BlockRemoved, BlockStored


class ReplicaSummary(msgspec.Struct, frozen=True, kw_only=True):
    """What a replica reports in ``record_routing_stats()`` (bounded).

    ``block_hashes``: chained page hashes of pages in its trie, most recently stored first, at
    most the replica's bound (so a prefix's early pages may be missing while its later ones are
    present: matching looks for the *deepest* held hash, which names the whole prefix).
    ``truncated``: more blocks are cached than listed. ``version`` changes whenever the trie's
    block set changes (it only grows, so a summary with a lower version is an older one).
    """

    block_hashes: list[int] = msgspec.field(default_factory=list)
    cached_tokens: int = 0
    queue_len: int = 0
    page_size: int = 0
    truncated: bool = False
    version: int = 0
    replica: str = ""

    @classmethod
    def from_stats(cls, stats: Mapping[str, Any] | None) -> ReplicaSummary | None:
        """Parse a routing-stats dict; None (and never an exception) when absent or malformed."""
        if not stats:
            return None
        try:
            return msgspec.convert(dict(stats), cls)
        except (msgspec.ValidationError, TypeError):
            return None

    def to_stats(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)


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
        if getattr(event, "medium", None) is not None:
            return  # the host tier's content: not what the summary lists
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

    @property
    def version(self) -> int:
        """Bumped by every event that changed the block set (what ``snapshot`` reports)."""
        with self._lock:
            return self._version

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
