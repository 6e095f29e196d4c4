"""HostTier: the half of RadixCache that runs when it has a host tier.

RadixCache (radix_cache.py) inherits these methods; they are one class's code kept in a file of
their own because they are the part of the trie that only a cache with a ``host_pool`` uses:
``load_back``, ``wait_load``, ``poll``, ``wait_all``, ``evict_host``, and the internals behind
them and behind the tier branches of match_prefix, insert, lock, unlock, alloc, evict and
check_invariants: copies in flight, backups, demotion to the host tier, host eviction, the two
eviction indexes' membership, and the residency moves. The rules are stated once, in the
RadixCache docstring; docs/cache_design.md ("Tiers") explains them. Nothing here runs, and
nothing here costs anything, when ``host_pool`` is None.

The attributes used below belong to RadixCache (``__init__`` creates them): the trie (``root``,
``_index``, counters, ``_events``), and the tier's ``_host`` (the host PagePool), ``_copies``
(the InFlight records not yet retired, in issue order) and ``_tier`` (TierState: the copier,
the write policy, the host eviction index, the host page counters and the tier's stats).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NoReturn

from radixkv.cache.errors import InvariantError
from radixkv.cache.events import BlockRemoved, BlockStored
from radixkv.cache.node import TreeNode
from radixkv.cache.page_pool import PagePool
from radixkv.cache.tiers import (
    BACKUP,
    HOST_MEDIUM,
    LOAD,
    WRITE_BACK,
    WRITE_POLICIES,
    WRITE_THROUGH,
    WRITE_THROUGH_SELECTIVE,
    InFlight,
    LoadBack,
)
from radixkv.cache.tokens import TOKEN_SHIFT, key_to_list

if TYPE_CHECKING:
    from radixkv.cache.radix_cache import MatchResult

__all__ = ["HostTier"]


def _fail(msg: str) -> NoReturn:
    raise InvariantError(msg)


def check_tier_args(
    pool: PagePool,
    host_pool: PagePool | None,
    copier: Any,
    write_policy: Any,
    threshold: Any,
) -> None:
    """RadixCache's host-tier arguments, checked before anything is built."""
    if write_policy not in WRITE_POLICIES:
        raise ValueError(f"write_policy must be one of {WRITE_POLICIES}, got {write_policy!r}")
    if type(threshold) is not int or threshold < 1:
        raise ValueError(f"write_through_threshold must be an int >= 1, got {threshold!r}")
    if host_pool is None:
        if copier is not None:
            raise ValueError("a copier was given without a host_pool: no host tier to copy to")
        return
    if not isinstance(host_pool, PagePool):
        raise TypeError(f"host_pool must be a PagePool, got {type(host_pool).__name__}")
    if host_pool is pool:
        raise ValueError("host_pool must be a PagePool of its own, not the device pool")
    if host_pool.num_pages < 1:
        raise ValueError(
            "host_pool has no pages: a host tier needs at least one page (pass host_pool=None "
            "for no host tier)"
        )
    if host_pool.num_free != host_pool.num_pages:
        raise ValueError("host_pool must be unused: some of its pages are already allocated")
    if copier is None:
        raise ValueError("a host tier needs a copier (radixkv.cache.tiers.Copier) to move pages")
    for name in ("to_host", "to_device"):
        if not callable(getattr(copier, name, None)):
            raise TypeError(f"copier must have a callable {name}(pairs) method, got {copier!r}")


class TierState:
    """The host tier's state and counters, one attribute of the cache (``_tier``)."""

    __slots__ = (
        "backup_failures",
        "backup_pages",
        "backup_skipped",
        "copier",
        "demoted_pages",
        "hindex",
        "host_cached",
        "host_evictable",
        "host_evicted_pages",
        "host_hit_tokens",
        "load_failures",
        "loaded_pages",
        "threshold",
        "write_back_pages",
        "write_policy",
    )

    def __init__(
        self, host: PagePool | None, copier: Any, write_policy: str, threshold: int
    ) -> None:
        self.copier = copier
        self.write_policy = write_policy
        self.threshold = threshold
        self.hindex: Any = None  # HostEvictionIndex, with a host pool
        self.host_cached = 0  # host pages owned by nodes
        self.host_evictable = 0  # host pages of unlocked nodes
        # cumulative (CacheStats)
        self.host_hit_tokens = self.loaded_pages = self.load_failures = 0
        self.backup_pages = self.write_back_pages = self.backup_failures = 0
        self.backup_skipped = self.demoted_pages = self.host_evicted_pages = 0


class HostTier:
    """Host-tier methods of RadixCache (see the module docstring); not used on its own."""

    # Declared for readers and type checkers; RadixCache.__init__ sets them.
    _host: PagePool | None
    _copies: list[InFlight]
    _tier: TierState

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

    # ---- the tiers' internals: nothing below validates; callers hold the preconditions
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
        self._evicted_pages += k
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
        self._evicted_pages += len(freed)
        self._host.release_cached(host_freed)
        self._tier.host_cached -= len(host_freed)
        self._tier.host_evictable -= len(host_freed)
        self._tier.host_evicted_pages += len(host_freed)
        self._num_nodes -= len(sub)
        self._evicted_nodes += len(sub)
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
        if len(self._tier.hindex) != len(stored):
            _fail("host eviction index has duplicate keys")
