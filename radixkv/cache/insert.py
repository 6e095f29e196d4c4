"""Insert: the body of RadixCache.insert. Validate everything first, then mutate.

``insert_encoded(cache, qb, pages, namespace)`` takes the tokens in the key encoding and the
pages the caller hands over (ownership passes to the cache; see radix_cache.py). Contract:

* every check runs before the first change, so an error leaves cache and pool as they were:
  ``len(tokens) == len(pages) * page_size`` (ValueError, after a token-range check, the more
  useful error), a hashable namespace, the token range past the already cached part, and that
  every duplicate and every new page is distinct and HELD by the caller;
* the walk finds the cached part; a passed page at a cached position that is not the cached
  page there is a duplicate; the pages past the cached part are new;
* then, in this order: the call counter and one clock tick, a split of the node the cached part ends
  inside, ``last_access`` along the cached path, one new leaf holding all new pages (adopted
  as CACHED; its parent leaves the eviction index, the leaf enters it), duplicates released to
  the pool, and last a BlockStored event for the new leaf when a listener is registered;
* the result is InsertResult(node ending at the last page, canonical pages of the whole
  prefix, tokens cached before); with no new page the cached path's last node is re-keyed in
  the eviction index (when it is there), and an empty insert returns the global root.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from radixkv.cache.events import BlockStored
from radixkv.cache.node import TreeNode
from radixkv.cache.results import InsertResult, new_result
from radixkv.cache.tokens import TOKEN_SHIFT, check_range, key_to_list

if TYPE_CHECKING:
    from radixkv.cache.radix_cache import RadixCache


def insert_encoded(
    cache: RadixCache, qb: bytes | memoryview, pages: Any, namespace: Any
) -> InsertResult:
    """``cache.insert`` on encoded tokens (see the module docstring)."""
    if type(pages) is not list:
        pages = list(pages)
    pb = cache._pb
    if len(qb) != len(pages) * pb:
        check_range(qb)  # a bad token id is the more useful error
        raise ValueError(
            f"insert needs len(tokens) == len(pages) * page_size: got {len(qb) >> TOKEN_SHIFT} "
            f"tokens and {len(pages)} pages with page_size {cache.page_size}"
        )
    if namespace is not None:
        hash(namespace)  # unhashable namespaces fail before any change
    start = cache.root if namespace is None else cache._ns_roots.get(namespace)
    path: list[TreeNode] = []
    partial = None
    if start is not None and pages:
        path, _, partial = cache._walk(start, qb, len(qb))
    canon: list[int] = []
    for n in path:
        canon += n._pages
    if partial is not None:
        canon += partial[0]._pages[: partial[1]]
    ncached = len(canon)
    check_range(qb, ncached * pb)  # the cached part equals stored, validated keys
    head = pages[:ncached]
    dups = [] if head == canon else [p for p, q in zip(head, canon) if p != q]
    checked = cache.pool._check_held(dups + pages[ncached:])  # raises: nothing changed yet
    dups, new = checked[: len(dups)], checked[len(dups) :]

    # ---- mutation starts: nothing below can fail
    cache._insert_calls += 1
    cache._clock += 1
    clock = cache._clock
    if partial is not None:
        path.append(cache._split(*partial))
    for n in path:
        n.last_access = clock
    if new:
        parent = path[-1] if path else (start or cache._make_ns_root(namespace))
        leaf = cache._new_node(
            parent,
            bytes(qb[ncached * pb :]),  # the new key (a copy when qb is a memoryview)
            new,
            namespace,
            parent.depth_tokens + len(new) * cache.page_size,
        )
        if parent._ekey is not None:
            cache._index.discard(parent)
        cache._attach(parent, leaf)
        cache.pool._adopt(new)
        cache._num_nodes += 1
        cache._cached += len(new)
        cache._evictable += len(new)
        cache._inserted_pages += len(new)
        cache._index.add(leaf)
        node = leaf
        canon += new
    else:
        node = path[-1] if path else cache.root
        if node._ekey is not None:
            cache._index.refresh(node)
    if dups:
        cache.pool._release_held(dups)
        cache._duplicate_pages += len(dups)
    if new and cache._listeners:
        hashes = cache._node_hashes(leaf)
        parent_hash = cache._last_hash(leaf.parent)
        cache._emit(
            BlockStored(hashes, parent_hash, key_to_list(leaf.key), cache.page_size, namespace)
        )
    return new_result(InsertResult, (node, canon, ncached * cache.page_size))
