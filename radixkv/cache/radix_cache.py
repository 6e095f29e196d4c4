"""RadixCache: a radix trie mapping page-aligned token prefixes to the device KV pages that hold them.

The device contract, on the trie of trie.py: match, peek, insert, lock, alloc, evict, reset,
the page counters, the eviction index (eviction.py) and the KV events (events.py). The
ownership contract is stated once, in the RadixCache docstring; the fast paths are explained
in docs/cache_design.md. A host tier is TieredRadixCache (tiered_cache.py), which extends this
class by overriding whole methods; ``build_cache`` (build.py) picks the class. MatchResult and
InsertResult, what match_prefix and insert return, are defined in results.py; the recounts of
``check_invariants`` in invariants.py.
"""

from __future__ import annotations

from array import array
from typing import Any

from radixkv.cache.errors import LockError, OutOfPages
from radixkv.cache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventEmitter,
    Listener,
)
from radixkv.cache.eviction import EvictionIndex, EvictionPolicy, get_policy
from radixkv.cache.hashing import HashFn
from radixkv.cache.invariants import check_device_cache
from radixkv.cache.node import TreeNode
from radixkv.cache.page_pool import PagePool
from radixkv.cache.pretty import render_dot, render_text
from radixkv.cache.results import InsertResult, MatchResult
from radixkv.cache.stats import CacheStats
from radixkv.cache.tiers import HostRun, LoadBack
from radixkv.cache.tokens import TOKEN_SHIFT, encode_tokens, key_to_list
from radixkv.cache.trie import Trie, common_pages, release_view

__all__ = ["ALL_NAMESPACES", "InsertResult", "MatchResult", "RadixCache", "check_count"]

# reset()'s default: every namespace (None already names the default namespace)
ALL_NAMESPACES: Any = object()


# The hot paths build results with tuple.__new__ / object.__new__, skipping the Python-level
# __new__ / __init__; the type and the fields are the same.
_new_tuple = tuple.__new__
_new_object = object.__new__


def check_count(what: str, n: Any) -> None:
    """``n`` must be a non-negative int (pages to alloc or evict); ValueError names ``what``."""
    if type(n) is not int or n < 0:
        raise ValueError(f"{what} needs a non-negative int, got {n!r}")


class RadixCache(Trie):
    """Prefix cache over a PagePool: a radix trie of whole pages, with locks and eviction.

    Ownership contract (stated here once; PagePool's docstring defines the page states):

    * Every page of the pool is in exactly one place: FREE in the pool, HELD by one caller
      (a running request), or CACHED, owned by exactly one trie node, so
      ``pool.num_free + pool.num_held + num_cached_pages == pool.num_pages`` after every call.
      Only whole pages are cached; a partial last page stays with its request.
    * ``match_prefix`` returns the cached pages of the longest cached page-aligned prefix.
      They stay owned by the trie: the caller must ``lock`` the returned node before the next
      call that may evict (``alloc``, ``evict``, ``insert``, ``reset``) and ``unlock`` it when
      done. A MatchResult or InsertResult whose node is not locked is valid only until such a
      call (eviction may truncate or remove the node; ``alloc`` and ``insert`` may merge it
      into a child).
    * The trie stays edge-compressed as requests publish their pages one page or chunk at a
      time (each publication adds a child to the last one): once such a run of nodes, each
      with a single child, is unlocked again (or locked only through its lowest node, as when
      a conversation's next turn locks the last turn's end), the next ``alloc`` or ``insert``
      merges it into its lowest node (that node object survives; the others leave the trie),
      so a long generated path, or a long conversation, costs one node to match, not one per
      page or turn. A node that is itself a lock target is never merged away. (TieredRadixCache
      keeps its runs: merging would have to join host copies too.)
    * ``insert(tokens, pages)`` takes ownership of every page passed: a page that already is
      the cached page for its tokens stays; another page whose tokens were cached already is
      a duplicate and goes back to the pool; the rest join the trie. Use
      ``InsertResult.pages`` afterwards, never a freed duplicate.
    * ``alloc(n)`` gives the caller ``n`` HELD pages, evicting unlocked leaves if the pool is
      short; the caller frees them (``pool.free``) or hands them to ``insert``.
    * A locked node and all its ancestors are never evicted. Lock counts nest, count along the
      path to the root (a parent's count is at least each child's) and never go negative.
    * A namespace partitions the trie: a lookup never sees pages inserted under another one.
    * Tokens are compared before a page is reused: a hash (``hash_fn``) only picks the
      candidate child, so a collision costs speed, never correctness.
    * Every error leaves the cache and the pool exactly as they were: each call checks all of
      its input before its first change. Not thread-safe.

    This class has no host tier: the host-tier queries that every cache answers (``host_pool``,
    ``num_host_pages``, ``copies_in_flight``, ``poll``, ``wait_all``, ``load_back``,
    ``wait_load``, ``host_runs``, ``host_eviction_order``) say so (None, 0, nothing to wait
    for, the match's own prefix, []). TieredRadixCache (tiered_cache.py) is the cache with one;
    ``build_cache`` (build.py) builds either from the same arguments.

    Args:
        pool: the PagePool whose page ids the trie owns; use one pool per cache.
        page_size: tokens per KV page; only whole pages are cached.
        policy: eviction order, "lru" (default) or "lfu", or an object with a ``name`` and a
            ``key(node) -> int`` method (smaller keys are evicted first; see eviction.py).
        hash_fn: child-lookup hash of one page, given as ``bytes`` holding the page's tokens in
            the key encoding (native int64); it must return the same int for equal bytes. Any
            function works, even a constant. The default, None, hashes nothing of its own: a
            node's children are keyed by the bytes of their first page (the dict hashes them),
            which is exact, so siblings never share a slot.
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
        super().__init__(page_size, hash_fn)
        self.policy = get_policy(policy)
        self.pool = pool
        # match_prefix and insert inline the walk for the default child keys (no hash_fn);
        # TieredRadixCache turns this off (its walks settle copies in flight)
        self._plain = hash_fn is None
        # page counters, kept incrementally (check_invariants recounts them)
        self._cached = 0  # pages in the trie
        self._evictable = 0  # pages in unlocked nodes
        # the eviction candidates: unlocked leaves that own pages (the hot paths test
        # ``not node._children`` before looking a node up; TieredRadixCache keeps its own rule)
        self._index = EvictionIndex(self.policy)
        self._events = EventEmitter()
        self._listeners = self._events.listeners  # the same list: a cheap emptiness test
        # cumulative counters (CacheStats); the cold ones are in self._cold (trie.py)
        self._match_queries = self._query_tokens = self._hit_tokens = 0
        self._insert_calls = self._inserted_pages = self._duplicate_pages = 0

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
    def eviction_index(self) -> EvictionIndex:
        """The device eviction index (read it; the cache keeps it)."""
        return self._index

    @property
    def stats(self) -> CacheStats:
        return CacheStats(
            match_queries=self._match_queries,
            query_tokens=self._query_tokens,
            hit_tokens=self._hit_tokens,
            insert_calls=self._insert_calls,
            inserted_pages=self._inserted_pages,
            duplicate_pages=self._duplicate_pages,
            evicted_pages=self._cold.evicted_pages,
            evicted_nodes=self._cold.evicted_nodes,
            splits=self._cold.splits,
            resets=self._cold.resets,
            merged_nodes=self._cold.merged_nodes,
            cached_pages=self._cached,
            evictable_pages=self._evictable,
            locked_pages=self._cached - self._evictable,
            free_pages=self.pool.num_free,
            num_nodes=self._num_nodes,
        )

    def eviction_order(self) -> list[TreeNode]:
        """The device eviction candidates, next victim first (for inspection and tests)."""
        return list(self._index)

    # ------------------------------------------------------------------ no host tier
    @property
    def host_pool(self) -> PagePool | None:
        """The host tier's PagePool (None: no host tier)."""
        return None

    @property
    def num_host_pages(self) -> int:
        """Host pages owned by nodes (0 without a host tier)."""
        return 0

    @property
    def num_host_evictable_pages(self) -> int:
        """Host pages of unlocked nodes (0 without a host tier)."""
        return 0

    @property
    def copies_in_flight(self) -> int:
        """Copies between the tiers issued and not retired yet (0 without a host tier)."""
        return 0

    def host_eviction_order(self) -> list[TreeNode]:
        """The host eviction candidates, next victim first ([] without a host tier)."""
        return []

    def poll(self) -> int:
        """Retire the copies between the tiers that have finished: none without a host tier."""
        return 0

    def wait_all(self) -> None:
        """Wait for every copy between the tiers: none without a host tier."""

    def load_back(self, match: MatchResult) -> LoadBack:
        """Load ``match``'s host continuation back to the device: without a host tier there is
        none, so this returns the match's own prefix (nothing copied)."""
        self._check_node(match.node)
        return LoadBack(match.node, list(match.pages), match.num_tokens)

    def wait_load(self, lb: LoadBack) -> bool:
        """Wait for ``lb``'s copy; True when ``lb.pages`` can be read (at once: no copy)."""
        return True

    def host_runs(self) -> list[HostRun]:
        """Every node with a valid host copy ([] without a host tier)."""
        return []

    # ======================================================================== match
    def match_prefix(self, tokens: Any, namespace: Any = None) -> MatchResult:
        """Longest cached prefix of ``tokens`` whose length is a multiple of page_size.

        A query shorter than a page, or a namespace that holds nothing, matches nothing (the
        result's node is then the global root). ``tokens`` must be a flat sequence of ints, each
        any int64 (TypeError/ValueError otherwise, before anything changes). Then: the query
        counts in the stats; the node the match ends inside is split (so the returned node ends
        exactly at the match); the clock ticks once and ``last_access``/``hit_count`` are
        refreshed along the path (and the eviction key of its last node; with LRU or LFU, lazily:
        EvictionIndex).
        """
        if type(tokens) is array and tokens.typecode == "q":
            qb: bytes | memoryview = memoryview(tokens).cast("B")  # read in place
        else:
            qb = encode_tokens(tokens)
        # No explicit release of the view on return: it dies with this frame. An exception
        # keeps the frame alive in its traceback, so there the view is released at once.
        try:
            if not self._plain:
                return self._match_walked(qb, namespace)
            # The default child keys: _walk inlined, the hot path.
            pb = self._pb
            nq = len(qb)
            limit = nq - nq % pb
            node = self.root if namespace is None else self._ns_roots.get(namespace)
            path: list[TreeNode] = []
            off = 0
            cut = None  # (child, pages) when the match ends inside a child
            if node is not None:
                while off < limit:
                    c = node._children.get(qb[off : off + pb].tobytes())
                    if c is None:
                        break
                    key = c.key
                    end = off + len(key)
                    if end <= limit and key.startswith(qb[off:end]):
                        path.append(c)
                        off = end
                        node = c
                        continue
                    m = common_pages(key, qb, off, limit, pb)
                    if m:
                        cut = (c, m)
                    break
            self._match_queries += 1
            self._query_tokens += nq >> TOKEN_SHIFT
            if cut is not None:
                path.append(self._split(*cut))
                off += cut[1] * pb
            if not path:
                root = self.root
                return MatchResult(root, [], 0, root)
            self._clock = clock = self._clock + 1
            for n in path:
                n.last_access = clock
                n.hit_count += 1
            last = path[-1]
            # only the last node of a path can be a leaf, and only a leaf can be indexed; a
            # lazy index (LRU, LFU) re-keys it only if it reaches the top (EvictionIndex)
            if not last._children and last in self._index.keys:
                index = self._index
                if index.lazy:
                    index.lagging.add(last)
                else:
                    index.refresh(last)
            ntok = off >> TOKEN_SHIFT
            self._hit_tokens += ntok
            # MatchResult(last, None, ntok, last) without the Python-level __init__ call;
            # pages stay unbuilt until read (MatchResult.pages)
            r = _new_object(MatchResult)
            r.node = r.host_node = last
            r._pages = None
            r.num_tokens = ntok
            r.host_pages = ()
            r.num_host_tokens = 0
            return r
        except BaseException:
            if type(qb) is memoryview:
                release_view(qb)
            raise

    def _match_walked(self, qb: bytes | memoryview, namespace: Any) -> MatchResult:
        """match_prefix through ``_walk`` (a user hash_fn, or a subclass's match)."""
        pb = self._pb
        nq = len(qb)
        limit = nq - nq % pb
        start = self.root if namespace is None else self._ns_roots.get(namespace)
        if start is None or limit == 0:
            path, off, partial = [], 0, None
        else:
            path, off, partial, _ = self._walk(start, qb, limit)
        self._match_queries += 1
        self._query_tokens += nq >> TOKEN_SHIFT
        return self._matched(path, off, partial)

    def _matched(
        self, path: list[TreeNode], off: int, partial: tuple[TreeNode, int] | None
    ) -> MatchResult:
        """A walk's result as a match: split the partial node, refresh the path."""
        if partial is not None:
            child, m = partial
            path.append(self._split(child, m))
            off += m * self._pb
        if not path:
            return MatchResult(self.root, [], 0, self.root)
        self._clock += 1
        clock = self._clock
        pages: list[int] = []
        for n in path:
            n.last_access = clock
            n.hit_count += 1
            pages += n._pages
        last = path[-1]
        if not last._children and last in self._index.keys:
            self._index.refresh(last)
        ntok = off >> TOKEN_SHIFT
        self._hit_tokens += ntok
        return MatchResult(last, pages, ntok, last)

    def peek_prefix(self, tokens: Any, namespace: Any = None, *, host: bool = False) -> int:
        """Tokens ``match_prefix`` would match now, changing nothing: no split, no access-time
        or hit-count refresh, no stats (for schedulers that only want to estimate hits).

        That is its ``num_tokens``; with ``host=True``, its ``num_tokens + num_host_tokens``
        (what a load back could add; the same without a host tier).
        """
        _, off, partial = self._peek_walk(tokens, namespace)
        if partial is not None:
            off += partial[1] * self._pb
        return off >> TOKEN_SHIFT

    def peek_pages(self, tokens: Any, namespace: Any = None) -> list[int]:
        """The pages ``match_prefix`` would return now (its device-resident ``pages``),
        changing nothing, like ``peek_prefix``: for schedulers whose estimate depends on which
        pages a hit would reuse (hybrid window KV asks whether their window slots survive).
        A new list the caller owns; the pages stay the trie's (nothing is locked)."""
        path, _, partial = self._peek_walk(tokens, namespace)
        pages: list[int] = []
        for n in path:
            pages += n._pages
        if partial is not None:
            pages += partial[0]._pages[: partial[1]]
        return pages

    def _peek_walk(
        self, tokens: Any, namespace: Any
    ) -> tuple[list[TreeNode], int, tuple[TreeNode, int] | None]:
        """``_walk`` of the whole pages of ``tokens`` under ``namespace`` (nothing when the
        namespace holds nothing): the path, matched bytes and partial node of the peeks."""
        qb = encode_tokens(tokens)
        try:
            start = self.root if namespace is None else self._ns_roots.get(namespace)
            limit = len(qb) - len(qb) % self._pb
            if start is None or limit == 0:
                return [], 0, None
            path, off, partial, _ = self._walk(start, qb, limit)
            return path, off, partial
        finally:
            if type(qb) is memoryview:
                release_view(qb)

    # ======================================================================== insert
    def insert(self, tokens: Any, pages: Any, namespace: Any = None) -> InsertResult:
        """Cache ``tokens`` (whole pages) held in ``pages``; takes ownership of ``pages``.

        ``len(tokens) == len(pages) * page_size`` is required. Each passed page must either be
        the page already cached for its tokens, or be HELD by the caller (from ``alloc``).
        Every check runs before the first change. The walk finds the cached part; a passed
        page there that is not the cached page is a duplicate; the pages past it are new and
        join the trie as one new leaf (one BlockStored event, when someone listens).
        The result's node ends at the last page; with no new page it is the cached path's last
        node (refreshed), and an empty insert returns the global root.
        """
        if self._merge_candidates:
            self._merge_runs()
        if type(tokens) is array and tokens.typecode == "q":
            qb: bytes | memoryview = memoryview(tokens).cast("B")  # read in place
        else:
            qb = encode_tokens(tokens)
        try:  # as in match_prefix: the view is released explicitly only on an exception
            if type(pages) is not list:
                pages = list(pages)
            pb = self._pb
            nq = len(qb)
            if nq != len(pages) * pb:
                raise self._size_error(nq, pages)
            if namespace is not None:
                hash(namespace)  # unhashable namespaces fail before any change
            start = self.root if namespace is None else self._ns_roots.get(namespace)
            path: list[TreeNode] = []
            partial = None
            off = 0
            h = None  # the lookup key of the page at ``off`` (the first one the walk did not find)
            if start is not None and pages:
                if self._plain:  # _walk inlined, as in match_prefix
                    node = start
                    while off < nq:
                        h = qb[off : off + pb].tobytes()
                        c = node._children.get(h)
                        if c is None:
                            break
                        key = c.key
                        end = off + len(key)
                        if end <= nq and key.startswith(qb[off:end]):
                            path.append(c)
                            off = end
                            node = c
                            continue
                        m = common_pages(key, qb, off, nq, pb)
                        if m:
                            partial = (c, m)
                        break
                    else:
                        h = None
                else:
                    path, off, partial, h = self._walk(start, qb, nq)
            canon: list[int] = []
            for n in path:
                canon += n._pages
            if partial is not None:
                canon += partial[0]._pages[: partial[1]]
            ncached = len(canon)
            # the new leaf's key: a copy of the caller's tokens past the cached part
            newkey = qb[ncached * pb :].tobytes()
            pool = self.pool
            # The last check of the call: pages that are the cached ones followed by a run of
            # HELD pages (what match + alloc hand out) are checked and adopted at once, and the
            # run is appended to canon (nothing below can fail); so are the cached ones followed
            # by any other HELD pages (a fragmented list: pages allocated a decode step at a
            # time), in one pass over them; anything else is checked here and adopted below.
            new = pool.adopt_run(pages, canon)
            adopted = new is not None
            if adopted:
                dups = []
            else:
                new = pages[ncached:]  # (a fresh list: the node's own)
                if len(new) > 1:
                    canon += new
                    # no duplicate, and the rest HELD: checked and adopted in one pass
                    adopted = pages == canon and pool.adopt_held(new)
                    if not adopted:
                        del canon[ncached:]
                dups = []
                if not adopted:
                    dups, new = self._check_passed(pages, canon)  # raises: nothing changed

            # ---- mutation starts: nothing below can fail (but a listener may raise at the end)
            self._insert_calls += 1
            self._clock = clock = self._clock + 1
            if partial is not None:
                path.append(self._split(*partial))
            for n in path:
                n.last_access = clock
            index = self._index
            if new:
                parent = path[-1] if path else (start or self._make_ns_root(namespace))
                k = len(new)
                self._next_id = nid = self._next_id + 1
                leaf = self._node_type(
                    self, nid, parent, newkey, new, namespace,
                    parent.depth_tokens + k * self.page_size, clock,
                )  # fmt: skip
                if not parent._children and parent in index.keys:  # a leaf no more
                    index.discard(parent)
                if self._plain and h is not None and ncached * pb == off:
                    leaf._hkey = h  # the walk found no child under h: the slot is free
                    parent._children[h] = leaf
                else:
                    self._attach(parent, leaf)
                if not adopted:
                    pool.adopt(new)
                    canon += new
                self._num_nodes += 1
                self._cached += k
                self._evictable += k
                self._inserted_pages += k
                index.add(leaf)
                node = leaf
            else:
                node = path[-1] if path else self.root
                if not node._children and node in index.keys:
                    index.refresh(node)
            if dups:
                pool.release_held(dups)
                self._duplicate_pages += len(dups)
            if new and self._listeners:
                self._events.emit(self._stored_event(leaf, None))
            return _new_tuple(InsertResult, (node, canon, ncached * self.page_size))
        except BaseException:
            if type(qb) is memoryview:
                release_view(qb)
            raise

    def _size_error(self, nq: int, pages: list[int]) -> ValueError:
        return ValueError(
            f"insert needs len(tokens) == len(pages) * page_size: got "
            f"{nq >> TOKEN_SHIFT} tokens and {len(pages)} pages with page_size "
            f"{self.page_size}"
        )

    def _check_passed(self, pages: list[int], canon: list[int]) -> tuple[list[int], list[int]]:
        """An insert's passed ``pages`` against the ``canon`` pages cached for their first
        tokens: (duplicates, the pages past the cached ones), both HELD (checked; raises with
        nothing changed otherwise)."""
        ncached = len(canon)
        pool = self.pool
        if ncached and pages[:ncached] != canon:
            dups = [p for p, q in zip(pages, canon) if p != q]
            checked = pool.check_held(dups + pages[ncached:])
            return checked[: len(dups)], checked[len(dups) :]
        return [], pool.check_held(pages[ncached:] if ncached else pages)

    # ======================================================================== locking
    def lock(self, node: TreeNode) -> None:
        """Protect ``node`` and its ancestors from eviction (counts nest)."""
        self._check_node(node)
        root = self.root
        while node is not root:
            if node.lock_ref == 0:
                self._evictable -= len(node._pages)
                if not node._children and node in self._index.keys:  # only leaves are indexed
                    self._index.discard(node)
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
        bottom = node
        while node is not root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node._pages)
                if not node._children and node._pages:
                    self._index.add(node)
            node = node.parent
        if bottom.lock_ref == 0 and len(bottom._children) <= 1:
            candidates = self._merge_candidates
            candidates.append(bottom)
            if len(candidates) > 4096:  # unlocks with no insert between: keep the newest
                del candidates[:2048]

    # ======================================================================== allocation, eviction
    def alloc(self, n: int) -> list[int]:
        """``n`` HELD pages from the pool, evicting unlocked leaves (policy order) if short.

        Raises OutOfPages, with nothing evicted, if free + evictable pages < n.
        """
        if type(n) is not int or n < 0:
            check_count("alloc", n)
        if self._merge_candidates:
            self._merge_runs()
        short = n - self.pool.num_free
        if short > 0:
            if short > self._evictable:
                raise OutOfPages(n, self.pool.num_free + self._evictable, "free or evictable")
            self.evict(short)
        return self.pool.alloc(n)

    def evict(self, num_pages: int) -> int:
        """Free up to ``num_pages`` pages from unlocked leaves in policy order; return the count.

        Never frees more than asked: a leaf larger than the remainder loses only its tail pages
        (a prefix of a cached prefix is still valid KV). The order is the policy's
        (eviction.py); what happens to a victim is ``_evict_node`` / ``_evict_tail``.
        """
        if type(num_pages) is not int or num_pages < 0:
            check_count("evict", num_pages)
        freed = 0
        index = self._index
        indexed = index.keys  # its truth: a candidate is left (no __len__ call)
        first = index.first
        evict_node = self._evict_node
        while freed < num_pages and indexed:
            node = first()
            k = len(node._pages)
            if k > num_pages - freed:
                self._evict_tail(node, num_pages - freed)
                return num_pages
            evict_node(node)
            freed += k
        return freed

    def _evict_tail(self, node: TreeNode, n: int) -> None:
        """Evict the last ``n`` pages of the victim ``node`` (fewer than it has). It keeps its
        place in the index: its key depends on access fields and id, which do not change."""
        hashes = self._node_hashes(node) if self._listeners else node._hashes
        drop = node._pages[-n:]
        del node._pages[-n:]  # in place, as in _split
        node.key = node.key[: -n * self._pb]
        node.depth_tokens -= n * self.page_size
        if hashes is not None:
            node._hashes = hashes[:-n]
        self.pool.release_cached(drop)
        self._cached -= n
        self._evictable -= n
        self._cold.evicted_pages += n
        if self._listeners:
            self._events.emit(BlockRemoved(hashes[-n:], node.namespace))

    def reset(self, *, namespace: Any = ALL_NAMESPACES) -> None:
        """Drop every unlocked node and free its pages; locked paths stay cached.

        ``namespace``: only that namespace's nodes (None: the shared default namespace's); by
        default every namespace's. Emits one BlockRemoved per removed node (and tier), or a
        single AllBlocksCleared when the whole trie went; a reset counts in the stats even when
        nothing was removed.
        """
        self._cold.resets += 1
        root = self.root
        every_ns = namespace is ALL_NAMESPACES
        top = root if every_ns or namespace is None else self._ns_roots.get(namespace)
        if top is None:
            return
        victims: list[TreeNode] = []  # roots of unlocked subtrees
        stack = [top]
        while stack:
            n = stack.pop()
            for c in n.iter_children():
                if n is root and not every_ns and not c.key:
                    continue  # another namespace's root
                (stack if c.lock_ref else victims).append(c)
        if not victims:
            return
        everything = every_ns and not any(c.lock_ref for c in root.iter_children())
        for v in victims:
            self._remove(v, evicted=False, quiet=everything)
        if everything and self._listeners:
            self._events.emit(AllBlocksCleared())

    # Pages leave the trie through _evict_tail and the method below, the one way nodes go.
    # They validate nothing: they are given unlocked nodes. Freed pages go back to their pool
    # and the counters drop first; events follow once the state is consistent, and only when
    # someone listens (event hashes cost a pass over the keys).
    def _remove(self, v: TreeNode, evicted: bool = True, quiet: bool = False) -> None:
        """Take the unlocked node ``v`` and everything below it out of the trie and free every
        page they own (TieredRadixCache extends this with the host pool). A parent left
        childless becomes an eviction candidate, or goes if it is an empty namespace root
        (``_after_removal``). ``evicted``: counts as eviction in the stats (not a reset).
        ``quiet``: no events (a reset that empties the trie announces AllBlocksCleared)."""
        parent = v.parent
        if not v._children and v.key:
            # A leaf that is not a namespace root: every victim of eviction. The same steps as
            # the subtree below without listing one (evict's cost per page is this branch's:
            # no list, no loop, no per-node lookups).
            pages = v._pages
            event = (
                BlockRemoved(self._node_hashes(v), v.namespace)
                if self._listeners and pages and not quiet
                else None
            )
            self._detach(parent, v)
            self._index.discard(v)
            k = len(pages)
            self.pool.release_cached(pages)
            v._pages = []
            v.parent = None
            self._cached -= k
            self._evictable -= k
            self._num_nodes -= 1
            if evicted:
                cold = self._cold
                cold.evicted_pages += k
                cold.evicted_nodes += 1
            if not parent._children and parent is not self.root:
                self._after_removal(parent)
            if event is not None:
                self._events.emit(event)
            return
        sub = [v]
        for n in sub:  # grows while iterating: breadth-first subtree listing
            sub.extend(n.iter_children())
        events = None
        if self._listeners and not quiet:  # built before the links their hashes chain along go
            events = [BlockRemoved(self._node_hashes(n), n.namespace) for n in sub if n._pages]
        self._detach(parent, v)
        if not v.key:  # a namespace root (a reset of every namespace)
            del self._ns_roots[v.namespace]
        discard = self._index.discard
        release = self.pool.release_cached
        freed = 0
        for n in sub:
            discard(n)
            pages = n._pages
            if pages:
                release(pages)
                freed += len(pages)
                n._pages = []
            n.parent = None
        self._cached -= freed
        self._evictable -= freed
        self._num_nodes -= len(sub)
        if evicted:
            cold = self._cold
            cold.evicted_pages += freed
            cold.evicted_nodes += len(sub)
        if parent is not self.root and not parent._children:
            self._after_removal(parent)
        if events is not None:
            for ev in events:
                self._events.emit(ev)

    # RadixCache's victims are leaves, removed whole
    _evict_node = _remove

    def _after_removal(self, parent: TreeNode) -> None:
        """``parent`` (not the global root) lost its last child to ``_remove``: a namespace
        root goes, an unlocked node becomes an eviction candidate."""
        if not parent.key:
            self._drop_ns_root(parent)
        elif parent.lock_ref == 0:
            self._index.add(parent)

    def _accessed(self, node: TreeNode) -> None:
        if node in self._index.keys:
            self._index.refresh(node)

    # ======================================================================== events
    def add_listener(self, fn: Listener) -> None:
        """Call ``fn(event)`` synchronously for every BlockStored/BlockRemoved/AllBlocksCleared."""
        self._events.add(fn)

    def remove_listener(self, fn: Listener) -> None:
        self._events.remove(fn)

    def _stored_event(self, n: TreeNode, medium: str | None) -> BlockStored:
        return BlockStored(
            self._node_hashes(n),
            self._last_hash(n.parent),
            key_to_list(n.key),
            self.page_size,
            n.namespace,
            medium,
        )

    # ======================================================================== diagnostics
    def check_invariants(self) -> None:
        """Recount everything against the incremental state; InvariantError on a violation.

        Checked (the error names the first violation; invariants.py): the pool's own
        invariants; page conservation (every trie page distinct and CACHED in the pool, the
        pool's CACHED count equal to the trie's page count, free + cached + held == total);
        shape (every non-root key a whole, non-zero number of pages owning ``len(key) /
        page_size`` pages, links and child-lookup keys agree, siblings start with different
        pages, depth_tokens adds up, namespaces are inherited, namespace roots registered,
        empty of tokens and never childless); locks (>= 0, a parent's count >= each child's,
        the root never counted); the cached, evictable and node counters; the eviction index
        (exactly the unlocked leaves that own pages, under their current key); cached event
        hashes (when any node has them) equal to a fresh computation.
        """
        check_device_cache(self)

    def pretty(self, max_tokens_shown: int = 8) -> str:
        """The trie as indented text, one line per node (see pretty.py)."""
        return render_text(self.root, self._header(), max_tokens_shown)

    def _header(self) -> str:
        return (
            f"root  [{self._cached} cached pages, {self.num_locked_pages} locked, "
            f"{self.pool.num_free} free, policy={self.policy.name}, page_size={self.page_size}]"
        )

    def to_dot(self) -> str:
        """The trie as Graphviz source (see pretty.py)."""
        return render_dot(self.iter_nodes(), self._index)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(page_size={self.page_size}, policy={self.policy.name!r}, "
            f"nodes={self._num_nodes}, cached_pages={self._cached}, "
            f"evictable_pages={self._evictable}, free_pages={self.pool.num_free})"
        )
