"""RadixCache: a radix trie mapping page-aligned token prefixes to the KV pages that hold them.

Ownership contract (see also page_pool.py):

* ``match_prefix`` returns the cached pages of the longest cached page-aligned prefix. They
  stay owned by the trie; the caller must ``lock`` the returned node before the next call that
  may evict (``alloc``, ``evict``, ``insert`` with duplicates...), and ``unlock`` it when done.
  An unlocked MatchResult/InsertResult is only valid until the next mutating call.
* ``insert(tokens, pages)`` takes ownership of every page passed: pages that already are the
  cached page for their tokens stay; other pages whose tokens were cached already are
  duplicates and go back to the pool; the rest join the trie. Use ``InsertResult.pages``
  afterwards, never a freed duplicate.
* ``alloc(n)`` gives the caller ``n`` HELD pages, evicting unlocked leaves if the pool is short.

Every error leaves the cache and pool unchanged. Not thread-safe. Nodes are described in
node.py; the fast paths are explained in docs/cache_design.md.

This class keeps the state (counters, eviction index, listeners) and the public API; the
bodies of the larger operations are functions over it, each with its contract: match.py
(match_prefix, peek_prefix), insert.py (insert), removal.py (eviction and reset), and the
result types in results.py (re-exported here). The trie plumbing (walk, split, namespace
roots, event hashes) is TrieStore in trie.py.
"""

from __future__ import annotations

from typing import Any

from radixkv.cache.errors import LockError, OutOfPages
from radixkv.cache.events import EventEmitter, Listener
from radixkv.cache.eviction import EvictionIndex, EvictionPolicy, get_policy
from radixkv.cache.hashing import HashFn, default_hash_fn
from radixkv.cache.insert import insert_encoded
from radixkv.cache.match import match_encoded, peek_encoded
from radixkv.cache.node import TreeNode
from radixkv.cache.page_pool import PagePool
from radixkv.cache.removal import remove_leaf, reset_unlocked, truncate_leaf
from radixkv.cache.results import InsertResult, MatchResult
from radixkv.cache.stats import CacheStats
from radixkv.cache.tokens import encode_tokens
from radixkv.cache.trie import TrieStore

__all__ = ["InsertResult", "MatchResult", "RadixCache"]


def _release(view: memoryview) -> None:
    """Give the caller's array back (it cannot be resized while viewed)."""
    try:  # noqa: SIM105 (contextlib.suppress costs more than the release itself)
        view.release()
    except BufferError:  # a derived buffer still lives in a traceback: it goes with it
        pass


class RadixCache(TrieStore):
    """Prefix cache over a PagePool. See the module docstring for the ownership contract.

    Args:
        pool: the PagePool whose page ids the trie owns; use one pool per cache.
        page_size: tokens per KV page; only whole pages are cached.
        policy: eviction order, "lru" (default) or "lfu", or an object with a ``name`` and a
            ``key(node) -> int`` method (smaller keys are evicted first).
        hash_fn: child-lookup hash of one page, given as ``bytes`` holding the page's tokens in
            the key encoding (native int64); it must return the same int for equal bytes.
            Defaults to XXH3-64. Any function works, even a constant:
            tokens are always compared before a page is reused.
    """

    def __init__(
        self,
        pool: PagePool,
        page_size: int = 16,
        policy: str | EvictionPolicy = "lru",
        *,
        hash_fn: HashFn | None = None,
    ) -> None:
        if not isinstance(pool, PagePool):
            raise TypeError(f"pool must be a PagePool, got {type(pool).__name__}")
        if type(page_size) is not int or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        if hash_fn is not None and not callable(hash_fn):
            raise TypeError("hash_fn must be callable(bytes) -> int")
        self.policy = get_policy(policy)
        if hash_fn is None:
            hash_fn = default_hash_fn  # C code that reads the query view in place
        else:
            user_fn = hash_fn  # walks slice a view of the query: hand the user bytes

            def hash_fn(page: Any) -> int:
                return user_fn(bytes(page))

        super().__init__(page_size, hash_fn)
        self.pool = pool
        self._index = EvictionIndex(self.policy)
        self._events = EventEmitter()
        self._listeners = self._events._listeners  # the same list: a cheap emptiness test
        self._cached = 0  # pages in the trie
        self._evictable = 0  # pages in unlocked nodes
        # cumulative counters (CacheStats)
        self._match_queries = self._query_tokens = self._hit_tokens = 0
        self._insert_calls = self._inserted_pages = self._duplicate_pages = 0
        self._evicted_pages = self._evicted_nodes = self._resets = 0

    # ======================================================================== queries
    @property
    def num_cached_pages(self) -> int:
        return self._cached

    @property
    def num_evictable_pages(self) -> int:
        """Pages in unlocked nodes: all of them can be freed by repeated leaf eviction."""
        return self._evictable

    @property
    def num_locked_pages(self) -> int:
        return self._cached - self._evictable

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @property
    def stats(self) -> CacheStats:
        return CacheStats(
            match_queries=self._match_queries,
            query_tokens=self._query_tokens,
            hit_tokens=self._hit_tokens,
            insert_calls=self._insert_calls,
            inserted_pages=self._inserted_pages,
            duplicate_pages=self._duplicate_pages,
            evicted_pages=self._evicted_pages,
            evicted_nodes=self._evicted_nodes,
            splits=self._splits,
            resets=self._resets,
            cached_pages=self._cached,
            evictable_pages=self._evictable,
            locked_pages=self._cached - self._evictable,
            free_pages=self.pool.num_free,
            num_nodes=self._num_nodes,
        )

    def eviction_order(self) -> list[TreeNode]:
        """The evictable leaves, next victim first (for inspection and tests)."""
        return list(self._index)

    # ======================================================================== match
    def match_prefix(self, tokens: Any, namespace: Any = None) -> MatchResult:
        """Longest cached prefix of ``tokens`` whose length is a multiple of page_size.

        Refreshes access time and hit counts along the matched path, and splits the last
        node when the match ends inside it (so the returned node ends exactly at the match).
        """
        qb = encode_tokens(tokens)
        try:
            return match_encoded(self, qb, namespace)
        finally:
            if type(qb) is memoryview:
                _release(qb)

    def peek_prefix(self, tokens: Any, namespace: Any = None) -> int:
        """Tokens ``match_prefix`` would match now, changing nothing: no split, no access-time
        or hit-count refresh, no stats (for schedulers that only want to estimate hits)."""
        qb = encode_tokens(tokens)
        try:
            return peek_encoded(self, qb, namespace)
        finally:
            if type(qb) is memoryview:
                _release(qb)

    # ======================================================================== insert
    def insert(self, tokens: Any, pages: Any, namespace: Any = None) -> InsertResult:
        """Cache ``tokens`` (whole pages) held in ``pages``; takes ownership of ``pages``.

        ``len(tokens) == len(pages) * page_size`` is required. Each passed page must either
        be the page already cached for its tokens, or be HELD by the caller (from ``alloc``).
        """
        qb = encode_tokens(tokens)
        try:
            return insert_encoded(self, qb, pages, namespace)
        finally:
            if type(qb) is memoryview:
                _release(qb)

    # ======================================================================== locking
    def lock(self, node: TreeNode) -> None:
        """Protect ``node`` and its ancestors from eviction (counts nest)."""
        self._check_node(node)
        root = self.root
        index = self._index
        while node is not root:
            if node.lock_ref == 0:
                self._evictable -= len(node._pages)
                if node._ekey is not None:
                    index.discard(node)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        """Undo one ``lock(node)``; LockError (nothing changed) if ``node`` is not locked."""
        self._check_node(node)
        if node is self.root:
            return
        if node.lock_ref <= 0:
            raise LockError(f"unlock of a node that is not locked: {node!r}")
        root = self.root
        while node is not root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node._pages)
                if not node._children and node._pages:
                    self._index.add(node)
            node = node.parent

    # ======================================================================== allocation, eviction
    def alloc(self, n: int) -> list[int]:
        """``n`` HELD pages from the pool, evicting unlocked leaves (policy order) if short.

        Raises OutOfPages, with nothing evicted, if free + evictable pages < n.
        """
        if type(n) is not int or n < 0:
            raise ValueError(f"alloc needs a non-negative int, got {n!r}")
        short = n - self.pool.num_free
        if short > 0:
            if short > self._evictable:
                raise OutOfPages(n, self.pool.num_free + self._evictable, "free or evictable")
            self.evict(short)
        return self.pool.alloc(n)

    def evict(self, num_pages: int) -> int:
        """Free up to ``num_pages`` pages from unlocked leaves in policy order; return the count.

        Never frees more than asked: a leaf larger than the remainder loses only its tail pages.
        """
        if type(num_pages) is not int or num_pages < 0:
            raise ValueError(f"evict needs a non-negative int, got {num_pages!r}")
        freed = 0
        index = self._index
        while freed < num_pages and len(index):
            node = index.first()
            k = len(node._pages)
            need = num_pages - freed
            if k > need:
                truncate_leaf(self, node, need)
                return num_pages
            index.discard(node)
            remove_leaf(self, node)
            freed += k
        return freed

    def reset(self) -> None:
        """Drop every unlocked node and free its pages; locked paths stay cached."""
        reset_unlocked(self)

    # ======================================================================== events
    def add_listener(self, fn: Listener) -> None:
        """Call ``fn(event)`` synchronously for every BlockStored/BlockRemoved/AllBlocksCleared."""
        self._events.add(fn)

    def remove_listener(self, fn: Listener) -> None:
        self._events.remove(fn)

    def _emit(self, event: Any) -> None:
        self._events.emit(event)

    # ======================================================================== diagnostics
    def check_invariants(self) -> None:
        """Recount everything; raise InvariantError on any violation (see invariants.py)."""
        from radixkv.cache.invariants import check_cache_invariants

        check_cache_invariants(self)

    def pretty(self, max_tokens_shown: int = 8) -> str:
        from radixkv.cache.pretty import pretty

        return pretty(self, max_tokens_shown)

    def to_dot(self) -> str:
        from radixkv.cache.pretty import to_dot

        return to_dot(self)

    def __repr__(self) -> str:
        return (
            f"RadixCache(page_size={self.page_size}, policy={self.policy.name!r}, "
            f"nodes={self._num_nodes}, cached_pages={self._cached}, "
            f"evictable_pages={self._evictable}, free_pages={self.pool.num_free})"
        )
