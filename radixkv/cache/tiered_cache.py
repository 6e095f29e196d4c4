"""TieredRadixCache: RadixCache with a host-memory tier below the device pool.

It overrides whole methods of RadixCache (radix_cache.py), never a branch inside one: where a
node's pages live (residency), the walk's settling of copies in flight, load-back, the write
policies, device eviction that demotes, host eviction, and the storage tier's side door
(``alloc_host``, ``insert_host``, the host observer). Copies between the tiers are started
here and retired by Copies (copies.py), whose callback is ``_retired``. tiers.py defines the
copier protocol, the write policies and the tier's counters; the rules are in the class
docstring and docs/cache_design.md ("Tiers").
"""

from __future__ import annotations

from array import array
from typing import Any

import msgspec

from radixkv.cache.copies import BACKUP, LOAD, Copies, InFlight
from radixkv.cache.errors import OutOfPages
from radixkv.cache.events import BlockRemoved
from radixkv.cache.eviction import EvictionIndex, EvictionPolicy
from radixkv.cache.hashing import HashFn
from radixkv.cache.invariants import check_host_tier
from radixkv.cache.node import TieredTreeNode, TreeNode
from radixkv.cache.page_pool import PagePool
from radixkv.cache.pretty import render_dot, render_text, residency_decoration, tiered_node_line
from radixkv.cache.radix_cache import ALL_NAMESPACES, RadixCache, check_count
from radixkv.cache.results import InsertResult, MatchResult
from radixkv.cache.stats import CacheStats
from radixkv.cache.tiers import (
    HOST_HIT,
    HOST_LEAVING,
    HOST_MEDIUM,
    HOST_STORED,
    WRITE_BACK,
    WRITE_THROUGH,
    WRITE_THROUGH_SELECTIVE,
    Copier,
    HostObserver,
    HostRun,
    LoadBack,
    TierState,
    check_tier_args,
)
from radixkv.cache.tokens import TOKEN_SHIFT, encode_tokens
from radixkv.cache.trie import release_view

__all__ = ["TieredRadixCache"]


class TieredRadixCache(RadixCache):
    """A RadixCache whose nodes may also (or only) be held in a host tier.

    Everything in RadixCache's ownership contract holds, plus:

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
    * Runs of single-child nodes are not merged (a merge would have to join host copies too).

    Args:
        pool, page_size, policy, hash_fn: as RadixCache's.
        host_pool: the host tier's PagePool (ids of host-memory pages): a pool of its own, with
            at least one page, none of them in use.
        copier: moves pages between the tiers (tiers.Copier).
        write_policy: when device pages are backed up to the host tier: "write_through"
            (default), "write_through_selective" or "write_back" (see above).
        write_through_threshold: matches through a node before ``write_through_selective``
            backs it up (>= 1).
    """

    _node_type = TieredTreeNode

    def __init__(
        self,
        pool: PagePool,
        page_size: int = 16,
        policy: str | EvictionPolicy = "lru",
        *,
        hash_fn: HashFn | None = None,
        host_pool: PagePool,
        copier: Copier,
        write_policy: str = WRITE_THROUGH,
        write_through_threshold: int = 1,
    ) -> None:
        super().__init__(pool, page_size, policy, hash_fn=hash_fn)
        if host_pool is None:
            raise ValueError(
                "TieredRadixCache needs a host_pool (for no host tier use RadixCache, or "
                "build_cache without host_pool)"
            )
        check_tier_args(pool, host_pool, copier, write_policy, write_through_threshold)
        self._plain = False  # walks settle the copies in flight on their path
        # Few attributes on the cache keep CPython's fast attribute access (an instance dict
        # of more than 30 keys stops sharing its keys with the class's): the tier's state is
        # one object.
        self._host = host_pool
        self._copies = Copies(self._retired)
        self._tier = TierState(
            copier, write_policy, write_through_threshold, EvictionIndex(self.policy)
        )

    # ======================================================================== queries
    @property
    def host_pool(self) -> PagePool:
        return self._host

    @property
    def write_policy(self) -> str:
        return self._tier.write_policy

    @property
    def write_through_threshold(self) -> int:
        return self._tier.threshold

    @property
    def num_host_pages(self) -> int:
        return self._tier.host_cached

    @property
    def num_host_evictable_pages(self) -> int:
        return self._tier.host_evictable

    @property
    def copies_in_flight(self) -> int:
        return len(self._copies)

    @property
    def copies(self) -> Copies:
        """The copies in flight (read them; retire them with ``poll`` or ``wait_all``)."""
        return self._copies

    @property
    def host_eviction_index(self) -> EvictionIndex:
        """The host tier's eviction index (read it; the cache keeps it)."""
        return self._tier.hindex

    @property
    def stats(self) -> CacheStats:
        t = self._tier
        return msgspec.structs.replace(
            super().stats,
            host_hit_tokens=t.host_hit_tokens,
            loaded_pages=t.loaded_pages,
            load_failures=t.load_failures,
            backup_pages=t.backup_pages,
            write_back_pages=t.write_back_pages,
            backup_failures=t.backup_failures,
            backup_skipped_pages=t.backup_skipped,
            demoted_pages=t.demoted_pages,
            host_evicted_pages=t.host_evicted_pages,
            host_inserted_pages=t.host_inserted_pages,
            host_cached_pages=t.host_cached,
            host_evictable_pages=t.host_evictable,
            host_free_pages=self._host.num_free,
            copies_in_flight=len(self._copies),
        )

    def host_eviction_order(self) -> list[TreeNode]:
        return list(self._tier.hindex)

    def host_runs(self) -> list[HostRun]:
        """Every node whose host copy is valid (no copy in flight on it), as a HOST_STORED
        HostRun, top-down: what a storage tier writes out at shutdown under write_back."""
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

    # ======================================================================== match
    def _matched(
        self, path: list[TreeNode], off: int, partial: tuple[TreeNode, int] | None
    ) -> MatchResult:
        """match_prefix past the walk: the device prefix, then the host continuation
        (residency is top-closed: on any path the device-resident nodes come first). Loads
        still in flight on the path are waited for first, and ``write_through_selective`` may
        start backups of the path's hot nodes (making room by host eviction elsewhere)."""
        self._settle_walk(path, partial)
        if partial is not None:
            child, m = partial
            path.append(self._split(child, m))
            off += m * self._pb
        root = self.root
        if not path:
            return MatchResult(root, [], 0, root)
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
        tier = self._tier
        if tier.observer is not None:
            for n in path:
                if n.hit_count == tier.threshold and n._host_pages is not None and not n._inflight:
                    self._observe(HOST_HIT, n)
        if tier.write_policy == WRITE_THROUGH_SELECTIVE:
            hot = [
                n
                for n in path
                if n._pages
                and n._host_pages is None
                and not n._inflight
                and n.hit_count >= tier.threshold
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
        tier.host_hit_tokens += nhost
        return MatchResult(node, pages, ntok, path[-1] if nhost else node, hpages, nhost)

    def peek_prefix(self, tokens: Any, namespace: Any = None, *, host: bool = False) -> int:
        path, off, partial = self._peek_walk(tokens, namespace)
        if partial is not None:
            off += partial[1] * self._pb
        if host or (partial is not None and partial[0]._pages):
            return off >> TOKEN_SHIFT
        # the device-resident part ends at the last device-resident node of the path
        return next((n.depth_tokens for n in reversed(path) if n._pages), 0)

    def peek_pages(self, tokens: Any, namespace: Any = None) -> list[int]:
        path, _, partial = self._peek_walk(tokens, namespace)
        pages: list[int] = []
        for n in path:  # a device-resident node's ancestors are device-resident
            if not n._pages:
                return pages
            pages += n._pages
        if partial is not None:
            pages += partial[0]._pages[: partial[1]]
        return pages

    # ======================================================================== insert
    def insert(self, tokens: Any, pages: Any, namespace: Any = None) -> InsertResult:
        """RadixCache.insert, through host-only nodes too: passed pages for tokens cached
        only in host memory must be HELD; they become those nodes' device pages (the nodes
        are device+host again, one BlockStored each). Under ``write_through`` the path's
        nodes without a host copy are then backed up."""
        if self._copies:
            self.poll()
        if type(tokens) is array and tokens.typecode == "q":
            qb: bytes | memoryview = memoryview(tokens).cast("B")
        else:
            qb = encode_tokens(tokens)
        try:
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
            if start is not None and pages:
                path, off, partial, _ = self._walk(start, qb, nq)
                self._settle_walk(path, partial)
            canon: list[int] = []  # device pages of the cached part
            for n in path:
                canon += n._pages
            if partial is not None:
                canon += partial[0]._pages[: partial[1]]
            ncached = len(canon)
            # pages cached (in host memory only past the device-resident ones)
            nold = off // pb + (partial[1] if partial is not None else 0)
            newkey = qb[nold * pb :].tobytes()
            dups, new = self._check_passed(pages, canon)  # raises: nothing changed yet
            promote, new = new[: nold - ncached], new[nold - ncached :]

            # ---- mutation starts: nothing below can fail (but a listener may raise at the end)
            self._insert_calls += 1
            self._clock = clock = self._clock + 1
            if partial is not None:
                path.append(self._split(*partial))
            for n in path:
                n.last_access = clock
            promoted = self._promote(path, promote) if promote else []
            canon += promote
            leaf = None
            if new:
                parent = path[-1] if path else (start or self._make_ns_root(namespace))
                k = len(new)
                leaf = self._new_node(
                    parent, newkey, new, namespace, parent.depth_tokens + k * self.page_size
                )
                self._attach(parent, leaf)
                self.pool.adopt(new)
                canon += new
                parent._ndev += 1
                self._num_nodes += 1
                self._cached += k
                self._evictable += k
                self._inserted_pages += k
                node = leaf
            else:
                node = path[-1] if path else self.root
            if dups:
                self.pool.release_held(dups)
                self._duplicate_pages += len(dups)
            self._after_insert(path, leaf, promoted)
            if leaf is not None and self._listeners:
                self._events.emit(self._stored_event(leaf, None))
            return InsertResult(node, canon, ncached * self.page_size)
        finally:
            if type(qb) is memoryview:
                release_view(qb)

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
        self, path: list[TreeNode], leaf: TreeNode | None, promoted: list[TreeNode]
    ) -> None:
        """An insert's host-tier work: index keys, write-through backups, events of promoted
        nodes (the new leaf's BlockStored follows in insert)."""
        for n in path:
            self._reindex(n)
        if leaf is not None:
            self._reindex(leaf)
        # built now: making room for the backups may split the promoted nodes
        events = [self._stored_event(n, None) for n in promoted if self._listeners]
        if self._tier.write_policy == WRITE_THROUGH:
            nodes = [n for n in path if n._host_pages is None and not n._inflight]
            if leaf is not None:
                nodes.append(leaf)
            if nodes:
                self._backup(nodes)
        for ev in events:
            self._events.emit(ev)

    # ======================================================================== locking
    # RadixCache's lock and unlock do the device side; these add the host side for the nodes
    # whose count just left or reached zero. A parent's count is at least each child's, so
    # those nodes are the bottom of the path, up to the first count past 1 (lock) or 0.
    def lock(self, node: TreeNode) -> None:
        """Protect ``node`` and its ancestors from eviction in both tiers (counts nest)."""
        super().lock(node)
        root = self.root
        tier = self._tier
        while node is not root and node.lock_ref == 1:
            hp = node._host_pages
            if hp is not None:
                tier.host_evictable -= len(hp)
            self._index.discard(node)  # a device candidate may have (host-only) children
            tier.hindex.discard(node)
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        super().unlock(node)
        root = self.root
        tier = self._tier
        while node is not root and node.lock_ref == 0:
            hp = node._host_pages
            if hp is not None:
                tier.host_evictable += len(hp)
            self._reindex(node)
            node = node.parent

    def _merge_runs(self) -> None:
        self._merge_candidates.clear()  # runs stay (class docstring)

    # ======================================================================== allocation, eviction
    def alloc(self, n: int) -> list[int]:
        check_count("alloc", n)
        if self._copies:
            self.poll()
        return super().alloc(n)

    def evict(self, num_pages: int) -> int:
        """Free up to ``num_pages`` device pages in policy order (class docstring)."""
        check_count("evict", num_pages)
        if self._copies:
            self.poll()
        return super().evict(num_pages)

    def _evict_tail(self, node: TreeNode, n: int) -> None:
        # the victim keeps its place; the upper part is a new node
        self._split(node, len(node._pages) - n)
        self._evict_node(node)

    def _evict_node(self, v: TreeNode) -> None:
        """Take an unlocked device-resident node with no device-resident child off the
        device: demoted to host-only when backed (write_back backs it up first), else
        removed with its (host-only, unlocked) subtree."""
        if v._host_pages is None and self._tier.write_policy == WRITE_BACK:
            self._write_back(v)
        if v._host_pages is None:
            self._remove(v)
            return
        self._index.discard(v)
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

    def reset(self, *, namespace: Any = ALL_NAMESPACES) -> None:
        """RadixCache.reset, in both tiers: unlocked nodes go from both; copies in flight lock
        theirs, which stay."""
        if self._copies:
            self.poll()
        super().reset(namespace=namespace)

    def _remove(self, v: TreeNode, evicted: bool = True, quiet: bool = False) -> None:
        """RadixCache._remove in both tiers: the host side first (the observer hears of the
        host copies leaving while the links their prefixes follow are there; a reset drops
        without a call), then the device side, then the host events."""
        sub = [v]
        for n in sub:  # grows while iterating
            sub.extend(n.iter_children())
        hosted = [n for n in sub if n._host_pages is not None]
        tier = self._tier
        hashes = [self._node_hashes(n) for n in hosted] if self._listeners and not quiet else None
        if evicted and tier.observer is not None and hosted:
            prefixes = {id(v): self._path_key(v.parent) + v.key}
            for n in sub[1:]:
                prefixes[id(n)] = prefixes[id(n.parent)] + n.key
            for n in hosted:
                self._observe(HOST_LEAVING, n, prefixes[id(n)])
        parent = v.parent
        parent._ndev -= bool(v._pages)
        parent._nhost -= v._host_pages is not None
        hindex = tier.hindex
        for n in sub:
            hindex.discard(n)
        freed = 0
        for n in hosted:
            self._host.release_cached(n._host_pages)
            freed += len(n._host_pages)
            n._host_pages = None
        tier.host_cached -= freed
        tier.host_evictable -= freed
        tier.host_evicted_pages += freed
        if parent.key:
            self._reindex(parent)  # its own state is final: pages, lock, resident children
        super()._remove(v, evicted, quiet)
        if hashes is not None:
            for n, h in zip(hosted, hashes):
                self._events.emit(BlockRemoved(h, n.namespace, HOST_MEDIUM))

    def _after_removal(self, parent: TreeNode) -> None:
        # a namespace root left empty goes; any other parent was re-indexed in _remove
        if not parent.key:
            self._drop_ns_root(parent)

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """Trie._split, cutting the host pages too (a node with copies in flight is never
        split: callers settle it first)."""
        upper = super()._split(child, m)
        hp = child._host_pages
        if hp is not None:
            upper._host_pages = hp[:m]
            child._host_pages = hp[m:]
            upper._nhost = 1
        upper._ndev = 1 if child._pages else 0
        return upper

    # ======================================================================== host eviction
    def evict_host(self, num_pages: int) -> int:
        """Free up to ``num_pages`` host pages in policy order; return the count.

        Victims are unlocked host-resident nodes with no host-resident child: a host-only one
        leaves the trie, a device+host one keeps its device pages. Never frees more than asked
        (a larger victim is split first).
        """
        check_count("evict_host", num_pages)
        if self._copies:
            self.poll()
        return self._evict_host(num_pages)

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
                self._remove(node)
            freed += k
        return freed

    def _alloc_device(self, n: int) -> list[int]:
        """``n`` HELD device pages; the caller checked that free + evictable suffice."""
        short = n - self.pool.num_free
        if short > 0:
            RadixCache.evict(self, short)  # no poll: the caller is mid-call
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

    # ======================================================================== load back, copies
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
        why.
        """
        node = match.host_node if match.host_node is not None else match.node
        self._check_node(node)
        if self._copies:
            self.poll()
        loading = []  # a load in flight above would be read before it lands
        n = node
        while n is not None:
            if n._loading:
                loading.append(n)
            n = n.parent
        if loading:
            self._copies.settle(loading)
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
        Copies.begin(LOAD, chain)
        pin = chain[-1]
        try:
            handle = self._tier.copier.to_device(pairs)
        except Exception as e:  # the copier failed at once: a miss, nothing left behind
            Copies.abort(LOAD, chain)
            for x in reversed(chain):
                self._clear_device(x)
            self.unlock(pin)
            self._tier.load_failures += 1
            lb = self._prefix_result(frontier)
            lb.error = e
            return lb
        rec = self._copies.track(LOAD, handle, chain, want)
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
        self._copies.wait(c)
        return bool(c.ok)

    def poll(self) -> int:
        """Retire every copy that has finished (never blocks); return how many.

        A finished backup becomes a valid host copy (BlockStored, medium "CPU"), a finished
        load a device copy (BlockStored, medium None); a failed one is undone (its host pages,
        or device pages, go back to their pool). Either way its nodes are unlocked.
        """
        return self._copies.poll()

    def wait_all(self) -> None:
        """Wait for every copy in flight and retire it (before shutdown, or in tests)."""
        self._copies.wait_all()

    def _prefix_result(self, node: TreeNode) -> LoadBack:
        """A LoadBack that loads nothing: the device-resident prefix ending at ``node``."""
        if not node.key:
            node = self.root  # as match_prefix reports "nothing cached"
        return LoadBack(node, self.path_pages(node), node.depth_tokens)

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
        Copies.begin(BACKUP, kept)
        pin = kept[-1]
        self.lock(pin)
        try:
            handle = self._tier.copier.to_host(pairs)
        except Exception:  # failed at once: the nodes stay device-only
            Copies.abort(BACKUP, kept)
            for n in reversed(kept):
                self._clear_host(n)
            self.unlock(pin)
            self._tier.backup_failures += 1
            return
        self._copies.track(BACKUP, handle, kept, total)

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
            self._events.emit(self._stored_event(v, HOST_MEDIUM))

    def _retired(self, c: InFlight) -> None:
        """Copies' callback for a retired copy ``c``: keep or undo what it copied, unlock its
        nodes, then send the events."""
        load = c.kind == LOAD
        tier = self._tier
        if not c.ok:
            for n in reversed(c.nodes):
                if load:
                    self._clear_device(n)
                else:
                    self._clear_host(n)
            if load:
                tier.load_failures += 1
            else:
                tier.backup_failures += 1
        elif load:
            tier.loaded_pages += c.pages
        else:
            tier.backup_pages += c.pages
        self.unlock(c.pin)
        if c.ok and not load and tier.observer is not None:
            for n in c.nodes:
                if n.parent is not None and n._host_pages is not None:
                    self._observe(HOST_STORED, n)
        if c.ok and self._listeners:
            for n in c.nodes:
                self._events.emit(self._stored_event(n, None if load else HOST_MEDIUM))

    def _settle_walk(self, path: list[TreeNode], partial: tuple[TreeNode, int] | None) -> None:
        """Before a walk's result is used: loads on the path must have landed (their pages are
        about to be handed out), and a node about to be split must have no copy at all."""
        nodes = [n for n in path if n._loading]
        if partial is not None and partial[0]._inflight:
            nodes.append(partial[0])
        if nodes:
            self._copies.settle(nodes)

    # ======================================================================== residency
    def _reindex(self, n: TreeNode) -> None:
        """Put ``n`` in exactly the eviction indexes it belongs to, under its current key.

        Device candidates: unlocked, device-resident, no device-resident child. Host
        candidates: unlocked, host-resident, no host-resident child. (Roots have no pages.)
        """
        free = n.lock_ref == 0
        self._index.put(n, free and bool(n._pages) and not n._ndev)
        self._tier.hindex.put(n, free and n._host_pages is not None and not n._nhost)

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

    # ======================================================================== the storage side door
    def alloc_host(self, n: int) -> list[int]:
        """``n`` HELD host pages, host-evicting unlocked nodes (policy order) if short.

        For data that enters the host tier from elsewhere (storage): fill the pages, then hand
        them to ``insert_host`` (or free them with ``host_pool.free``). Raises OutOfPages, with
        nothing evicted, if free + evictable host pages < n.
        """
        check_count("alloc_host", n)
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
        (TypeError/ValueError, the cache unchanged). The host observer is not called: these
        pages came from its side.
        """
        host = self._host
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
                self._events.emit(self._stored_event(leaf, HOST_MEDIUM))
            return len(new)
        finally:
            if type(qb) is memoryview:
                release_view(qb)

    def set_host_observer(self, observer: HostObserver | None) -> None:
        """Call ``observer(HostRun)`` for each node whose host copy becomes valid or is about
        to be freed (see tiers.HostObserver); None stops."""
        if observer is not None and not callable(observer):
            raise TypeError(f"a host observer must be callable, got {observer!r}")
        self._tier.observer = observer

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

    # ======================================================================== diagnostics
    def check_invariants(self) -> None:
        """RadixCache.check_invariants, then the host tier (invariants.py): the same
        conservation in the host pool; every node in at least one tier, each tier's page list
        whole; device residency top-closed; the per-node counts of device- and host-resident
        children; lock counts at least the copies in flight (which are recounted from the
        copies not yet retired, each locking its deepest node); the host counters; and the
        host eviction index, holding exactly its candidates."""
        super().check_invariants()
        check_host_tier(self)

    def pretty(self, max_tokens_shown: int = 8) -> str:
        """The trie as indented text, one line per node, each saying where the node lives."""
        return render_text(self.root, self._header(), max_tokens_shown, tiered_node_line)

    def to_dot(self) -> str:
        """The trie as Graphviz source, host-only nodes drawn grey (see pretty.py)."""
        return render_dot(self.iter_nodes(), self._index, decorate=residency_decoration)

    def _header(self) -> str:
        return super()._header() + (
            f"  host [{self._tier.host_cached} cached pages, {self._host.num_free} free, "
            f"{self.write_policy}, {len(self._copies)} copies in flight]"
        )
