"""build_cache: the one constructor the engine and the docs use, for either kind of cache.

RadixCache (radix_cache.py) is the device cache; TieredRadixCache (tiered_cache.py) adds a
host tier. Both can be built directly; ``build_cache`` takes the arguments of both and picks
the class: a TieredRadixCache when a ``host_pool`` is given, else a RadixCache.
"""

from __future__ import annotations

from radixkv.cache.eviction import EvictionPolicy
from radixkv.cache.hashing import HashFn
from radixkv.cache.page_pool import PagePool
from radixkv.cache.radix_cache import RadixCache
from radixkv.cache.tiered_cache import TieredRadixCache
from radixkv.cache.tiers import WRITE_THROUGH, Copier, check_tier_args

__all__ = ["build_cache"]


def build_cache(
    pool: PagePool,
    page_size: int = 16,
    policy: str | EvictionPolicy = "lru",
    *,
    hash_fn: HashFn | None = None,
    host_pool: PagePool | None = None,
    copier: Copier | None = None,
    write_policy: str = WRITE_THROUGH,
    write_through_threshold: int = 1,
) -> RadixCache:
    """A RadixCache over ``pool``, or a TieredRadixCache when ``host_pool`` is given.

    The arguments are RadixCache's and TieredRadixCache's (see their docstrings). The host-tier
    arguments are checked even without a host tier, where they change nothing: a ``copier``
    without a ``host_pool`` is an error, as is an unknown ``write_policy``.
    """
    if host_pool is None:
        check_tier_args(pool, None, copier, write_policy, write_through_threshold)
        return RadixCache(pool, page_size, policy, hash_fn=hash_fn)
    return TieredRadixCache(
        pool,
        page_size,
        policy,
        hash_fn=hash_fn,
        host_pool=host_pool,
        copier=copier,
        write_policy=write_policy,
        write_through_threshold=write_through_threshold,
    )
