"""The cache layer (torch-free): page pool, radix trie, eviction, hashing, events, host tier,
window slots. ``build_cache`` builds a RadixCache, or a TieredRadixCache with a host pool."""

from radixkv.cache.build import build_cache
from radixkv.cache.errors import (
    ForeignNodeError,
    InvariantError,
    LockError,
    OutOfPages,
)
from radixkv.cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from radixkv.cache.hashing import page_hashes
from radixkv.cache.node import TreeNode
from radixkv.cache.page_pool import PagePool
from radixkv.cache.radix_cache import RadixCache
from radixkv.cache.results import InsertResult, MatchResult
from radixkv.cache.stats import CacheStats
from radixkv.cache.tiered_cache import TieredRadixCache
from radixkv.cache.tiers import CompletedCopy, Copier, CopyHandle, LoadBack
from radixkv.cache.window_slots import WindowSlots

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CacheStats",
    "CompletedCopy",
    "Copier",
    "CopyHandle",
    "ForeignNodeError",
    "InsertResult",
    "InvariantError",
    "LoadBack",
    "LockError",
    "MatchResult",
    "OutOfPages",
    "PagePool",
    "RadixCache",
    "TieredRadixCache",
    "TreeNode",
    "WindowSlots",
    "build_cache",
    "page_hashes",
]
