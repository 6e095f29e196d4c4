"""The recounts behind ``check_invariants``: everything a cache keeps incrementally, counted again.

They read a cache from outside, through its public names (CacheView and TieredCacheView list
them) and the node slots
(node.py: the trie's storage, read inside radixkv/cache), and change nothing. Each raises
InvariantError naming the first violation. ``check_device_cache`` is RadixCache's whole check;
TieredRadixCache adds ``check_host_tier``. What each checks is listed in the docstrings of the
two ``check_invariants``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NoReturn, Protocol

from radixkv.cache.copies import LOAD, Copies
from radixkv.cache.errors import InvariantError
from radixkv.cache.eviction import EvictionIndex, EvictionPolicy
from radixkv.cache.hashing import chain_hashes, chain_start, local_hashes_of_key
from radixkv.cache.node import TreeNode
from radixkv.cache.page_pool import PagePool
from radixkv.cache.tokens import TOKEN_BYTES

__all__ = ["CacheView", "TieredCacheView", "check_device_cache", "check_host_tier"]


class CacheView(Protocol):
    """The public names of a RadixCache that the device recount reads."""

    @property
    def pool(self) -> PagePool: ...
    @property
    def root(self) -> TreeNode: ...
    @property
    def page_size(self) -> int: ...
    @property
    def policy(self) -> EvictionPolicy: ...
    @property
    def num_cached_pages(self) -> int: ...
    @property
    def num_evictable_pages(self) -> int: ...
    @property
    def num_nodes(self) -> int: ...
    @property
    def namespaces(self) -> list[Any]: ...
    @property
    def eviction_index(self) -> EvictionIndex: ...
    def namespace_root(self, namespace: Any) -> TreeNode | None: ...
    def lookup_key(self, page: bytes) -> Any: ...
    def iter_nodes(self) -> Iterator[TreeNode]: ...


class TieredCacheView(CacheView, Protocol):
    """... and those of a TieredRadixCache that the host recount reads."""

    @property
    def host_pool(self) -> PagePool: ...
    @property
    def copies(self) -> Copies: ...
    @property
    def num_host_pages(self) -> int: ...
    @property
    def num_host_evictable_pages(self) -> int: ...
    @property
    def host_eviction_index(self) -> EvictionIndex: ...


def _fail(msg: str) -> NoReturn:
    raise InvariantError(msg)


def check_device_cache(cache: CacheView) -> None:
    """The trie, the device pool and the device eviction index (RadixCache.check_invariants)."""
    pool = cache.pool
    pool.check_invariants()
    pb = cache.page_size * TOKEN_BYTES
    root = cache.root
    if root.parent is not None or root.key or root._pages or root.lock_ref:
        _fail("root must have no parent, tokens, pages or lock count")

    seen_pages: set[int] = set()
    cached = evictable = nodes = 0
    expected_index: dict[int, int] = {}
    ns_seen: dict[object, object] = {}
    # event hashes are checked only when some node caches them (recomputing costs a pass)
    verify_hashes = any(n._hashes is not None for n in cache.iter_nodes())
    last_hash: dict[int, int | None] = {}  # node id -> chained hash of its last page
    key_of = cache.policy.key
    stack = [root]
    while stack:
        node = stack.pop()
        nodes += 1
        if node._cache is not cache:
            _fail(f"{node!r} belongs to another cache")
        if node.lock_ref < 0:
            _fail(f"negative lock count on {node!r}")
        if node.lock_ref < node.copies_in_flight:
            _fail(f"{node!r}: lock count below its copies in flight")
        children = list(node.iter_children())
        first_pages: set[bytes] = set()
        for c in children:
            if c.parent is not node:
                _fail(f"child {c!r} does not point back to its parent {node!r}")
            slot = node._children.get(c._hkey)
            if not (slot is c or (type(slot) is list and any(x is c for x in slot))):
                _fail(f"child {c!r} is not stored under its lookup key")
            if node is not root and c.lock_ref > node.lock_ref:
                _fail(f"child lock {c.lock_ref} > parent lock {node.lock_ref} at {c!r}")
            if c.key:
                first = c.key[:pb]
                if c._hkey != cache.lookup_key(first):
                    _fail(f"stale lookup key on {c!r}")
                if first in first_pages:
                    _fail(f"two children of {node!r} start with the same page")
                first_pages.add(first)
            stack.append(c)
        for slot in node._children.values():
            if type(slot) is list and len(slot) < 2:
                _fail("collision bucket with fewer than two nodes")
        if node is root:
            continue
        parent = node.parent
        if not node.key:  # namespace root
            if parent is not root or cache.namespace_root(node.namespace) is not node:
                _fail(f"unregistered namespace root {node!r}")
            if node._pages or node.depth_tokens:
                _fail("namespace root with pages or depth")
            if not children:
                _fail(f"empty namespace root {node.namespace!r} was not removed")
            ns_seen[node.namespace] = node
            continue
        if len(node.key) % pb:
            _fail(f"{node!r}: key is not a whole number of pages")
        # a node without device pages must be held elsewhere (only a host tier can)
        if not node._pages and not node.on_host:
            _fail(f"{node!r} is in neither tier")
        if node._pages and len(node._pages) * pb != len(node.key):
            _fail(f"{node!r}: {len(node._pages)} pages for {node.num_tokens} tokens")
        if node.namespace != parent.namespace:
            _fail(f"{node!r}: namespace differs from its parent's")
        if node.depth_tokens != parent.depth_tokens + node.num_tokens:
            _fail(f"{node!r}: depth_tokens does not add up")
        if verify_hashes:
            prev = last_hash[parent.node_id] if parent.key else chain_start(node.namespace)
            fresh = chain_hashes(prev, local_hashes_of_key(node.key, cache.page_size))
            last_hash[node.node_id] = fresh[-1]
            if node._hashes is not None and node._hashes != fresh:
                _fail(f"{node!r}: cached event hashes differ from a fresh computation")
        for p in node._pages:
            if p in seen_pages:
                _fail(f"page {p} is owned by two nodes")
            seen_pages.add(p)
            if type(p) is not int or not 0 <= p < pool.num_pages or pool.state(p) != "cached":
                _fail(f"trie page {p} is not CACHED in the pool")
        cached += len(node._pages)
        if node.lock_ref == 0:
            evictable += len(node._pages)
            # a candidate: device-resident with no device-resident child (without a host
            # tier every node is device-resident: a leaf)
            if node._pages and not any(c._pages for c in children):
                expected_index[node.node_id] = key_of(node)
        elif node in cache.eviction_index.keys:
            _fail(f"locked node {node!r} is in the eviction index")
    if ns_seen.keys() != set(cache.namespaces):
        _fail("namespace root registry differs from the trie")
    if pool.num_cached != cached or cached != cache.num_cached_pages:
        _fail(
            f"cached pages: pool {pool.num_cached}, counter {cache.num_cached_pages}, "
            f"recount {cached}"
        )
    if pool.num_free + cached + pool.num_held != pool.num_pages:
        _fail("free + cached + held != total")
    if evictable != cache.num_evictable_pages:
        _fail(f"evictable counter {cache.num_evictable_pages} != recount {evictable}")
    if nodes != cache.num_nodes:
        _fail(f"node counter {cache.num_nodes} != recount {nodes}")
    index = cache.eviction_index
    stored = index.stored_keys()
    if stored != expected_index:
        _fail(
            f"eviction index {sorted(stored.items())} != recount {sorted(expected_index.items())}"
        )
    err = index.check()
    if err:
        _fail(err)


def check_host_tier(cache: TieredCacheView) -> None:
    """The host pool, residency, copies in flight and the host eviction index
    (TieredRadixCache.check_invariants, after check_device_cache)."""
    host = cache.host_pool
    host.check_invariants()
    pb = cache.page_size * TOKEN_BYTES
    inflight: dict[int, int] = {}
    loading: dict[int, int] = {}
    for c in cache.copies:
        if c.ok is not None or not c.nodes or c.pin is not c.nodes[-1]:
            _fail(f"malformed copy in flight {c!r}")
        if c.pages != sum(len(n._host_pages or ()) for n in c.nodes):
            _fail(f"{c!r}: page count differs from its nodes' host pages")
        on_path = set()
        n = c.pin
        while n is not None:
            on_path.add(id(n))
            n = n.parent
        for n in c.nodes:
            if id(n) not in on_path or n.parent is None:
                _fail(f"{c!r}: {n!r} is not in the trie on the path of its pin")
            if not n._pages or n._host_pages is None:
                _fail(f"{c!r}: {n!r} lacks the pages being copied")
            inflight[n.node_id] = inflight.get(n.node_id, 0) + 1
            if c.kind == LOAD:
                loading[n.node_id] = loading.get(n.node_id, 0) + 1
    hindex = cache.host_eviction_index
    seen: set[int] = set()
    hcached = hevictable = 0
    expected: dict[int, int] = {}
    for node in cache.iter_nodes():
        children = list(node.iter_children())
        ndev = sum(1 for c in children if c._pages)
        nhost = sum(1 for c in children if c._host_pages is not None)
        if node._ndev != ndev or node._nhost != nhost:
            _fail(f"{node!r}: child counts device {node._ndev}/{ndev}, host {node._nhost}/{nhost}")
        if node._inflight != inflight.get(node.node_id, 0):
            _fail(f"{node!r}: {node._inflight} copies in flight, recount differs")
        if node._loading != loading.get(node.node_id, 0):
            _fail(f"{node!r}: {node._loading} loads in flight, recount differs")
        hp = node._host_pages
        if not node.key:
            if hp is not None or node in hindex.keys:
                _fail(f"{node!r}: a root with host pages")
            continue
        parent = node.parent
        if node._pages and parent.key and not parent._pages:
            _fail(f"{node!r} is device-resident below a host-only node")
        if hp is None:
            if node in hindex.keys:
                _fail(f"{node!r} without host pages is in the host eviction index")
            continue
        if len(hp) * pb != len(node.key):
            _fail(f"{node!r}: {len(hp)} host pages for {node.num_tokens} tokens")
        for p in hp:
            if p in seen:
                _fail(f"host page {p} is owned by two nodes")
            seen.add(p)
            if type(p) is not int or not 0 <= p < host.num_pages or host.state(p) != "cached":
                _fail(f"host page {p} is not CACHED in the host pool")
        hcached += len(hp)
        if node.lock_ref == 0:
            hevictable += len(hp)
            if not nhost:
                expected[node.node_id] = cache.policy.key(node)
    if host.num_cached != hcached or hcached != cache.num_host_pages:
        _fail(
            f"host pages: pool {host.num_cached}, counter {cache.num_host_pages}, recount {hcached}"
        )
    if host.num_free + hcached + host.num_held != host.num_pages:
        _fail("host pool: free + cached + held != total")
    if hevictable != cache.num_host_evictable_pages:
        _fail(f"host evictable counter {cache.num_host_evictable_pages} != recount {hevictable}")
    stored = hindex.stored_keys()
    if stored != expected:
        _fail(f"host eviction index {sorted(stored.items())} != recount {sorted(expected.items())}")
    err = hindex.check()
    if err:
        _fail(f"host index: {err}")
