"""CacheStats: a snapshot of a RadixCache's counters."""

from __future__ import annotations

import msgspec


class CacheStats(msgspec.Struct, frozen=True, kw_only=True):
    """Counters since the cache was built (cumulative) and gauges at snapshot time.

    Page counts without "host" in their name are device pages. The host-tier fields stay 0 for
    a cache without a host tier.
    """

    # cumulative
    match_queries: int = 0  # match_prefix calls
    query_tokens: int = 0  # tokens passed to match_prefix
    hit_tokens: int = 0  # of those, tokens found cached on the device
    insert_calls: int = 0
    inserted_pages: int = 0  # pages that joined the trie
    duplicate_pages: int = 0  # pages passed to insert whose tokens were cached already (freed)
    evicted_pages: int = 0
    evicted_nodes: int = 0  # nodes removed entirely by eviction
    splits: int = 0
    merged_nodes: int = 0  # nodes merged into the single child below them (edge compression)
    resets: int = 0
    # cumulative, host tier
    host_hit_tokens: int = 0  # tokens matched past the device prefix, in the host tier
    loaded_pages: int = 0  # pages loaded back from host to device (copies that succeeded)
    load_failures: int = 0  # load-back copies that failed (their requests became misses)
    backup_pages: int = 0  # pages copied from device to host (succeeded; includes write_back)
    write_back_pages: int = 0  # of those, pages backed up when evicted (write_back policy)
    backup_failures: int = 0  # backup copies that failed
    backup_skipped_pages: int = 0  # pages a policy wanted backed up but the host tier had no room
    demoted_pages: int = 0  # device pages evicted while a host copy kept the node
    host_evicted_pages: int = 0  # host pages freed by host eviction or dropped subtrees
    host_inserted_pages: int = 0  # host pages that joined through insert_host (from storage)
    # gauges
    cached_pages: int = 0
    evictable_pages: int = 0
    locked_pages: int = 0
    free_pages: int = 0
    num_nodes: int = 0  # trie nodes, root included
    # gauges, host tier
    host_cached_pages: int = 0  # host pages owned by nodes (including backups in flight)
    host_evictable_pages: int = 0  # host pages of unlocked nodes
    host_free_pages: int = 0
    copies_in_flight: int = 0

    @property
    def hit_rate(self) -> float:
        """hit_tokens / query_tokens (0.0 before the first query)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0
