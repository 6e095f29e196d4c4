"""Trie: the structure under RadixCache, an edge-compressed radix trie of whole pages.

It owns the nodes (node.py) and everything about their shape: the one walk that match, peek
and insert share, splits, merges of single-child runs, the per-namespace roots, child lookup
keys and the chained event hashes of each node's pages. It knows nothing of page pools, locks
or eviction: RadixCache (radix_cache.py) builds the device cache on it, TieredRadixCache
(tiered_cache.py) the host tier on that. The hot paths of RadixCache inline ``_walk`` (see
there); everything else that reshapes the trie is here.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from radixkv.cache.errors import ForeignNodeError
from radixkv.cache.hashing import HashFn, chain_hashes, chain_start, local_hashes_of_key
from radixkv.cache.node import TreeNode, path_pages
from radixkv.cache.tokens import TOKEN_BYTES, TOKEN_SHIFT

__all__ = ["ColdCounters", "Trie", "common_pages", "release_view"]


def common_pages(key: bytes, mv: memoryview, off: int, limit: int, pb: int) -> int:
    """Whole pages shared by ``key`` and ``mv[off:limit]``: a binary search over page counts,
    each step one ``memcmp`` (``bytes.startswith`` at an offset) of the pages between the
    known-equal prefix and the probe, so the bytes compared add up to about one key."""
    lo = 0
    hi = min(len(key), limit - off) // pb
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if key.startswith(mv[off + lo * pb : off + mid * pb], lo * pb):
            lo = mid
        else:
            hi = mid - 1
    return lo


def release_view(view: memoryview) -> None:
    """Give the caller's array back (it cannot be resized while viewed)."""
    try:  # noqa: SIM105 (contextlib.suppress costs more than the release itself)
        view.release()
    except BufferError:  # a derived buffer still lives in a traceback: it goes with it
        pass


class ColdCounters:
    """CacheStats counters off the hot paths, in one object: the cache keeps its own
    attributes to at most 30, which CPython's instance layout needs for its fastest access."""

    __slots__ = ("evicted_nodes", "evicted_pages", "merged_nodes", "resets", "splits")

    def __init__(self) -> None:
        self.evicted_pages = self.evicted_nodes = self.resets = self.splits = 0
        self.merged_nodes = 0


class Trie:
    """The radix trie of whole pages that RadixCache extends (never used on its own).

    Nodes own their pages; the trie only moves them between nodes (split, merge) and never
    frees one. Node type: ``_node_type`` (TreeNode; TieredRadixCache's nodes have slots for the
    host tier). Children are filed in their parent's dict under their lookup key
    (``lookup_key``): the bytes of their first page by default, else ``hash_fn`` of them, with
    colliding children sharing a list.
    """

    _node_type: type[TreeNode] = TreeNode

    def __init__(self, page_size: int, hash_fn: HashFn | None) -> None:
        if type(page_size) is not int or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        if hash_fn is not None and not callable(hash_fn):
            raise TypeError("hash_fn must be callable(bytes) -> int")
        if hash_fn is not None:
            user_fn = hash_fn  # walks slice a view of the query: hand the user bytes

            def hash_fn(page: Any) -> int:
                return user_fn(bytes(page))

        self.page_size = page_size
        self._pb = page_size * TOKEN_BYTES  # bytes per page in a key
        # None: children are keyed by their first page's bytes themselves (the default)
        self._hash_fn = hash_fn
        self._next_id = 0
        self._clock = 0  # logical time: bumped once per match or insert
        self.root = self._new_node(None, b"", [], None, 0)
        self._ns_roots: dict[Any, TreeNode] = {}
        self._num_nodes = 1
        self._cold = ColdCounters()
        # nodes unlocked to zero that may end a run of single-child nodes: merged on the next
        # alloc or insert (RadixCache's docstring)
        self._merge_candidates: list[TreeNode] = []

    # ------------------------------------------------------------------ queries
    @property
    def namespaces(self) -> list[Any]:
        """The namespaces other than the default (None) that hold cached entries."""
        return list(self._ns_roots)

    def namespace_root(self, namespace: Any) -> TreeNode | None:
        """The root of ``namespace``'s entries (the global root for None; None when the
        namespace holds nothing)."""
        return self.root if namespace is None else self._ns_roots.get(namespace)

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    def iter_nodes(self) -> Iterator[TreeNode]:
        """Every node, root first (depth-first preorder)."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.iter_children())

    def path_pages(self, node: TreeNode) -> list[int]:
        """All device pages from the root down to and including ``node``."""
        self._check_node(node)
        return path_pages(node)

    def lookup_key(self, page: bytes) -> Any:
        """The key a child starting with ``page`` is filed under in its parent's dict."""
        return page if self._hash_fn is None else self._hash_fn(page)

    # ------------------------------------------------------------------ the one walk
    def _walk(
        self, node: TreeNode, qb: bytes | memoryview, limit: int
    ) -> tuple[list[TreeNode], int, tuple[TreeNode, int] | None, Any]:
        """Follow ``qb[:limit]`` down from ``node`` without mutating anything.

        The one walk behind match_prefix, peek_prefix and insert (their fast paths inline it
        for the default child keys). ``qb`` is a query in the key encoding (bytes, or a byte
        memoryview of the caller's array: no copy). Returns (fully matched nodes, matched
        bytes, (child, pages) when the match continues into ``pages`` whole pages of ``child``
        but not all of it, and the child-lookup hash of the page at the matched length when the
        walk computed it, else None: insert files its new leaf under it without computing it
        again).
        """
        pb = self._pb
        hash_fn = self._hash_fn
        mv = qb if type(qb) is memoryview else memoryview(qb)  # slices without copying
        path: list[TreeNode] = []
        off = 0
        while off < limit:
            if hash_fn is None:  # the default: the page's own bytes are the child key
                h = mv[off : off + pb].tobytes()
                c = node._children.get(h)
                if c is None:
                    return path, off, None, h
            else:
                h = hash_fn(mv[off : off + pb])
                c = node._children.get(h)
                if c is None:
                    return path, off, None, h
                if type(c) is list:  # hash collision bucket: tokens decide
                    page = mv[off : off + pb]
                    c = next((x for x in c if x.key.startswith(page)), None)
                    if c is None:
                        return path, off, None, h
            key = c.key
            end = off + len(key)
            if end <= limit and key.startswith(mv[off:end]):  # one memcmp for the whole node
                path.append(c)
                off = end
                node = c
                continue
            m = common_pages(key, mv, off, limit, pb)
            if m:
                return path, off, (c, m), None
            return path, off, None, h
        return path, off, None, None

    # ------------------------------------------------------------------ splits and merges
    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """Split ``child`` after its first ``m`` pages; return the new upper node.

        The existing node object keeps the lower part, so references held by callers (and
        lock counts, which the new node inherits) stay valid. Device pages and event hashes
        are cut here (TieredRadixCache cuts host pages too). The upper node has the lower
        one's residency, so neither the parent's counts nor any eviction index changes.
        """
        pb = self._pb
        cut = m * pb
        parent = child.parent
        key = child.key
        # The page list is cut in place, copying the shorter part (a copy costs a reference
        # count per page): a node's list is its own, never handed out (readers copy it).
        pages = child._pages
        if 2 * m >= len(pages):
            upper_pages, child._pages = pages, pages[m:]
            del pages[m:]
        else:
            upper_pages = pages[:m]
            del pages[:m]
        self._next_id = nid = self._next_id + 1
        upper = self._node_type(
            self, nid, parent, key[:cut], upper_pages, child.namespace,
            child.depth_tokens - ((len(key) - cut) >> TOKEN_SHIFT), self._clock,
        )  # fmt: skip
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        upper.hit_count = child.hit_count
        h = child._hkey
        upper._hkey = h
        siblings = parent._children
        slot = siblings[h]
        if slot is child:
            siblings[h] = upper
        else:
            slot[slot.index(child)] = upper
        # the lower part becomes the new node's only child: no slot to share (unlike _attach)
        lower = key[cut : cut + pb]
        hl = lower if self._hash_fn is None else self._hash_fn(lower)
        child.key = key[cut:]
        child.parent = upper
        child._hkey = hl
        upper._children[hl] = child
        if child._hashes is not None:
            upper._hashes = child._hashes[:m]
            child._hashes = child._hashes[m:]
        self._num_nodes += 1
        self._cold.splits += 1
        return upper

    def _merge_runs(self) -> None:
        """Merge the runs of single-child nodes through the candidates (RadixCache's
        docstring). Changes no page, lock, count of cached pages or event hash."""
        candidates, self._merge_candidates = self._merge_candidates, []
        for node in candidates:
            if node.parent is not None:  # still there
                self._merge_run(node)

    def _merge_run(self, node: TreeNode) -> None:
        """Merge every run on the path through ``node`` (from the end of its single-child
        descent up to the root) into the run's lowest node, which keeps its object, id and
        depth. A run is a chain of nodes each with a single child and the same lock count as
        that child: a node's count is its own locks plus its children's, so an equal count
        says that nobody locked the node itself (it is locked, if at all, only as an ancestor
        of the node below it), and merging it away leaves every lock target in the trie. An
        unlocked run (all zero) is the common case; a locked one is a conversation whose next
        turn locked the last turn's end before the run above it was merged."""
        low = node
        while len(low._children) == 1:
            (c,) = low._children.values()
            if type(c) is list:  # two children sharing a user hash's slot
                break
            low = c
        run: list[TreeNode] = []  # the nodes above ``low`` that it absorbs, bottom up
        x, up = low, low.parent
        while up.key:
            if (
                up.lock_ref == x.lock_ref
                and len(up._children) == 1
                and up._children.get(x._hkey) is x
            ):
                run.append(up)
            else:  # a branch point or a lock target: it ends this run, is the next one's low
                if run:
                    self._absorb(low, run)
                    run = []
                low = up
            x, up = up, up.parent
        if run:
            self._absorb(low, run)

    def _absorb(self, low: TreeNode, run: list[TreeNode]) -> None:
        """Merge ``run`` (the single-child nodes right above ``low``, bottom up) into ``low``."""
        run.reverse()  # top first
        top = run[0]
        parent = top.parent
        low.key = b"".join([u.key for u in run] + [low.key])
        # the top node's list grows in place (it leaves the trie): a run that a request
        # extends a turn at a time copies each turn's pages once, not the whole path each time
        pages = top._pages
        for u in run[1:]:
            pages += u._pages
        pages += low._pages
        low._pages = pages
        if low._hashes is not None and all(u._hashes is not None for u in run):
            low._hashes = [h for u in run for h in u._hashes] + low._hashes
        else:
            low._hashes = None  # recomputed from the parent's when needed
        # the run's most recent access and hit count, so the merged prefix is not evicted
        # before its busiest part would have been
        last = max(u.last_access for u in run)
        hits = max(u.hit_count for u in run)
        if last > low.last_access or hits > low.hit_count:
            low.last_access = max(low.last_access, last)
            low.hit_count = max(low.hit_count, hits)
            self._accessed(low)
        h = top._hkey
        slot = parent._children[h]
        if slot is top:
            parent._children[h] = low
        else:
            slot[slot.index(top)] = low
        low._hkey = h
        low.parent = parent
        for u in run:  # out of the trie, as an evicted node is
            u.parent = None
            u._children = {}
            u._pages = []
        self._num_nodes -= len(run)
        self._cold.merged_nodes += len(run)

    def _accessed(self, node: TreeNode) -> None:
        """``node``'s access fields changed outside a match or insert (a merge): RadixCache
        re-keys it where it is indexed."""

    # ------------------------------------------------------------------ nodes and links
    def _new_node(
        self,
        parent: TreeNode | None,
        key: bytes,
        pages: list[int],
        namespace: Any,
        depth_tokens: int,
    ) -> TreeNode:
        self._next_id += 1
        return self._node_type(
            self, self._next_id, parent, key, pages, namespace, depth_tokens, self._clock
        )

    def _attach(self, parent: TreeNode, child: TreeNode, h: Any = None) -> None:
        """File ``child`` under ``h``, the lookup key of its first page (computed when None;
        a list when a user hash function collides)."""
        if h is None:
            h = self.lookup_key(child.key[: self._pb])
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

    def _make_ns_root(self, namespace: Any) -> TreeNode:
        node = self._new_node(self.root, b"", [], namespace, 0)
        node._hkey = ("ns", namespace)  # never equal to a page's bytes or an int page hash
        self.root._children[node._hkey] = node
        self._ns_roots[namespace] = node
        self._num_nodes += 1
        return node

    def _drop_ns_root(self, node: TreeNode) -> None:
        del self.root._children[node._hkey]
        del self._ns_roots[node.namespace]
        node.parent = None
        self._num_nodes -= 1

    def _check_node(self, node: TreeNode) -> None:
        if not isinstance(node, TreeNode):
            raise TypeError(f"expected a TreeNode, got {type(node).__name__}")
        if node._cache is not self:
            raise ForeignNodeError("node belongs to another RadixCache")
        if node.parent is None and node is not self.root:
            raise ForeignNodeError("node is no longer in the cache (evicted or reset)")

    def _path_key(self, node: TreeNode) -> bytes:
        """Tokens from the start of the sequence through ``node`` (key encoding)."""
        parts: list[bytes] = []
        while node is not None and node.key:
            parts.append(node.key)
            node = node.parent
        return b"".join(reversed(parts))

    # ------------------------------------------------------------------ hash chains
    def _last_hash(self, node: TreeNode) -> int | None:
        """Chained event hash of the last page ending at ``node`` (namespace start for roots)."""
        if not node.key:
            return chain_start(node.namespace)
        return self._node_hashes(node)[-1]

    def _node_hashes(self, node: TreeNode) -> list[int]:
        """Event hashes of ``node``'s own pages, computed (and cached) lazily top-down."""
        pending: list[TreeNode] = []
        n = node
        while n._hashes is None and n.key:
            pending.append(n)
            n = n.parent
        prev = n._hashes[-1] if n.key else chain_start(n.namespace)
        for x in reversed(pending):
            x._hashes = chain_hashes(prev, local_hashes_of_key(x.key, self.page_size))
            prev = x._hashes[-1]
        return node._hashes
