"""RadixCache: a radix trie mapping page-aligned token prefixes to the KV pages that hold them.

One class owns the trie and everything that changes it: the nodes (node.py), the walk that
match, peek and insert share, splits, namespace roots, the page counters, the eviction index
(eviction.py), the KV events (events.py) and, when it has a host tier, where each node's pages
live and the copies between the tiers (the "host tier" section of the class; tiers.py defines
the copier it drives, the write policies and the tier's state). The ownership contract is
stated once, in the RadixCache docstring; the fast paths and the tier rules are explained in
docs/cache_design.md. MatchResult and InsertResult, what match_prefix and insert return, are
defined in results.py.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from typing import Any, NoReturn

from radixkv.cache.errors import ForeignNodeError, InvariantError, LockError, OutOfPages
from radixkv.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, EventEmitter, Listener
from radixkv.cache.eviction import EvictionIndex, EvictionPolicy, HostEvictionIndex, get_policy
from radixkv.cache.hashing import (
    HashFn,
    chain_hashes,
    chain_start,
    local_hashes_of_key,
)
from radixkv.cache.node import TieredTreeNode, TreeNode, path_pages
from radixkv.cache.page_pool import PagePool
from radixkv.cache.pretty import render_dot, render_text
from radixkv.cache.results import InsertResult, MatchResult
from radixkv.cache.stats import CacheStats
from radixkv.cache.tiers import (
    BACKUP,
    HOST_HIT,
    HOST_LEAVING,
    HOST_MEDIUM,
    HOST_STORED,
    LOAD,
    WRITE_BACK,
    WRITE_THROUGH,
    WRITE_THROUGH_SELECTIVE,
    Copier,
    HostObserver,
    HostRun,
    InFlight,
    LoadBack,
    TierState,
    check_tier_args,
)
from radixkv.cache.tokens import (
    TOKEN_BYTES,
    TOKEN_SHIFT,
    encode_tokens,
    key_to_list,
)

__all__ = ["ALL_NAMESPACES", "InsertResult", "MatchResult", "RadixCache"]

# reset()'s default: every namespace (None already names the default namespace)
ALL_NAMESPACES: Any = object()


# The hot paths build results with tuple.__new__ / object.__new__, skipping the Python-level
# __new__ / __init__; the type and the fields are the same.
_new_tuple = tuple.__new__
_new_object = object.__new__


def _common_pages(key: bytes, mv: memoryview, off: int, limit: int, pb: int) -> int:
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


def _fail(msg: str) -> NoReturn:
    raise InvariantError(msg)


def _release(view: memoryview) -> None:
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


class RadixCache:
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
      with a single child, is wholly unlocked again, the next ``alloc`` or ``insert`` merges
      it into its lowest node (that node object survives; the others leave the trie), so a
      long generated path costs one node to match, not one per page. Without a host tier.
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

    With a host tier (``host_pool`` and ``copier`` given; tiers.py defines the copier):

    * A node's pages are in the device pool, the host pool, or both (``node.residency``); the
      host pool's pages obey the same rule as the device pool's (free, held, or owned by one
      node), and ``num_cached_pages``, ``pages`` and every page count without "host" in its
      name still mean device pages. Device-resident nodes form a top-closed subtree (a
      device-resident node's parent is device-resident or a root), so ``match_prefix`` returns
      the device-resident prefix as before and, beyond it, the host continuation
      (``host_node``, ``host_pages``, ``num_host_tokens``).
    * ``load_back(match)`` gives the host continuation device pages (allocating, evicting if
      short; as much of it as fits) and starts ``copier.to_device`` on them. The loaded nodes
      are locked until the copy is retired; lock ``LoadBack.node`` before the next call that may
      evict, and call ``wait_load`` before anything reads ``LoadBack.pages``: it returns False
      if the copy failed, and then the loaded nodes are host-only again and their device pages
      free (a miss: match again). No other reader sees a page being loaded: ``match_prefix``
      and ``load_back`` wait for loads in flight on their path.
    * Device eviction takes unlocked device-resident nodes with no device-resident child, in
      policy order. A victim with a host copy stays in the trie, host-only; under
      ``write_back`` a victim without one is first backed up (a synchronous copy; host pages
      are found by host eviction); any other victim is removed with its host-only subtree
      (unlocked, as the victim is). ``evict(n)`` still frees exactly ``min(n, evictable)``
      device pages (a larger victim is split and loses its tail).
    * Host eviction (``evict_host``, or making room for a backup) takes unlocked host-resident
      nodes with no host-resident child, in policy order: a host-only one is removed, a
      device+host one only loses its host copy.
    * Backups: ``write_through`` backs up the inserted path, ``write_through_selective`` a
      device node once matches went through it ``write_through_threshold`` times, ``write_back``
      an unbacked victim of device eviction. A backup is skipped when the host tier has no
      room (``backup_skipped_pages``), and counts only once its copy succeeded; a failed one
      frees its host pages and the node stays device-only.
    * Locks cover both tiers: a locked node is evicted from neither. A copy in flight locks the
      deepest node it copies (so each node's lock count is at least its copies in flight) until
      it is retired: by ``poll()``, by ``wait_load``, or at the start of the next ``insert``,
      ``alloc``, ``evict``, ``evict_host``, ``load_back`` or ``reset`` (a call that then raises
      may have retired finished copies; nothing else changes).

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
        host_pool: the host tier's PagePool (ids of host-memory pages), or None for no host
            tier; a pool of its own, with at least one page, none of them in use.
        copier: moves pages between the tiers (tiers.Copier); required with ``host_pool``.
        write_policy: when device pages are backed up to the host tier: "write_through"
            (default), "write_through_selective" or "write_back" (see above). Checked even
            without a host tier, where it changes nothing.
        write_through_threshold: matches through a node before ``write_through_selective``
            backs it up (>= 1).
    """

    def __init__(
        self,
        pool: PagePool,
        page_size: int = 16,
        policy: str | EvictionPolicy = "lru",
        *,
        hash_fn: HashFn | None = None,
        host_pool: PagePool | None = None,
        copier: Copier | None = None,
        write_policy: str = WRITE_THROUGH,
        write_through_threshold: int = 1,
    ) -> None:
        if not isinstance(pool, PagePool):
            raise TypeError(f"pool must be a PagePool, got {type(pool).__name__}")
        if type(page_size) is not int or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        if hash_fn is not None and not callable(hash_fn):
            raise TypeError("hash_fn must be callable(bytes) -> int")
        check_tier_args(pool, host_pool, copier, write_policy, write_through_threshold)
        self.policy = get_policy(policy)
        if hash_fn is not None:
            user_fn = hash_fn  # walks slice a view of the query: hand the user bytes

            def hash_fn(page: Any) -> int:
                return user_fn(bytes(page))

        self.pool = pool
        self.page_size = page_size
        self._pb = page_size * TOKEN_BYTES  # bytes per page in a key
        # None: children are keyed by their first page's bytes themselves (the default)
        self._hash_fn = hash_fn
        self._plain = hash_fn is None and host_pool is None  # match_prefix's inlined walk
        self._node_type = TreeNode if host_pool is None else TieredTreeNode
        # the trie
        self._next_id = 0
        self._clock = 0  # logical time: bumped once per match or insert
        self.root = self._new_node(None, b"", [], None, 0)
        self._ns_roots: dict[Any, TreeNode] = {}
        # page counters, kept incrementally (check_invariants recounts them)
        self._num_nodes = 1
        self._cached = 0  # pages in the trie
        self._evictable = 0  # pages in unlocked nodes
        self._index = EvictionIndex(self.policy)
        self._events = EventEmitter()
        self._listeners = self._events.listeners  # the same list: a cheap emptiness test
        # cumulative counters (CacheStats)
        self._match_queries = self._query_tokens = self._hit_tokens = 0
        self._insert_calls = self._inserted_pages = self._duplicate_pages = 0
        self._cold = ColdCounters()
        # nodes unlocked to zero that may end a run of single-child nodes: insert merges them
        self._merge_candidates: list[TreeNode] = []
        # The host tier. self._host is None: no tier, and none of its code runs. Its state is
        # one object: few attributes on the cache keep CPython's fast attribute access (an
        # instance dict of more than 30 keys stops sharing its keys with the class's).
        self._host = host_pool
        self._copies: list[InFlight] = []  # issued, not yet retired (issue order)
        self._tier = TierState(host_pool, copier, write_policy, write_through_threshold)
        if host_pool is not None:
            self._tier.hindex = HostEvictionIndex(self.policy)

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
    def namespaces(self) -> list[Any]:
        """The namespaces other than the default (None) that hold cached entries."""
        return list(self._ns_roots)

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @property
    def host_pool(self) -> PagePool | None:
        """The host tier's PagePool (None: no host tier)."""
        return self._host

    @property
    def write_policy(self) -> str:
        return self._tier.write_policy

    @property
    def write_through_threshold(self) -> int:
        return self._tier.threshold

    @property
    def num_host_pages(self) -> int:
        """Host pages owned by nodes (0 without a host tier)."""
        return self._tier.host_cached

    @property
    def num_host_evictable_pages(self) -> int:
        """Host pages of unlocked nodes: all of them can be freed by repeated host eviction."""
        return self._tier.host_evictable

    @property
    def copies_in_flight(self) -> int:
        """Copies between the tiers issued and not retired yet."""
        return len(self._copies)

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
            host_hit_tokens=self._tier.host_hit_tokens,
            loaded_pages=self._tier.loaded_pages,
            load_failures=self._tier.load_failures,
            backup_pages=self._tier.backup_pages,
            write_back_pages=self._tier.write_back_pages,
            backup_failures=self._tier.backup_failures,
            backup_skipped_pages=self._tier.backup_skipped,
            demoted_pages=self._tier.demoted_pages,
            host_evicted_pages=self._tier.host_evicted_pages,
            host_inserted_pages=self._tier.host_inserted_pages,
            host_cached_pages=self._tier.host_cached,
            host_evictable_pages=self._tier.host_evictable,
            host_free_pages=self._host.num_free if self._host is not None else 0,
            copies_in_flight=len(self._copies),
        )

    def eviction_order(self) -> list[TreeNode]:
        """The device eviction candidates, next victim first (for inspection and tests)."""
        return list(self._index)

    def host_eviction_order(self) -> list[TreeNode]:
        """The host eviction candidates, next victim first ([] without a host tier)."""
        return [] if self._tier.hindex is None else list(self._tier.hindex)

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

    # ======================================================================== match
    def match_prefix(self, tokens: Any, namespace: Any = None) -> MatchResult:
        """Longest cached prefix of ``tokens`` whose length is a multiple of page_size.

        A query shorter than a page, or a namespace that holds nothing, matches nothing (the
        result's node is then the global root). ``tokens`` must be a flat sequence of ints, each
        any int64 (TypeError/ValueError otherwise, before anything changes). Then: the query
        counts in the stats; the node the match ends inside is split (so the returned node ends
        exactly at the match); the clock ticks once and ``last_access``/``hit_count`` are
        refreshed along the path, and the eviction key of its last node.

        With a host tier the walk also follows host-only nodes: the result's first three fields
        cover the device-resident part, the last three the host continuation below it. Loads
        still in flight on the path are waited for first, and ``write_through_selective`` may
        start backups of the path's hot nodes (making room by host eviction elsewhere).
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
            # The plain cache (no hash_fn, no host tier): _walk inlined, the hot path.
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
                    m = _common_pages(key, qb, off, limit, pb)
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
            if last._ekey is not None:  # only the last node of a path can be a leaf
                self._index.refresh(last)
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
                _release(qb)
            raise

    def _match_walked(self, qb: bytes | memoryview, namespace: Any) -> MatchResult:
        """match_prefix through ``_walk``: with a user hash_fn or a host tier."""
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
        if self._host is not None:
            return MatchResult(*self._match_tiered(path, off, partial))
        if partial is not None:
            child, m = partial
            path.append(self._split(child, m))
            off += m * pb
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
        if last._ekey is not None:
            self._index.refresh(last)
        ntok = off >> TOKEN_SHIFT
        self._hit_tokens += ntok
        return MatchResult(last, pages, ntok, last)

    def peek_prefix(self, tokens: Any, namespace: Any = None, *, host: bool = False) -> int:
        """Tokens ``match_prefix`` would match now, changing nothing: no split, no access-time
        or hit-count refresh, no stats (for schedulers that only want to estimate hits).

        That is its ``num_tokens``, the device-resident prefix; with ``host=True``, its
        ``num_tokens + num_host_tokens`` (what a load back could add; the same without a tier).
        """
        path, off, partial = self._peek_walk(tokens, namespace)
        if partial is not None:
            off += partial[1] * self._pb
        if host or self._host is None or (partial is not None and partial[0]._pages):
            return off >> TOKEN_SHIFT
        # the device-resident part ends at the last device-resident node of the path
        return next((n.depth_tokens for n in reversed(path) if n._pages), 0)

    def peek_pages(self, tokens: Any, namespace: Any = None) -> list[int]:
        """The pages ``match_prefix`` would return now (its device-resident ``pages``),
        changing nothing, like ``peek_prefix``: for schedulers whose estimate depends on which
        pages a hit would reuse (hybrid window KV asks whether their window slots survive).
        A new list the caller owns; the pages stay the trie's (nothing is locked)."""
        path, _, partial = self._peek_walk(tokens, namespace)
        pages: list[int] = []
        for n in path:  # a device-resident node's ancestors are device-resident
            if not n._pages:
                return pages
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
                _release(qb)

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

        With a host tier, passed pages for tokens cached only in host memory (the walk goes
        through host-only nodes) must be HELD too: they become those nodes' device pages (the
        nodes are device+host again, one BlockStored each). Under ``write_through`` the path's
        nodes without a host copy are then backed up.
        """
        if self._copies:
            self.poll()
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
                raise ValueError(
                    f"insert needs len(tokens) == len(pages) * page_size: got "
                    f"{nq >> TOKEN_SHIFT} tokens and {len(pages)} pages with page_size "
                    f"{self.page_size}"
                )
            if namespace is not None:
                hash(namespace)  # unhashable namespaces fail before any change
            start = self.root if namespace is None else self._ns_roots.get(namespace)
            host = self._host
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
                        m = _common_pages(key, qb, off, nq, pb)
                        if m:
                            partial = (c, m)
                        break
                    else:
                        h = None
                else:
                    path, off, partial, h = self._walk(start, qb, nq)
                    if host is not None:
                        self._settle_walk(path, partial)
            canon: list[int] = []
            for n in path:
                canon += n._pages
            if partial is not None:
                canon += partial[0]._pages[: partial[1]]
            ncached = len(canon)
            # pages cached in host memory only, right after the device-resident ones
            nold = ncached
            if host is not None:
                nold = off // pb + (partial[1] if partial is not None else 0)
            # the new leaf's key: a copy of the caller's tokens past the cached part
            cached_b = nold * pb  # bytes of the query already cached
            newkey = qb[cached_b:].tobytes()
            pool = self.pool
            # The last check of the call: pages that are the cached ones followed by a run of
            # HELD pages (what match + alloc hand out) are checked and adopted at once, and the
            # run is appended to canon (nothing below can fail); anything else is checked here
            # and adopted below.
            new = pool.adopt_run(pages, canon) if host is None else None
            adopted = new is not None
            if adopted:
                dups = []
            elif ncached and pages[:ncached] != canon:
                dups = [p for p, q in zip(pages, canon) if p != q]
                checked = pool.check_held(dups + pages[ncached:])  # raises: nothing changed yet
                dups, new = checked[: len(dups)], checked[len(dups) :]
            else:
                dups = []
                new = pool.check_held(pages[ncached:] if ncached else pages)  # raises
            if nold > ncached:
                promote, new = new[: nold - ncached], new[nold - ncached :]

            # ---- mutation starts: nothing below can fail (but a listener may raise at the end)
            self._insert_calls += 1
            self._clock = clock = self._clock + 1
            if partial is not None:
                path.append(self._split(*partial))
            for n in path:
                n.last_access = clock
            promoted = None
            if nold > ncached:
                promoted = self._promote(path, promote)
                canon += promote
            if new:
                parent = path[-1] if path else (start or self._make_ns_root(namespace))
                k = len(new)
                self._next_id = nid = self._next_id + 1
                leaf = self._node_type(
                    self, nid, parent, newkey, new, namespace,
                    parent.depth_tokens + k * self.page_size, clock,
                )  # fmt: skip
                if parent._ekey is not None:  # a leaf no more
                    self._index.discard(parent)
                if self._plain and h is not None and nold * pb == off:
                    leaf._hkey = h  # the walk found no child under h: the slot is free
                    parent._children[h] = leaf
                else:
                    self._attach(parent, leaf)
                if not adopted:
                    pool.adopt(new)
                    canon += new
                if host is not None:
                    parent._ndev += 1
                self._num_nodes += 1
                self._cached += k
                self._evictable += k
                self._inserted_pages += k
                self._index.add(leaf)
                node = leaf
            else:
                node = path[-1] if path else self.root
                if node._ekey is not None:
                    self._index.refresh(node)
            if dups:
                pool.release_held(dups)
                self._duplicate_pages += len(dups)
            if host is not None:
                self._after_insert(path, leaf if new else None, promoted)
            if new and self._listeners:
                self._events.emit(
                    BlockStored(
                        self._node_hashes(leaf),
                        self._last_hash(parent),
                        key_to_list(leaf.key),
                        self.page_size,
                        namespace,
                    )
                )
            return _new_tuple(InsertResult, (node, canon, ncached * self.page_size))
        except BaseException:
            if type(qb) is memoryview:
                _release(qb)
            raise

    # ======================================================================== locking
    def lock(self, node: TreeNode) -> None:
        """Protect ``node`` and its ancestors from eviction (counts nest), in both tiers."""
        self._check_node(node)
        if self._host is not None:
            return self._lock_tiered(node)
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
        if self._host is not None:
            return self._unlock_tiered(node)
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
            raise ValueError(f"alloc needs a non-negative int, got {n!r}")
        if self._copies:
            self.poll()
        if self._merge_candidates:
            self._merge_runs()
        short = n - self.pool.num_free
        if short > 0:
            if short > self._evictable:
                raise OutOfPages(n, self.pool.num_free + self._evictable, "free or evictable")
            if self._host is not None:
                self._evict_device(short)
            else:
                self.evict(short)
        return self.pool.alloc(n)

    def evict(self, num_pages: int) -> int:
        """Free up to ``num_pages`` pages from unlocked leaves in policy order; return the count.

        Never frees more than asked: a leaf larger than the remainder loses only its tail pages
        (a prefix of a cached prefix is still valid KV). The order is the policy's
        (eviction.py); what happens to a victim is ``_truncate_leaf`` / ``_remove_leaf``, or
        with a host tier ``_evict_device`` (victims are then demoted to host-only when backed).
        """
        if type(num_pages) is not int or num_pages < 0:
            raise ValueError(f"evict needs a non-negative int, got {num_pages!r}")
        if self._host is not None:
            if self._copies:
                self.poll()
            return self._evict_device(num_pages)
        freed = 0
        index = self._index
        while freed < num_pages and len(index):
            node = index.first()
            k = len(node._pages)
            need = num_pages - freed
            if k > need:
                self._truncate_leaf(node, need)
                return num_pages
            index.discard(node)
            self._remove_leaf(node)
            freed += k
        return freed

    def reset(self, *, namespace: Any = ALL_NAMESPACES) -> None:
        """Drop every unlocked node and free its pages; locked paths stay cached.

        ``namespace``: only that namespace's nodes (None: the shared default namespace's); by
        default every namespace's. Emits one BlockRemoved per removed node (and tier), or a
        single AllBlocksCleared when the whole trie went; a reset counts in the stats even when
        nothing was removed. With a host tier, unlocked nodes go from both tiers; copies in
        flight lock theirs, which stay.
        """
        self._cold.resets += 1
        if self._copies:
            self.poll()
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
        removed: list[TreeNode] = []
        for v in victims:
            sub = [v]
            for n in sub:  # grows while iterating: breadth-first subtree listing
                sub.extend(n.iter_children())
            removed += sub
        hashes: dict[int, list[int]] = {}
        if self._listeners and not everything:  # before the links they chain along go
            hashes = {n.node_id: self._node_hashes(n) for n in removed if n.key}
        host = self._host
        for v in victims:
            parent = v.parent
            self._detach(parent, v)
            if not v.key:
                del self._ns_roots[v.namespace]
            elif host is not None:
                parent._ndev -= bool(v._pages)
                parent._nhost -= v._host_pages is not None
        if top is not root and not top._children:
            self._drop_ns_root(top)  # emptied (a locked node below would have kept a child)
        freed: list[int] = []
        on_device: list[TreeNode] = []
        on_host: list[TreeNode] = []
        for n in removed:
            self._index.discard(n)
            if n._pages:
                on_device.append(n)
                freed += n._pages
                n._pages = []
            n.parent = None
        if host is not None:
            host_freed: list[int] = []
            for n in removed:
                self._tier.hindex.discard(n)
                if n._host_pages is not None:
                    on_host.append(n)
                    host_freed += n._host_pages
                    n._host_pages = None
            host.release_cached(host_freed)
            self._tier.host_cached -= len(host_freed)
            self._tier.host_evictable -= len(host_freed)
            self._tier.host_evicted_pages += len(host_freed)
        self.pool.release_cached(freed)
        self._num_nodes -= len(removed)
        self._cached -= len(freed)
        self._evictable -= len(freed)
        if self._listeners:
            if everything:
                self._events.emit(AllBlocksCleared())
            else:
                for n in on_device:
                    self._events.emit(BlockRemoved(hashes[n.node_id], n.namespace))
                for n in on_host:
                    self._events.emit(BlockRemoved(hashes[n.node_id], n.namespace, HOST_MEDIUM))

    # Pages leave the trie only through the two methods below (and reset). They validate
    # nothing: they are given unlocked leaves. Freed pages go back to the pool and the counters
    # drop first; events follow once the state is consistent, and only when someone listens
    # (event hashes cost a pass over the keys).
    def _truncate_leaf(self, node: TreeNode, n: int) -> None:
        """Drop the last ``n`` pages of an evictable leaf. It keeps its place in the index:
        its key depends on access fields and id, which do not change."""
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

    def _remove_leaf(self, node: TreeNode) -> None:
        """Remove an unlocked leaf already taken out of the index and free its pages. A parent
        left childless and unlocked becomes a candidate, or goes if it is a namespace root."""
        hashes = self._node_hashes(node) if self._listeners else None
        parent = node.parent
        self._detach(parent, node)
        node.parent = None
        k = len(node._pages)
        self.pool.release_cached(node._pages)
        node._pages = []
        self._num_nodes -= 1
        self._cached -= k
        self._evictable -= k
        self._cold.evicted_pages += k
        self._cold.evicted_nodes += 1
        if not parent._children and parent is not self.root and parent.lock_ref == 0:
            if parent.key:
                self._index.add(parent)
            else:
                self._drop_ns_root(parent)
        if hashes is not None:
            self._events.emit(BlockRemoved(hashes, node.namespace))

    # ======================================================================== events
    def add_listener(self, fn: Listener) -> None:
        """Call ``fn(event)`` synchronously for every BlockStored/BlockRemoved/AllBlocksCleared."""
        self._events.add(fn)

    def remove_listener(self, fn: Listener) -> None:
        self._events.remove(fn)

    # ======================================================================== the trie's structure
    def _walk(
        self, node: TreeNode, qb: bytes | memoryview, limit: int
    ) -> tuple[list[TreeNode], int, tuple[TreeNode, int] | None, Any]:
        """Follow ``qb[:limit]`` down from ``node`` without mutating anything.

        The one walk behind match_prefix, peek_prefix and insert. ``qb`` is a query in the key
        encoding (bytes, or a byte memoryview of the caller's array: no copy). Returns (fully
        matched nodes, matched bytes, (child, pages) when the match continues into ``pages``
        whole pages of ``child`` but not all of it, and the child-lookup hash of the page at
        the matched length when the walk computed it, else None: insert files its new leaf
        under it without computing it again).
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
            m = _common_pages(key, mv, off, limit, pb)
            if m:
                return path, off, (c, m), None
            return path, off, None, h
        return path, off, None, None

    def _merge_runs(self) -> None:
        """Merge the runs of single-child nodes through the unlocked candidates (class
        docstring). Changes no page, lock, count of cached pages or event hash."""
        candidates, self._merge_candidates = self._merge_candidates, []
        for node in candidates:
            if node.parent is not None and not node.lock_ref:  # still there, still unlocked
                self._merge_run(node)

    def _merge_run(self, node: TreeNode) -> None:
        """Merge every run of single-child unlocked nodes on the path through ``node`` (from
        the end of its single-child descent up to the first locked node or root) into the
        run's lowest node, which keeps its object, id and depth. A lock count is at least each
        child's, so everything below an unlocked node is unlocked."""
        low = node
        while len(low._children) == 1:
            (c,) = low._children.values()
            if type(c) is list:  # two children sharing a user hash's slot
                break
            low = c
        run: list[TreeNode] = []  # the nodes above ``low`` that it absorbs, bottom up
        x, up = low, low.parent
        while up.key and not up.lock_ref:
            if len(up._children) == 1 and up._children.get(x._hkey) is x:
                run.append(up)
            else:  # a branch point: it ends this run and is the lowest node of the next
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
        pages: list[int] = []
        for u in run:
            pages += u._pages
        low._pages = pages + low._pages
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
            if low._ekey is not None:
                self._index.refresh(low)
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

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """Split ``child`` after its first ``m`` pages; return the new upper node.

        The existing node object keeps the lower part, so references held by callers (and
        lock counts, which the new node inherits) stay valid. Everything a node holds per page
        (device pages, host pages, event hashes) is cut here, at one place. The upper node has
        the lower one's residency, so neither the parent's counts nor either eviction index
        changes (a node with copies in flight is never split: callers settle it first).
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
        if self._host is not None:
            hp = child._host_pages
            if hp is not None:
                upper._host_pages = hp[:m]
                child._host_pages = hp[m:]
                upper._nhost = 1
            upper._ndev = 1 if child._pages else 0
        self._num_nodes += 1
        self._cold.splits += 1
        return upper

    # ------------------------------------------------------------------ host tier
    # Everything below up to _new_node runs only with a host_pool (see the class docstring's
    # tier rules and docs/cache_design.md, "Tiers"); with host_pool=None none of it is reached.
    def load_back(self, match: MatchResult) -> LoadBack:
        """Give ``match``'s host continuation device pages and start copying it there.

        Works from the trie as it is now, below ``match.host_node`` (which must still be in the
        cache): the host-only nodes between it and its deepest device-resident ancestor are
        locked, get device pages (``alloc``: evicting if short; only as many pages as free +
        evictable allow, splitting a node if needed, so possibly a prefix of the continuation
        or nothing), and ``copier.to_device`` starts. They stay locked until the copy is
        retired. Loads already in flight on the path are waited for first.

        Returns a LoadBack whose ``node`` ends the device-resident prefix (lock it) and whose
        ``pages`` cover it; ``wait_load(lb)`` before reading them. A copier that raises here
        makes the continuation a miss: nothing stays allocated or locked, and ``lb.error`` says
        why. Without a host tier this returns the match's own prefix.
        """
        node = match.host_node if match.host_node is not None else match.node
        self._check_node(node)
        if self._host is None:
            return LoadBack(match.node, list(match.pages), match.num_tokens)
        if self._copies:
            self.poll()
        loading = []  # a load in flight above would be read before it lands
        n = node
        while n is not None:
            if n._loading:
                loading.append(n)
            n = n.parent
        if loading:
            self._settle(loading)
        chain: list[TreeNode] = []  # the host-only nodes to load, bottom-up for now
        n = node
        while n.key and not n._pages:
            chain.append(n)
            n = n.parent
        if not chain:
            return self._prefix_result(node)
        chain.reverse()
        frontier = chain[0].parent
        self.lock(node)  # host pages stay, and the device path above cannot be evicted
        want = sum(len(x._host_pages) for x in chain)
        room = self.pool.num_free + self._evictable
        if room < want:  # load the longest prefix of the continuation that fits
            kept: list[TreeNode] = []
            total = 0
            for x in chain:
                k = len(x._host_pages)
                if total + k > room:
                    if room > total:
                        kept.append(self._split(x, room - total))
                        total = room
                    break
                kept.append(x)
                total += k
            if not kept:
                self.unlock(node)
                return self._prefix_result(frontier)
            self.lock(kept[-1])  # the pin moves up to the last node loaded
            self.unlock(node)
            chain, want = kept, total
        dev = self._alloc_device(want)
        pairs: list[tuple[int, int]] = []
        i = 0
        for x in chain:
            hp = x._host_pages
            d = dev[i : i + len(hp)]
            i += len(hp)
            self._set_device(x, d)
            pairs += zip(hp, d)
            x._inflight += 1
            x._loading += 1
        pin = chain[-1]
        try:
            handle = self._tier.copier.to_device(pairs)
        except Exception as e:  # the copier failed at once: a miss, nothing left behind
            for x in reversed(chain):
                x._inflight -= 1
                x._loading -= 1
                self._clear_device(x)
            self.unlock(pin)
            self._tier.load_failures += 1
            lb = self._prefix_result(frontier)
            lb.error = e
            return lb
        rec = InFlight(LOAD, handle, chain, want)
        self._copies.append(rec)
        return LoadBack(
            pin,
            self.path_pages(pin),
            pin.depth_tokens,
            want * self.page_size,
            pairs,
            handle,
            None,
            rec,
        )

    def wait_load(self, lb: LoadBack) -> bool:
        """Wait for ``lb``'s copy and retire it; True when ``lb.pages`` can be read.

        False when the copy failed: the loaded nodes are then host-only again and their device
        pages back in the pool, so ``lb.pages`` past the device prefix are not the request's any
        more; unlock ``lb.node`` and match again (a miss). True at once when nothing was copied,
        including a load that failed when issued (``lb.error``): ``lb`` then only covers the
        device prefix, which is valid.
        """
        c = lb._copy
        if c is None:
            return True
        if c.ok is None:
            self._copies.remove(c)
            self._retire(c)
        return bool(c.ok)

    def poll(self) -> int:
        """Retire every copy that has finished (never blocks); return how many.

        A finished backup becomes a valid host copy (BlockStored, medium "CPU"), a finished
        load a device copy (BlockStored, medium None); a failed one is undone (its host pages,
        or device pages, go back to their pool). Either way its nodes are unlocked.
        """
        retired = 0
        for c in list(self._copies):
            try:
                finished = c.handle.done()
            except Exception:  # a handle that cannot tell: wait() will say what happened
                finished = True
            if finished:
                self._copies.remove(c)
                self._retire(c)
                retired += 1
        return retired

    def wait_all(self) -> None:
        """Wait for every copy in flight and retire it (before shutdown, or in tests)."""
        while self._copies:
            self._retire(self._copies.pop(0))

    def evict_host(self, num_pages: int) -> int:
        """Free up to ``num_pages`` host pages in policy order; return the count.

        Victims are unlocked host-resident nodes with no host-resident child: a host-only one
        leaves the trie, a device+host one keeps its device pages. Never frees more than asked
        (a larger victim is split first). ValueError without a host tier.
        """
        if type(num_pages) is not int or num_pages < 0:
            raise ValueError(f"evict_host needs a non-negative int, got {num_pages!r}")
        if self._host is None:
            raise ValueError("this RadixCache has no host tier (no host_pool)")
        if self._copies:
            self.poll()
        return self._evict_host(num_pages)

    def alloc_host(self, n: int) -> list[int]:
        """``n`` HELD host pages, host-evicting unlocked nodes (policy order) if short.

        For data that enters the host tier from elsewhere (storage): fill the pages, then hand
        them to ``insert_host`` (or free them with ``host_pool.free``). Raises OutOfPages, with
        nothing evicted, if free + evictable host pages < n; ValueError without a host tier.
        """
        if type(n) is not int or n < 0:
            raise ValueError(f"alloc_host needs a non-negative int, got {n!r}")
        if self._host is None:
            raise ValueError("this RadixCache has no host tier (no host_pool)")
        if self._copies:
            self.poll()
        pages = self._alloc_host(n)
        if pages is None:
            host = self._host
            raise OutOfPages(n, host.num_free + self._tier.host_evictable, "free or evictable host")
        return pages

    def insert_host(self, tokens: Any, host_pages: Any, namespace: Any = None) -> int:
        """Cache the last ``len(host_pages)`` pages of ``tokens`` in the host tier only; takes
        ownership of ``host_pages`` (HELD, from ``alloc_host``, already holding the KV).

        ``tokens`` is the whole sequence up to the last page (whole pages). The pages before
        the passed ones must be cached now, in either tier; the passed pages continue them as
        one new host-only leaf (one BlockStored with medium "CPU"), and ``match_prefix`` then
        reports them as a host continuation, loaded back like any other. Passed pages whose
        tokens are cached already are duplicates and go back to the host pool; if the prefix
        before them is not cached (evicted meanwhile) none can be attached and all go back.
        Returns the number of pages that joined. Checks everything before the first change
        (TypeError/ValueError, the cache unchanged); ValueError without a host tier. The host
        observer is not called: these pages came from its side.
        """
        host = self._host
        if host is None:
            raise ValueError("this RadixCache has no host tier (no host_pool)")
        if self._copies:
            self.poll()
        qb = encode_tokens(tokens)
        try:
            if type(host_pages) is not list:
                host_pages = list(host_pages)
            pb = self._pb
            total = len(qb) // pb
            if len(qb) % pb or len(host_pages) > total:
                raise ValueError(
                    f"insert_host needs whole pages of tokens covering the {len(host_pages)} "
                    f"host pages: got {len(qb) >> TOKEN_SHIFT} tokens with page_size "
                    f"{self.page_size}"
                )
            if namespace is not None:
                hash(namespace)
            pages = host.check_held(host_pages)  # raises: nothing changed yet
            first = total - len(pages)  # index of the first passed page
            start = self.root if namespace is None else self._ns_roots.get(namespace)
            path: list[TreeNode] = []
            partial = None
            off = 0
            if start is not None and total:
                path, off, partial, _ = self._walk(start, qb, len(qb))
            matched = off // pb + (partial[1] if partial is not None else 0)
            if matched < first or matched >= total or not pages:
                host.release_held(pages)  # the prefix is gone, or everything is cached
                return 0
            self._settle_walk(path, partial)
            # ---- mutation starts
            dups, new = pages[: matched - first], pages[matched - first :]
            if dups:
                host.release_held(dups)
            self._clock += 1
            if partial is not None:
                path.append(self._split(*partial))
            parent = path[-1] if path else (start or self._make_ns_root(namespace))
            leaf = self._new_node(
                parent,
                bytes(qb[matched * pb :]),
                [],
                namespace,
                parent.depth_tokens + (len(new) * self.page_size),
            )
            self._attach(parent, leaf)
            self._num_nodes += 1
            self._set_host(leaf, new)
            self._tier.host_inserted_pages += len(new)
            self._reindex(leaf)
            self._reindex(parent)
            if self._listeners:
                self._emit_stored(leaf, HOST_MEDIUM)
            return len(new)
        finally:
            if type(qb) is memoryview:
                _release(qb)

    def set_host_observer(self, observer: HostObserver | None) -> None:
        """Call ``observer(HostRun)`` for each node whose host copy becomes valid or is about
        to be freed (see tiers.HostObserver); None stops. ValueError without a host tier."""
        if self._host is None:
            raise ValueError("this RadixCache has no host tier (no host_pool)")
        if observer is not None and not callable(observer):
            raise TypeError(f"a host observer must be callable, got {observer!r}")
        self._tier.observer = observer

    def host_runs(self) -> list[HostRun]:
        """Every node whose host copy is valid (no copy in flight on it), as a HOST_STORED
        HostRun, top-down: what a storage tier writes out at shutdown under write_back."""
        if self._host is None:
            return []
        out: list[HostRun] = []
        stack: list[tuple[TreeNode, bytes]] = [(self.root, b"")]
        while stack:
            node, above = stack.pop()
            for c in node.iter_children():
                prefix = above + c.key
                if c._host_pages is not None and not c._inflight:
                    out.append(
                        HostRun(HOST_STORED, c.namespace, prefix, list(c._host_pages), c.hit_count)
                    )
                stack.append((c, prefix))
        return out

    # ---- the tiers' internals: nothing below validates; callers hold the preconditions
    def _path_key(self, node: TreeNode) -> bytes:
        """Tokens from the start of the sequence through ``node`` (key encoding)."""
        parts: list[bytes] = []
        while node is not None and node.key:
            parts.append(node.key)
            node = node.parent
        return b"".join(reversed(parts))

    def _observe(self, event: str, n: TreeNode, prefix: bytes | None = None) -> None:
        """Tell the host observer about ``n`` (which has host pages); callers test that one is
        set (``self._tier.observer``) first."""
        self._tier.observer(
            HostRun(
                event,
                n.namespace,
                self._path_key(n) if prefix is None else prefix,
                list(n._host_pages),
                n.hit_count,
            )
        )

    def _prefix_result(self, node: TreeNode) -> LoadBack:
        """A LoadBack that loads nothing: the device-resident prefix ending at ``node``."""
        if not node.key:
            node = self.root  # as match_prefix reports "nothing cached"
        return LoadBack(node, self.path_pages(node), node.depth_tokens)

    def _match_tiered(
        self, path: list[TreeNode], off: int, partial: tuple[TreeNode, int] | None
    ) -> tuple[TreeNode, list[int], int, TreeNode, list[int], int]:
        """match_prefix past the walk, with a host tier: the MatchResult fields, the device
        prefix then the host continuation (residency is top-closed: on any path the
        device-resident nodes come first)."""
        self._settle_walk(path, partial)
        if partial is not None:
            child, m = partial
            path.append(self._split(child, m))
            off += m * self._pb
        root = self.root
        if not path:
            return (root, [], 0, root, [], 0)
        self._clock += 1
        clock = self._clock
        pages: list[int] = []
        hpages: list[int] = []
        last = None
        for n in path:
            n.last_access = clock
            n.hit_count += 1
            if n._pages:
                pages += n._pages
                last = n
            else:
                hpages += n._host_pages
            self._reindex(n)  # re-keys the node where it is a candidate
        if self._tier.observer is not None:
            thr = self._tier.threshold
            for n in path:
                if n.hit_count == thr and n._host_pages is not None and not n._inflight:
                    self._observe(HOST_HIT, n)
        if self._tier.write_policy == WRITE_THROUGH_SELECTIVE:
            thr = self._tier.threshold
            hot = [
                n
                for n in path
                if n._pages and n._host_pages is None and not n._inflight and n.hit_count >= thr
            ]
            if hot:
                end = path[-1]
                self.lock(end)  # making room in the host tier must not take this match
                try:
                    self._backup(hot)
                finally:
                    self.unlock(end)
        ntok = last.depth_tokens if last is not None else 0
        node = last if last is not None else root
        nhost = (off >> TOKEN_SHIFT) - ntok
        self._hit_tokens += ntok
        self._tier.host_hit_tokens += nhost
        return (node, pages, ntok, path[-1] if nhost else node, hpages, nhost)

    def _promote(self, path: list[TreeNode], pages: list[int]) -> list[TreeNode]:
        """Insert passed (HELD) ``pages`` for the host-only tail of ``path``: those nodes get
        them as device pages. Returns the promoted nodes, top-down."""
        nodes: list[TreeNode] = []
        for n in reversed(path):
            if n._pages:
                break
            nodes.append(n)
        nodes.reverse()
        i = 0
        for n in nodes:
            k = len(n._host_pages)
            self._set_device(n, pages[i : i + k])
            i += k
        self._inserted_pages += i
        return nodes

    def _after_insert(
        self, path: list[TreeNode], leaf: TreeNode | None, promoted: list[TreeNode] | None
    ) -> None:
        """An insert's host-tier work: index keys, write-through backups, events of promoted
        nodes (the new leaf's BlockStored follows in insert)."""
        for n in path:
            self._reindex(n)
        if leaf is not None:
            self._reindex(leaf)
        # built now: making room for the backups may split the promoted nodes
        events = [self._stored_event(n, None) for n in promoted or () if self._listeners]
        if self._tier.write_policy == WRITE_THROUGH:
            nodes = [n for n in path if n._host_pages is None and not n._inflight]
            if leaf is not None:
                nodes.append(leaf)
            if nodes:
                self._backup(nodes)
        for ev in events:
            self._events.emit(ev)

    def _backup(self, nodes: list[TreeNode]) -> None:
        """Start backing up ``nodes`` (device-only, nothing in flight, top-down on one path):
        those the host tier has room for, top-down first fit, get host pages (host eviction
        makes the room) and one ``copier.to_host``; the deepest is locked until it is
        retired. A node that does not fit is skipped (``backup_skipped_pages``)."""
        room = self._host.num_free + self._tier.host_evictable
        kept: list[TreeNode] = []
        total = 0
        for n in nodes:
            k = len(n._pages)
            if total + k > room:
                self._tier.backup_skipped += k
                continue
            kept.append(n)
            total += k
        if not kept:
            return
        hp = self._alloc_host(total)
        pairs: list[tuple[int, int]] = []
        i = 0
        for n in kept:
            k = len(n._pages)
            h = hp[i : i + k]
            i += k
            self._set_host(n, h)
            pairs += zip(n._pages, h)
            n._inflight += 1
        pin = kept[-1]
        self.lock(pin)
        try:
            handle = self._tier.copier.to_host(pairs)
        except Exception:  # failed at once: the nodes stay device-only
            for n in reversed(kept):
                n._inflight -= 1
                self._clear_host(n)
            self.unlock(pin)
            self._tier.backup_failures += 1
            return
        self._copies.append(InFlight(BACKUP, handle, kept, total))

    def _write_back(self, v: TreeNode) -> None:
        """Back up the device eviction victim ``v`` (write_back), waiting for the copy. On no
        room or a failed copy ``v`` stays unbacked (and is then dropped)."""
        k = len(v._pages)
        hp = self._alloc_host(k)
        if hp is None:
            self._tier.backup_skipped += k
            return
        try:
            self._tier.copier.to_host(list(zip(v._pages, hp))).wait()
        except Exception:
            self._host.release_held(hp)
            self._tier.backup_failures += 1
            return
        self._set_host(v, hp)
        self._tier.backup_pages += k
        self._tier.write_back_pages += k
        if self._tier.observer is not None:
            self._observe(HOST_STORED, v)
        if self._listeners:
            self._emit_stored(v, HOST_MEDIUM)

    def _retire(self, c: InFlight) -> None:
        """Finish copy ``c`` (already taken off ``_copies``): wait for it, keep or undo what it
        copied, unlock its nodes, then send the events."""
        try:
            c.handle.wait()
            ok = True
        except Exception as e:
            ok = False
            c.error = e
        c.ok = ok
        load = c.kind == LOAD
        for n in c.nodes:
            n._inflight -= 1
            if load:
                n._loading -= 1
        if not ok:
            for n in reversed(c.nodes):
                if load:
                    self._clear_device(n)
                else:
                    self._clear_host(n)
            if load:
                self._tier.load_failures += 1
            else:
                self._tier.backup_failures += 1
        elif load:
            self._tier.loaded_pages += c.pages
        else:
            self._tier.backup_pages += c.pages
        self.unlock(c.pin)
        if ok and not load and self._tier.observer is not None:
            for n in c.nodes:
                if n.parent is not None and n._host_pages is not None:
                    self._observe(HOST_STORED, n)
        if ok and self._listeners:
            for n in c.nodes:
                self._emit_stored(n, None if load else HOST_MEDIUM)

    def _settle(self, nodes: list[TreeNode]) -> None:
        """Wait for and retire every copy in flight on any of ``nodes``."""
        ids = {id(n) for n in nodes}
        for c in [c for c in self._copies if any(id(n) in ids for n in c.nodes)]:
            self._copies.remove(c)
            self._retire(c)

    def _settle_walk(self, path: list[TreeNode], partial: tuple[TreeNode, int] | None) -> None:
        """Before a walk's result is used: loads on the path must have landed (their pages are
        about to be handed out), and a node about to be split must have no copy at all."""
        nodes = [n for n in path if n._loading]
        if partial is not None and partial[0]._inflight:
            nodes.append(partial[0])
        if nodes:
            self._settle(nodes)

    def _alloc_device(self, n: int) -> list[int]:
        """``n`` HELD device pages; the caller checked that free + evictable suffice."""
        short = n - self.pool.num_free
        if short > 0:
            self._evict_device(short)
        return self.pool.alloc(n)

    def _alloc_host(self, n: int) -> list[int] | None:
        """``n`` HELD host pages, host-evicting if short; None (nothing changed) if even that
        cannot find them."""
        host = self._host
        short = n - host.num_free
        if short > 0:
            if short > self._tier.host_evictable:
                return None
            self._evict_host(short)
        return host.alloc(n)

    def _evict_device(self, num_pages: int) -> int:
        """Device eviction with a host tier: exactly ``min(num_pages, evictable)`` pages."""
        freed = 0
        index = self._index
        while freed < num_pages and len(index):
            node = index.first()
            k = len(node._pages)
            need = num_pages - freed
            if k > need:  # the victim keeps its place; the upper part is a new node
                self._split(node, k - need)
                k = need
            self._evict_device_node(node)
            freed += k
        return freed

    def _evict_device_node(self, v: TreeNode) -> None:
        """Take an unlocked device-resident node with no device-resident child off the
        device: demoted to host-only when backed (write_back backs it up first), else
        removed with its (host-only, unlocked) subtree."""
        if v._host_pages is None and self._tier.write_policy == WRITE_BACK:
            self._write_back(v)
        self._index.discard(v)
        if v._host_pages is None:
            self._remove_subtree(v)
            return
        hashes = self._node_hashes(v) if self._listeners else None
        k = len(v._pages)
        parent = v.parent
        self._clear_device(v)
        self._cold.evicted_pages += k
        self._tier.demoted_pages += k
        self._reindex(v)
        self._reindex(parent)
        if hashes is not None:
            self._events.emit(BlockRemoved(hashes, v.namespace))

    def _evict_host(self, num_pages: int) -> int:
        """Host eviction: exactly ``min(num_pages, host evictable)`` host pages."""
        freed = 0
        hindex = self._tier.hindex
        while freed < num_pages and len(hindex):
            node = hindex.first()
            k = len(node._host_pages)
            need = num_pages - freed
            if k > need:
                self._split(node, k - need)
                k = need
            if node._pages:  # device+host: only the host copy goes
                hashes = self._node_hashes(node) if self._listeners else None
                if self._tier.observer is not None:
                    self._observe(HOST_LEAVING, node)
                hindex.discard(node)
                self._clear_host(node)
                self._tier.host_evicted_pages += k
                self._reindex(node.parent)
                if hashes is not None:
                    self._events.emit(BlockRemoved(hashes, node.namespace, HOST_MEDIUM))
            else:  # a host-only node with no host-resident child has no child at all
                self._remove_subtree(node)
            freed += k
        return freed

    def _remove_subtree(self, v: TreeNode) -> None:
        """Remove the unlocked node ``v`` and everything below it from the trie, freeing their
        pages in both pools; a parent left without children is re-indexed (or, for an empty
        namespace root, removed)."""
        sub = [v]
        for n in sub:  # grows while iterating
            sub.extend(n.iter_children())
        hashes = {n.node_id: self._node_hashes(n) for n in sub} if self._listeners else None
        if self._tier.observer is not None:  # while the links the prefixes follow are there
            above = self._path_key(v.parent)
            prefixes = {v.node_id: above + v.key}
            for n in sub[1:]:
                prefixes[n.node_id] = prefixes[n.parent.node_id] + n.key
            for n in sub:
                if n._host_pages is not None:
                    self._observe(HOST_LEAVING, n, prefixes[n.node_id])
        parent = v.parent
        self._detach(parent, v)
        parent._ndev -= bool(v._pages)
        parent._nhost -= v._host_pages is not None
        freed: list[int] = []
        host_freed: list[int] = []
        on_device: list[TreeNode] = []
        on_host: list[TreeNode] = []
        for n in sub:
            self._index.discard(n)
            self._tier.hindex.discard(n)
            if n._pages:
                on_device.append(n)
                freed += n._pages
                n._pages = []
            if n._host_pages is not None:
                on_host.append(n)
                host_freed += n._host_pages
                n._host_pages = None
            n.parent = None
        self.pool.release_cached(freed)
        self._cached -= len(freed)
        self._evictable -= len(freed)
        self._cold.evicted_pages += len(freed)
        self._host.release_cached(host_freed)
        self._tier.host_cached -= len(host_freed)
        self._tier.host_evictable -= len(host_freed)
        self._tier.host_evicted_pages += len(host_freed)
        self._num_nodes -= len(sub)
        self._cold.evicted_nodes += len(sub)
        if parent is not self.root:
            if not parent.key and not parent._children:
                self._drop_ns_root(parent)
            else:
                self._reindex(parent)
        if hashes is not None:
            for n in on_device:
                self._events.emit(BlockRemoved(hashes[n.node_id], n.namespace))
            for n in on_host:
                self._events.emit(BlockRemoved(hashes[n.node_id], n.namespace, HOST_MEDIUM))

    def _lock_tiered(self, node: TreeNode) -> None:
        root = self.root
        while node is not root:
            if node.lock_ref == 0:
                self._evictable -= len(node._pages)
                hp = node._host_pages
                if hp is not None:
                    self._tier.host_evictable -= len(hp)
                if node._ekey is not None:
                    self._index.discard(node)
                if node._hekey is not None:
                    self._tier.hindex.discard(node)
            node.lock_ref += 1
            node = node.parent

    def _unlock_tiered(self, node: TreeNode) -> None:
        root = self.root
        while node is not root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node._pages)
                hp = node._host_pages
                if hp is not None:
                    self._tier.host_evictable += len(hp)
                self._reindex(node)
            node = node.parent

    def _reindex(self, n: TreeNode) -> None:
        """Put ``n`` in exactly the eviction indexes it belongs to, under its current key.

        Device candidates: unlocked, device-resident, no device-resident child. Host
        candidates: unlocked, host-resident, no host-resident child. (Roots have no pages.)
        """
        free = n.lock_ref == 0
        if free and n._pages and not n._ndev:
            if n._ekey is None:
                self._index.add(n)
            else:
                self._index.refresh(n)
        elif n._ekey is not None:
            self._index.discard(n)
        if free and n._host_pages is not None and not n._nhost:
            if n._hekey is None:
                self._tier.hindex.add(n)
            else:
                self._tier.hindex.refresh(n)
        elif n._hekey is not None:
            self._tier.hindex.discard(n)

    # The four residency moves: pool state, page counters, the parent's child counts.
    # Callers re-index (``_reindex``) and send events.
    def _set_device(self, n: TreeNode, pages: list[int]) -> None:
        self.pool.adopt(pages)
        n._pages = pages
        self._cached += len(pages)
        if n.lock_ref == 0:
            self._evictable += len(pages)
        n.parent._ndev += 1

    def _clear_device(self, n: TreeNode) -> None:
        pages = n._pages
        self.pool.release_cached(pages)
        n._pages = []
        self._cached -= len(pages)
        if n.lock_ref == 0:
            self._evictable -= len(pages)
        n.parent._ndev -= 1

    def _set_host(self, n: TreeNode, pages: list[int]) -> None:
        self._host.adopt(pages)
        n._host_pages = pages
        self._tier.host_cached += len(pages)
        if n.lock_ref == 0:
            self._tier.host_evictable += len(pages)
        n.parent._nhost += 1

    def _clear_host(self, n: TreeNode) -> None:
        pages = n._host_pages
        self._host.release_cached(pages)
        n._host_pages = None
        self._tier.host_cached -= len(pages)
        if n.lock_ref == 0:
            self._tier.host_evictable -= len(pages)
        n.parent._nhost -= 1

    def _stored_event(self, n: TreeNode, medium: str | None) -> BlockStored:
        return BlockStored(
            self._node_hashes(n),
            self._last_hash(n.parent),
            key_to_list(n.key),
            self.page_size,
            n.namespace,
            medium,
        )

    def _emit_stored(self, n: TreeNode, medium: str | None) -> None:
        self._events.emit(self._stored_event(n, medium))

    def _check_tiers(self) -> None:
        """check_invariants' host-tier part (see there)."""
        host = self._host
        host.check_invariants()
        pb = self._pb
        inflight: dict[int, int] = {}
        loading: dict[int, int] = {}
        for c in self._copies:
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
        seen: set[int] = set()
        hcached = hevictable = 0
        expected: dict[int, int] = {}
        for node in self.iter_nodes():
            children = list(node.iter_children())
            ndev = sum(1 for c in children if c._pages)
            nhost = sum(1 for c in children if c._host_pages is not None)
            if node._ndev != ndev or node._nhost != nhost:
                _fail(
                    f"{node!r}: child counts device {node._ndev}/{ndev}, host {node._nhost}/{nhost}"
                )
            if node._inflight != inflight.get(node.node_id, 0):
                _fail(f"{node!r}: {node._inflight} copies in flight, recount differs")
            if node._loading != loading.get(node.node_id, 0):
                _fail(f"{node!r}: {node._loading} loads in flight, recount differs")
            if node.lock_ref < node._inflight:
                _fail(f"{node!r}: lock count below its copies in flight")
            hp = node._host_pages
            if not node.key:
                if hp is not None or node._hekey is not None:
                    _fail(f"{node!r}: a root with host pages")
                continue
            if not node._pages and hp is None:
                _fail(f"{node!r} is in neither tier")
            parent = node.parent
            if node._pages and parent.key and not parent._pages:
                _fail(f"{node!r} is device-resident below a host-only node")
            if hp is None:
                if node._hekey is not None:
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
                    expected[node.node_id] = self.policy.key(node)
        if host.num_cached != hcached or hcached != self._tier.host_cached:
            _fail(
                f"host pages: pool {host.num_cached}, counter {self._tier.host_cached}, "
                f"recount {hcached}"
            )
        if host.num_free + hcached + host.num_held != host.num_pages:
            _fail("host pool: free + cached + held != total")
        if hevictable != self._tier.host_evictable:
            _fail(f"host evictable counter {self._tier.host_evictable} != recount {hevictable}")
        stored = self._tier.hindex.stored_keys()
        if stored != expected:
            _fail(
                f"host eviction index {sorted(stored.items())} != recount "
                f"{sorted(expected.items())}"
            )
        err = self._tier.hindex.check()
        if err:
            _fail(f"host index: {err}")

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

    def _lookup_key(self, page: bytes) -> Any:
        """The key a child starting with ``page`` is filed under in its parent's dict."""
        return page if self._hash_fn is None else self._hash_fn(page)

    def _attach(self, parent: TreeNode, child: TreeNode, h: Any = None) -> None:
        """File ``child`` under ``h``, the lookup key of its first page (computed when None;
        a list when a user hash function collides)."""
        if h is None:
            h = self._lookup_key(child.key[: self._pb])
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

    def _check_node(self, node: TreeNode) -> None:
        if not isinstance(node, TreeNode):
            raise TypeError(f"expected a TreeNode, got {type(node).__name__}")
        if node._cache is not self:
            raise ForeignNodeError("node belongs to another RadixCache")
        if node.parent is None and node is not self.root:
            raise ForeignNodeError("node is no longer in the cache (evicted or reset)")

    # ======================================================================== diagnostics
    def check_invariants(self) -> None:
        """Recount everything against the incremental state; InvariantError on a violation.

        Checked (the error names the first violation): the pool's own invariants; page
        conservation (every trie page distinct and CACHED in the pool, the pool's CACHED count
        equal to the trie's page count, free + cached + held == total); shape (every non-root
        key a whole, non-zero number of pages owning ``len(key) / page_size`` pages, links and
        child-lookup keys agree, siblings start with different pages, depth_tokens adds up,
        namespaces are inherited, namespace roots registered, empty of tokens and never
        childless); locks (>= 0, a parent's count >= each child's, the root never counted);
        the cached, evictable and node counters; the eviction index (exactly the unlocked
        leaves that own pages, under their current key); cached event hashes (when any node
        has them) equal to a fresh computation.

        With a host tier, also: the same conservation in the host pool; every node in at least
        one tier, each tier's page list whole; device residency top-closed; the per-node counts
        of device- and host-resident children; lock counts at least the copies in flight (which
        are recounted from the copies not yet retired, each locking its deepest node); the host
        counters; and both eviction indexes, each holding exactly its candidates.
        """
        pool = self.pool
        pool.check_invariants()
        pb = self._pb
        root = self.root
        if root.parent is not None or root.key or root._pages or root.lock_ref:
            _fail("root must have no parent, tokens, pages or lock count")

        seen_pages: set[int] = set()
        cached = evictable = nodes = 0
        expected_index: dict[int, int] = {}
        ns_seen: dict[object, object] = {}
        # event hashes are checked only when some node caches them (recomputing costs a pass)
        verify_hashes = any(n._hashes is not None for n in self.iter_nodes())
        last_hash: dict[int, int | None] = {}  # node id -> chained hash of its last page
        stack = [root]
        while stack:
            node = stack.pop()
            nodes += 1
            if node._cache is not self:
                _fail(f"{node!r} belongs to another cache")
            if node.lock_ref < 0:
                _fail(f"negative lock count on {node!r}")
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
                    if c._hkey != self._lookup_key(first):
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
                if parent is not root or self._ns_roots.get(node.namespace) is not node:
                    _fail(f"unregistered namespace root {node!r}")
                if node._pages or node.depth_tokens:
                    _fail("namespace root with pages or depth")
                if not children:
                    _fail(f"empty namespace root {node.namespace!r} was not removed")
                ns_seen[node.namespace] = node
                continue
            if len(node.key) % pb:
                _fail(f"{node!r}: key is not a whole number of pages")
            if (node._pages or self._host is None) and len(node._pages) * pb != len(node.key):
                _fail(f"{node!r}: {len(node._pages)} pages for {node.num_tokens} tokens")
            if node.namespace != parent.namespace:
                _fail(f"{node!r}: namespace differs from its parent's")
            if node.depth_tokens != parent.depth_tokens + node.num_tokens:
                _fail(f"{node!r}: depth_tokens does not add up")
            if verify_hashes:
                prev = last_hash[parent.node_id] if parent.key else chain_start(node.namespace)
                fresh = chain_hashes(prev, local_hashes_of_key(node.key, self.page_size))
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
                if self._host is None:
                    candidate = not children
                else:  # device-resident with no device-resident child
                    candidate = bool(node._pages) and not any(c._pages for c in children)
                if candidate:
                    expected_index[node.node_id] = self.policy.key(node)
            elif node._ekey is not None:
                _fail(f"locked node {node!r} is in the eviction index")
        if ns_seen.keys() != self._ns_roots.keys():
            _fail("namespace root registry differs from the trie")
        if pool.num_cached != cached or cached != self._cached:
            _fail(f"cached pages: pool {pool.num_cached}, counter {self._cached}, recount {cached}")
        if pool.num_free + cached + pool.num_held != pool.num_pages:
            _fail("free + cached + held != total")
        if evictable != self._evictable:
            _fail(f"evictable counter {self._evictable} != recount {evictable}")
        if nodes != self._num_nodes:
            _fail(f"node counter {self._num_nodes} != recount {nodes}")
        stored = self._index.stored_keys()
        if stored != expected_index:
            _fail(
                f"eviction index {sorted(stored.items())} != recount "
                f"{sorted(expected_index.items())}"
            )
        err = self._index.check()
        if err:
            _fail(err)
        if self._host is None:
            for n in self.iter_nodes():
                if n._host_pages is not None or n._hekey is not None or n._inflight:
                    _fail(f"{n!r}: host-tier state in a cache without a host tier")
            if self._copies or self._tier.host_cached or self._tier.host_evictable:
                _fail("host-tier counters in a cache without a host tier")
        else:
            self._check_tiers()

    def pretty(self, max_tokens_shown: int = 8) -> str:
        """The trie as indented text, one line per node (see pretty.py); with a host tier each
        line says where the node lives."""
        header = (
            f"root  [{self._cached} cached pages, {self.num_locked_pages} locked, "
            f"{self.pool.num_free} free, policy={self.policy.name}, page_size={self.page_size}]"
        )
        if self._host is not None:
            header += (
                f"  host [{self._tier.host_cached} cached pages, {self._host.num_free} free, "
                f"{self.write_policy}, {len(self._copies)} copies in flight]"
            )
        return render_text(self.root, header, max_tokens_shown, self._host is not None)

    def to_dot(self) -> str:
        """The trie as Graphviz source (see pretty.py)."""
        return render_dot(self.iter_nodes(), self._index, tiers=self._host is not None)

    def __repr__(self) -> str:
        return (
            f"RadixCache(page_size={self.page_size}, policy={self.policy.name!r}, "
            f"nodes={self._num_nodes}, cached_pages={self._cached}, "
            f"evictable_pages={self._evictable}, free_pages={self.pool.num_free})"
        )
