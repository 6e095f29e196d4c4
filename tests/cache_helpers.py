"""Shared helpers for the cache tests (not a test module)."""

from __future__ import annotations

from typing import Any

from radixkv.cache import PagePool, RadixCache


def constant_hash(page: bytes) -> int:
    """Every page collides: the trie must still be exact (tokens are compared)."""
    return 7


HASH_FNS = {"xxh3": None, "constant": constant_hash}


def make_cache(
    num_pages: int = 64, page_size: int = 4, policy: str = "lru", hash_fn: Any = None
) -> RadixCache:
    return RadixCache(PagePool(num_pages), page_size=page_size, policy=policy, hash_fn=hash_fn)


def snapshot(cache: RadixCache) -> tuple:
    """Everything observable about a cache and its pool (for 'unchanged on error' checks)."""
    pool = cache.pool
    return (
        cache.pretty(max_tokens_shown=10_000),
        bytes(pool._state),
        list(pool._free),
        cache.stats,
        [n.node_id for n in cache.eviction_order()],
        cache._clock,
    )


def fill(cache: RadixCache, tokens: list[int], namespace: Any = None) -> Any:
    """Insert ``tokens`` (whole pages) the way the engine does: match, alloc the rest, insert."""
    m = cache.match_prefix(tokens, namespace)
    cache.lock(m.node)
    n_new = len(tokens) // cache.page_size - len(m.pages)
    new = cache.alloc(n_new)
    r = cache.insert(tokens, m.pages + new, namespace)
    cache.unlock(m.node)
    return r
