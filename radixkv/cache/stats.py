"""CacheStats: a snapshot of a RadixCache's counters."""

from __future__ import annotations

import msgspec


class CacheStats(msgspec.Struct, frozen=True, kw_only=True):
    """Counters since the cache was built (cumulative) and gauges at snapshot time."""

    # cumulative
    match_queries: int = 0  # match_prefix calls
    query_tokens: int = 0  # tokens passed to match_prefix
    hit_tokens: int = 0  # of those, tokens found cached
    insert_calls: int = 0
    inserted_pages: int = 0  # pages that joined the trie
    duplicate_pages: int = 0  # pages passed to insert whose tokens were cached already (freed)
    evicted_pages: int = 0
    evicted_nodes: int = 0  # nodes removed entirely by eviction
    splits: int = 0
    resets: int = 0
    # gauges
    cached_pages: int = 0
    evictable_pages: int = 0
    locked_pages: int = 0
    free_pages: int = 0
    num_nodes: int = 0  # trie nodes, root included

    @property
    def hit_rate(self) -> float:
        """hit_tokens / query_tokens (0.0 before the first query)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0
