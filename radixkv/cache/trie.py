"""TrieStore: the radix trie's structure and plumbing, shared by RadixCache.

Holds the root, the namespace roots, node ids and the logical clock, and implements the
non-public operations on nodes: the read-only walk, attaching/detaching children under their
child-lookup hash (with collision buckets), splitting a node at a page boundary, namespace
roots, lazily computed event hashes, and ownership checks. RadixCache (radix_cache.py) builds
the public API on top; it alone keeps the page counters and the eviction index.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from radixkv.cache.errors import ForeignNodeError
from radixkv.cache.hashing import HashFn, chain_hashes, chain_start, local_hashes_of_key
from radixkv.cache.node import TreeNode
from radixkv.cache.tokens import TOKEN_BYTES, TOKEN_SHIFT


def _common_pages(key: bytes, qb: bytes, off: int, limit: int, page_size: int) -> int:
    """Whole pages shared by ``key`` and ``qb[off:limit]`` (vectorised compare)."""
    n = min(len(key), limit - off) >> TOKEN_SHIFT
    a = np.frombuffer(key, np.int64, count=n)
    b = np.frombuffer(qb, np.int64, count=n, offset=off)
    diff = np.flatnonzero(a != b)
    return (int(diff[0]) if diff.size else n) // page_size


class TrieStore:
    """The trie of TreeNodes (see node.py) keyed by runs of whole pages."""

    def __init__(self, page_size: int, hash_fn: HashFn) -> None:
        self.page_size = page_size
        self._pb = page_size * TOKEN_BYTES  # bytes per page in a key
        self._hash_fn = hash_fn
        self._next_id = 0
        self._clock = 0  # logical time: bumped once per match or insert
        self.root = self._new_node(None, b"", [], None, 0)
        self._ns_roots: dict[Any, TreeNode] = {}
        self._num_nodes = 1
        self._splits = 0

    def iter_nodes(self) -> Iterator[TreeNode]:
        """Every node, root first (depth-first preorder)."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.iter_children())

    def path_pages(self, node: TreeNode) -> list[int]:
        """All pages from the root down to and including ``node``."""
        self._check_node(node)
        parts = []
        while node is not None:
            parts.append(node._pages)
            node = node.parent
        out: list[int] = []
        for p in reversed(parts):
            out += p
        return out

    def _walk(
        self, node: TreeNode, qb: bytes | memoryview, limit: int
    ) -> tuple[list[TreeNode], int, tuple[TreeNode, int] | None]:
        """Follow ``qb[:limit]`` down from ``node`` without mutating anything.

        ``qb`` is a query in the key encoding (bytes, or a read-only byte memoryview of the
        caller's array: no copy). Returns (fully matched nodes, matched bytes, (child, pages)
        when the match continues into ``pages`` whole pages of ``child`` but not all of it).
        """
        pb = self._pb
        hash_fn = self._hash_fn
        mv = qb if type(qb) is memoryview else memoryview(qb)  # slices without copying
        path: list[TreeNode] = []
        off = 0
        while off < limit:
            c = node._children.get(hash_fn(mv[off : off + pb]))
            if c is None:
                break
            if type(c) is list:  # hash collision bucket: tokens decide
                page = mv[off : off + pb]
                c = next((x for x in c if x.key.startswith(page)), None)
                if c is None:
                    break
            key = c.key
            end = off + len(key)
            if end <= limit and key.startswith(mv[off:end]):  # one memcmp for the whole node
                path.append(c)
                off = end
                node = c
                continue
            m = _common_pages(key, qb, off, limit, self.page_size)
            return path, off, ((c, m) if m else None)
        return path, off, None

    def _last_hash(self, node: TreeNode) -> int | None:
        """Chained hash of the last page ending at ``node`` (namespace start for roots)."""
        if not node.key:
            return chain_start(node.namespace)
        return self._node_hashes(node)[-1]

    def _node_hashes(self, node: TreeNode) -> list[int]:
        """Event hashes of ``node``'s own pages, computed (and cached) lazily top-down."""
        pending = []
        n = node
        while n._hashes is None and n.key:
            pending.append(n)
            n = n.parent
        prev = n._hashes[-1] if n.key else chain_start(n.namespace)
        for x in reversed(pending):
            x._hashes = chain_hashes(prev, local_hashes_of_key(x.key, self.page_size))
            prev = x._hashes[-1]
        return node._hashes

    def _new_node(
        self,
        parent: TreeNode | None,
        key: bytes,
        pages: list[int],
        namespace: Any,
        depth_tokens: int,
    ) -> TreeNode:
        self._next_id += 1
        return TreeNode(
            self, self._next_id, parent, key, pages, namespace, depth_tokens, self._clock
        )

    def _make_ns_root(self, namespace: Any) -> TreeNode:
        node = self._new_node(self.root, b"", [], namespace, 0)
        node._hkey = ("ns", namespace)  # never equal to an int page hash
        self.root._children[node._hkey] = node
        self._ns_roots[namespace] = node
        self._num_nodes += 1
        return node

    def _drop_ns_root(self, node: TreeNode) -> None:
        del self.root._children[node._hkey]
        del self._ns_roots[node.namespace]
        node.parent = None
        self._num_nodes -= 1

    def _attach(self, parent: TreeNode, child: TreeNode) -> None:
        h = self._hash_fn(child.key[: self._pb])
        child._hkey = h
        slot = parent._children.get(h)
        if slot is None:
            parent._children[h] = child
        elif type(slot) is list:
            slot.append(child)
        else:
            parent._children[h] = [slot, child]

    def _detach(self, parent: TreeNode, child: TreeNode) -> None:
        h = child._hkey
        slot = parent._children[h]
        if slot is child:
            del parent._children[h]
        else:
            slot.remove(child)
            if len(slot) == 1:
                parent._children[h] = slot[0]

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """Split ``child`` after its first ``m`` pages; return the new upper node.

        The existing node object keeps the lower part, so references held by callers (and
        lock counts, which the new node inherits) stay valid.
        """
        cut = m * self._pb
        parent = child.parent
        upper = self._new_node(
            parent,
            child.key[:cut],
            child._pages[:m],
            child.namespace,
            child.depth_tokens - ((len(child.key) - cut) >> TOKEN_SHIFT),
        )
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        upper.hit_count = child.hit_count
        h = child._hkey
        upper._hkey = h
        slot = parent._children[h]
        if slot is child:
            parent._children[h] = upper
        else:
            slot[slot.index(child)] = upper
        child.key = child.key[cut:]
        child._pages = child._pages[m:]
        child.parent = upper
        self._attach(upper, child)
        if child._hashes is not None:
            upper._hashes = child._hashes[:m]
            child._hashes = child._hashes[m:]
        self._num_nodes += 1
        self._splits += 1
        return upper

    def _check_node(self, node: TreeNode) -> None:
        if not isinstance(node, TreeNode):
            raise TypeError(f"expected a TreeNode, got {type(node).__name__}")
        if node._cache is not self:
            raise ForeignNodeError("node belongs to another RadixCache")
        if node.parent is None and node is not self.root:
            raise ForeignNodeError("node is no longer in the cache (evicted or reset)")
