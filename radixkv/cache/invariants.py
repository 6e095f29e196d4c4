"""check_cache_invariants: a full recount of a RadixCache against its incremental state.

Checked (InvariantError names the first violation):

* pool: free list and page states are consistent (PagePool.check_invariants);
* page conservation: every trie page is distinct and CACHED in the pool, the pool's CACHED
  count equals the trie's page count, so free + cached + held == total;
* shape: every non-root node's key is a whole, non-zero number of pages and owns
  ``len(key) / page_size`` pages; parent/child links and child-lookup keys agree; siblings
  start with different pages; depth_tokens adds up; namespaces are inherited; namespace roots
  are registered, empty of tokens and never childless;
* locks: lock_ref >= 0, a parent's count >= each child's, the root is never counted;
* counters: cached, evictable and node counts equal a recount;
* eviction index: holds exactly the unlocked leaves that own pages, under their current key;
* event hashes cached on nodes (only once a listener was added) equal a fresh computation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixkv.cache.errors import InvariantError
from radixkv.cache.hashing import chain_hashes, chain_start, local_hashes_of_key
from radixkv.cache.page_pool import CACHED

if TYPE_CHECKING:
    from radixkv.cache.radix_cache import RadixCache


def _fail(msg: str) -> None:
    raise InvariantError(msg)


def check_cache_invariants(cache: RadixCache) -> None:
    pool = cache.pool
    pool.check_invariants()
    pb = cache._pb
    ps = cache.page_size
    root = cache.root
    if root.parent is not None or root.key or root._pages or root.lock_ref:
        _fail("root must have no parent, tokens, pages or lock count")

    seen_pages: set[int] = set()
    cached = evictable = nodes = 0
    expected_index: dict[int, int] = {}
    ns_seen: dict[object, object] = {}
    # event hashes are checked only when some node caches them (recomputing costs a hash pass)
    verify_hashes = any(n._hashes is not None for n in cache.iter_nodes())
    last_hash: dict[int, int | None] = {}  # node id -> chained hash of its last page
    stack = [root]
    while stack:
        node = stack.pop()
        nodes += 1
        if node._cache is not cache:
            _fail(f"{node!r} belongs to another cache")
        if node.lock_ref < 0:
            _fail(f"negative lock count on {node!r}")
        children = list(node.iter_children())
        keys_first_pages: set[bytes] = set()
        for c in children:
            if c.parent is not node:
                _fail(f"child {c!r} does not point back to its parent {node!r}")
            slot = node._children.get(c._hkey)
            if not (slot is c or (type(slot) is list and any(x is c for x in slot))):
                _fail(f"child {c!r} is not stored under its lookup key")
            if node is not root and c.lock_ref > node.lock_ref:
                _fail(f"child lock {c.lock_ref} > parent lock {node.lock_ref} at {c!r}")
            if c.key:
                if c._hkey != cache._hash_fn(c.key[:pb]):
                    _fail(f"stale lookup key on {c!r}")
                first = c.key[:pb]
                if first in keys_first_pages:
                    _fail(f"two children of {node!r} start with the same page")
                keys_first_pages.add(first)
            stack.append(c)
        for slot in node._children.values():
            if type(slot) is list and len(slot) < 2:
                _fail("collision bucket with fewer than two nodes")
        if node is root:
            continue
        parent = node.parent
        if not node.key:  # namespace root
            if parent is not root or cache._ns_roots.get(node.namespace) is not node:
                _fail(f"unregistered namespace root {node!r}")
            if node._pages or node.depth_tokens:
                _fail("namespace root with pages or depth")
            if not children:
                _fail(f"empty namespace root {node.namespace!r} was not removed")
            ns_seen[node.namespace] = node
            continue
        if len(node.key) % pb:
            _fail(f"{node!r}: key is not a whole number of pages")
        if len(node._pages) * pb != len(node.key):
            _fail(f"{node!r}: {len(node._pages)} pages for {len(node.key) // 8} tokens")
        if node.namespace != parent.namespace:
            _fail(f"{node!r}: namespace differs from its parent's")
        if node.depth_tokens != parent.depth_tokens + len(node.key) // 8:
            _fail(f"{node!r}: depth_tokens does not add up")
        if verify_hashes:
            prev = last_hash[parent._id] if parent.key else chain_start(node.namespace)
            fresh = chain_hashes(prev, local_hashes_of_key(node.key, ps))
            last_hash[node._id] = fresh[-1]
            if node._hashes is not None and node._hashes != fresh:
                _fail(f"{node!r}: cached event hashes differ from a fresh computation")
        for p in node._pages:
            if p in seen_pages:
                _fail(f"page {p} is owned by two nodes")
            seen_pages.add(p)
            if not 0 <= p < pool.num_pages or pool._state[p] != CACHED:
                _fail(f"trie page {p} is not CACHED in the pool")
        cached += len(node._pages)
        if node.lock_ref == 0:
            evictable += len(node._pages)
            if not children:
                expected_index[node._id] = cache.policy.key(node)
        elif node._ekey is not None:
            _fail(f"locked node {node!r} is in the eviction index")
    if ns_seen.keys() != cache._ns_roots.keys():
        _fail("namespace root registry differs from the trie")
    if pool.num_cached != cached or cached != cache._cached:
        _fail(f"cached pages: pool {pool.num_cached}, counter {cache._cached}, recount {cached}")
    if pool.num_free + cached + pool.num_held != pool.num_pages:
        _fail("free + cached + held != total")
    if evictable != cache._evictable:
        _fail(f"evictable counter {cache._evictable} != recount {evictable}")
    if nodes != cache._num_nodes:
        _fail(f"node counter {cache._num_nodes} != recount {nodes}")
    stored = cache._index.stored_keys()
    if stored != expected_index:
        _fail(
            f"eviction index {sorted(stored.items())} != recount {sorted(expected_index.items())}"
        )
    if len(cache._index) != len(stored):
        _fail("eviction index has duplicate keys")
