"""Pages leaving the trie: the eviction primitives and reset, with their counters and events.

RadixCache.evict picks the victims (policy order, never more pages than asked) and calls
``truncate_leaf`` or ``remove_leaf``; RadixCache.reset calls ``reset_unlocked``. These
functions validate nothing: they are only given unlocked nodes. Contract:

* ``truncate_leaf`` drops the last ``n`` pages of an evictable leaf, which keeps its place in
  the eviction index (its key depends on access fields and id, which do not change);
* ``remove_leaf`` removes an unlocked leaf already taken out of the index; a parent left
  childless and unlocked becomes an eviction candidate, or is dropped if it is a namespace root;
* ``reset_unlocked`` removes every unlocked subtree (locked paths stay) and counts the reset,
  even when nothing was removed.

Freed pages go back to the pool as FREE and the counters drop by what left. Only then, with
the state consistent again, are events emitted, and only when a listener is registered
(computing event hashes costs a pass over the keys): BlockRemoved per removed node (in
removal order), or a single AllBlocksCleared when a reset emptied the whole trie.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixkv.cache.events import AllBlocksCleared, BlockRemoved
from radixkv.cache.node import TreeNode

if TYPE_CHECKING:
    from radixkv.cache.radix_cache import RadixCache


def truncate_leaf(cache: RadixCache, node: TreeNode, n: int) -> None:
    """Drop the last ``n`` pages of an evictable leaf (it stays in the index)."""
    hashes = cache._node_hashes(node) if cache._listeners else node._hashes
    drop = node._pages[-n:]
    node._pages = node._pages[:-n]
    node.key = node.key[: -n * cache._pb]
    node.depth_tokens -= n * cache.page_size
    if hashes is not None:
        node._hashes = hashes[:-n]
    cache.pool._release_cached(drop)
    cache._cached -= n
    cache._evictable -= n
    cache._evicted_pages += n
    if cache._listeners:
        cache._emit(BlockRemoved(hashes[-n:], node.namespace))


def remove_leaf(cache: RadixCache, node: TreeNode) -> None:
    """Remove an unlocked leaf (already out of the index) and free its pages."""
    hashes = cache._node_hashes(node) if cache._listeners else None
    parent = node.parent
    cache._detach(parent, node)
    node.parent = None
    k = len(node._pages)
    cache.pool._release_cached(node._pages)
    node._pages = []
    cache._num_nodes -= 1
    cache._cached -= k
    cache._evictable -= k
    cache._evicted_pages += k
    cache._evicted_nodes += 1
    if not parent._children and parent is not cache.root and parent.lock_ref == 0:
        if parent.key:
            cache._index.add(parent)  # a parent whose last child went becomes a candidate
        else:
            cache._drop_ns_root(parent)
    if hashes is not None:
        cache._emit(BlockRemoved(hashes, node.namespace))


def reset_unlocked(cache: RadixCache) -> None:
    """Drop every unlocked node and free its pages; locked paths stay cached."""
    cache._resets += 1
    victims: list[TreeNode] = []  # roots of unlocked subtrees
    stack = [cache.root]
    while stack:
        for c in stack.pop().iter_children():
            (stack if c.lock_ref else victims).append(c)
    if not victims:
        return
    everything = not any(c.lock_ref for c in cache.root.iter_children())
    removed: list[TreeNode] = []
    for v in victims:
        sub = [v]
        for n in sub:  # grows while iterating: breadth-first subtree listing
            sub.extend(n.iter_children())
        removed += sub
    hashes = {}
    if cache._listeners and not everything:
        hashes = {n._id: cache._node_hashes(n) for n in removed if n.key}
    for v in victims:
        cache._detach(v.parent, v)
        if not v.key:
            del cache._ns_roots[v.namespace]
    freed: list[int] = []
    for n in removed:
        cache._index.discard(n)
        freed += n._pages
        n._pages = []
        n.parent = None
    cache.pool._release_cached(freed)
    cache._num_nodes -= len(removed)
    cache._cached -= len(freed)
    cache._evictable -= len(freed)
    if cache._listeners:
        if everything:
            cache._emit(AllBlocksCleared())
        else:
            for n in removed:
                if n.key:
                    cache._emit(BlockRemoved(hashes[n._id], n.namespace))
