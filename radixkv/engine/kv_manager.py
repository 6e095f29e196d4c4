"""Per-sequence page bookkeeping against the radix cache: match/lock, allocate, insert, release.

``SeqKV`` is the engine's door to the cache: no other engine code calls it but the storage
tier (storage_tier.py), which lands prefetched pages in the host tier and observes host pages
to write (tests/test_doors.py keeps this). Ownership of a sequence's pages:
``page_table[:num_shared_pages]`` are trie pages kept alive by one lock on ``locked_node``;
``page_table[num_shared_pages:]`` are private (allocated from ``cache.alloc``, freed or handed
to the trie by ``insert``). With the prefix cache disabled nothing is matched or inserted:
every page is private and is freed when the sequence is released. Sessions' pins (locks that
keep a state's pages cached between requests, session.py) are taken and counted here too.

With a storage tier (storage_tier.py), a queued request's prefix past its device + host hit is
looked up in storage in the background, and what was found is put in the host tier at the start
of a step, so that admission loads it back like any host hit; SeqKV only reads the outcome of
a request's prefetch (``prefetch_pending``, ``storage_hit_tokens``).

With hybrid window KV (``window``: radixkv/cache/window_slots.py) each new page also gets a
window slot (its sliding-window layers' K/V), and a sequence pins the slots of
``page_table[window_lo:]``, the pages its windows read next step: from the page holding token
``num_computed - window + 1`` on. After each step (``commit``) the pages its windows left are
unpinned and stay cached (or, with the prefix cache off, give their slots back). A cached
prefix is matched only as far as its last window still has slots. Each new page needs a page
and a slot, so ``available_pages`` is the smaller supply of the two.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable, Iterable

from radixkv.cache import CacheStats, OutOfPages, RadixCache, TreeNode, WindowSlots
from radixkv.cache.events import Listener
from radixkv.engine.request import Namespace, Sequence
from radixkv.pages import pages_for, window_start_page


class SeqKV:
    """Moves sequences' pages between the pool, the trie and the sequences.

    Every method leaves the cache's invariants intact; on ``OutOfPages`` nothing is changed.
    """

    def __init__(
        self,
        cache: RadixCache,
        *,
        enable_prefix_cache: bool,
        window: WindowSlots | None = None,
        window_tokens: int = 0,
    ) -> None:
        self.cache = cache
        self.page_size: int = cache.page_size
        self.enabled = enable_prefix_cache
        self.num_private_pages = 0  # pages held privately by sequences (for invariants/stats)
        # locks held by pin() and not yet unpinned, per node (drop_pins() releases them all),
        # and with window slots the pages whose slots each of those pins holds
        self._pins: dict[TreeNode, int] = {}
        self._pin_windows: dict[TreeNode, list[list[int]]] = {}
        self.tiered = cache.host_pool is not None
        # host tier: tokens the last acquire() loaded back, and cumulative load-back wait time
        self.last_loaded_tokens = 0
        self.load_back_seconds = 0.0
        # sequences whose layer-wise load the next forward reads as it lands (finish_loads)
        self.landing: list[Sequence] = []
        # storage tier: of the last acquire's loaded tokens, how many a prefetch had brought
        # from storage
        self.last_storage_tokens = 0
        # hybrid window KV: the window slots and the model's largest window (tokens); a
        # finished sequence keeps the slots of that window and a quarter before its end
        self.window = window
        self.window_tokens = window_tokens
        self._final_window = window_tokens + window_tokens // 4
        # cached tokens matches gave up because the window before them had lost its slots
        self.window_trimmed_tokens = 0
        if window is not None and window_tokens < 1:
            raise ValueError("SeqKV: window slots need the model's largest window (window_tokens)")

    # ------------------------------------------------------------------ lookups
    def peek_match_len(self, seq: Sequence) -> int:
        """Tokens a fresh ``acquire`` would hit now (no lock taken, nothing in the cache changes:
        no split, no recency or hit-count refresh, so LFU/LRU order and stats stay honest).
        With window slots, only as far as ``acquire`` would keep the match: where the window
        before its end still has slots."""
        if not self.enabled or len(seq.token_ids) <= 1:
            return 0
        tokens = seq.token_ids[: seq.reuse_limit]
        if self.window is not None:
            pages = self.cache.peek_pages(tokens, namespace=seq.namespace)
            usable = self.window.usable_prefix(pages, self.window_tokens, self.page_size)
            return usable * self.page_size
        # a host continuation counts: loading it back is a copy, not a forward
        return self.cache.peek_prefix(tokens, namespace=seq.namespace, host=True)

    def available_pages(self) -> int:
        """Pages an allocation could get now: free ones plus cached ones eviction could free
        (with window slots, no more than the slots ``attach`` could give)."""
        n = self.cache.pool.num_free + self.cache.num_evictable_pages
        return n if self.window is None else min(n, self.window.num_available)

    def window_first_page(self, num_tokens: int) -> int:
        """The first page a sequence's windows read when its next query is token
        ``num_tokens`` (hybrid window KV)."""
        return window_start_page(num_tokens, self.window_tokens, self.page_size)

    # ------------------------------------------------------------------ admission
    def acquire(self, seq: Sequence) -> int:
        """Match the sequence's longest cached prefix (capped at ``seq.reuse_limit``: len - 1,
        so the last token is computed and yields logits, or less while the sequence owes prompt
        logprobs) and lock it. Requires a sequence holding no pages.
        Returns the number of tokens hit.

        With a host tier, a continuation found there is loaded back into device pages (a copy)
        that is only started here: it runs (copier thread / side stream) while the rest of the
        batch is scheduled, and :meth:`finish_loads` waits for it before the forward reads
        it. ``last_loaded_tokens`` says how many of the tokens hit are being loaded. A sequence
        whose earlier load failed (``skip_host``) hits its device prefix only."""
        assert not seq.page_table and seq.locked_node is None, seq
        self.last_loaded_tokens = self.last_storage_tokens = 0
        seq.window_lo = 0
        if not self.enabled or len(seq.token_ids) <= 1:
            seq.num_computed = 0
            return 0
        cache = self.cache
        m = cache.match_prefix(seq.token_ids[: seq.reuse_limit], namespace=seq.namespace)
        node, pages, hit = m.node, m.pages, m.num_tokens
        if m.num_host_tokens and not seq.skip_host:
            t = time.perf_counter()
            lb = cache.load_back(m)
            node, pages, hit = lb.node, lb.pages, lb.num_tokens
            if lb.num_loaded_tokens:
                seq.load = lb
                self.last_loaded_tokens = lb.num_loaded_tokens
            self.load_back_seconds += time.perf_counter() - t
        window = self.window
        if window is not None and pages:
            # the tokens after the prefix read its last window in the windowed layers: it
            # serves only as far as that window has slots
            k = window.usable_prefix(pages, self.window_tokens, self.page_size)
            if k < len(pages):
                self.window_trimmed_tokens += hit - k * self.page_size
                m = cache.match_prefix(seq.token_ids[: k * self.page_size], namespace=seq.namespace)
                node, pages, hit = m.node, m.pages, m.num_tokens
        cache.lock(node)
        self.last_storage_tokens = self.storage_hit_tokens(seq, hit, self.last_loaded_tokens)
        seq.locked_node = node
        seq.page_table = list(pages)
        seq.num_shared_pages = len(pages)
        seq.num_computed = hit
        if window is not None:
            seq.window_lo = self.window_first_page(hit)
            window.pin(pages[seq.window_lo :])
        return hit

    def finish_loads(self, seqs: Iterable[Sequence], *, layered: bool = False) -> list[Sequence]:
        """Wait for the host-tier loads the sequences started in :meth:`acquire`; call before a
        forward reads their pages. Returns the sequences whose copy failed: their loaded pages
        went back to the pool (the nodes are host-only again), so their page tables are not
        valid past the device prefix (their ``load`` stays set until then, for the record);
        the caller must release them (``insert=False``) and admit them again, which then hits
        the device prefix only.

        A layer-wise load (``LoadBack.layered``) still landing is not waited for here: the
        forward waits for each layer of it before reading that layer, and the sequence is
        listed in ``landing``;
        after the forward, before its results are used, the caller must call
        :meth:`finish_landing` (when ``landing`` is not empty); ``layered=True`` waits for
        those too."""
        failed = []
        t = time.perf_counter()
        if self.landing:  # left by a forward that raised: those loads retire by poll()
            self.landing = []
        for seq in seqs:
            lb = seq.load
            if lb is None:
                continue
            # still landing: the forward waits for it layer by layer (KVPool.loads)
            if lb.layered and not layered and not lb.handle.done():
                self.landing.append(seq)
                continue
            if self.cache.wait_load(lb):
                seq.load = None
            else:
                seq.skip_host = True
                failed.append(seq)
        self.load_back_seconds += time.perf_counter() - t
        return failed

    def finish_landing(self) -> list[Sequence]:
        """After a forward: wait for (and retire) the layer-wise loads of ``landing``, which
        that forward read layer by layer as they landed. Returns the sequences whose copy
        failed, as :meth:`finish_loads` does: what the forward computed from their pages is
        garbage (only theirs: no one else reads a page being loaded), so the caller drops
        them as after a failed ``finish_loads`` and does not use the step's results for them."""
        landing, self.landing = self.landing, []
        return self.finish_loads([s for s in landing if s.load is not None], layered=True)

    def max_chunk(self, seq: Sequence) -> int | None:
        """Most tokens one step could ever compute for the sequence: with window slots, as
        many as fit in all of them beside the pages it pins already (each new page takes one,
        pinned through the step); None: no limit but the pool's."""
        if self.window is None:
            return None
        return max(0, (self.window.num_slots + seq.window_lo) * self.page_size - seq.num_computed)

    def pages_needed(self, seq: Sequence, num_new: int) -> int:
        """Private pages to allocate so ``num_new`` more tokens have slots."""
        return max(0, pages_for(seq.num_computed + num_new, self.page_size) - len(seq.page_table))

    def reserve(self, seq: Sequence, num_new: int) -> None:
        """Give the sequence slots for ``num_new`` more tokens (may evict unlocked cache
        entries; with window slots, each new page gets one, pinned). Raises OutOfPages and
        changes nothing if the pool cannot supply them."""
        n = self.pages_needed(seq, num_new)
        if n:
            self._check_window_slots(n)
            pages = self.cache.alloc(n)
            if self.window is not None:
                self.window.attach(pages)  # cannot fail: checked above (evicting pages
                # frees their slots, leaving free + cached slots as they were)
            seq.page_table.extend(pages)
            self.num_private_pages += n

    def _check_window_slots(self, n: int) -> None:
        if self.window is not None and self.window.num_available < n:
            raise OutOfPages(n, self.window.num_available, "free or cached window slot")

    # ------------------------------------------------------------------ publishing
    def commit(self, seq: Sequence) -> None:
        """Insert the sequence's computed full pages not yet in the trie; from then on it uses
        the canonical pages (duplicates computed concurrently by another sequence are freed by
        the cache) and holds its lock on the deeper node. With window slots, then unpin the
        pages its windows no longer read."""
        if self.enabled and seq.num_computed // self.page_size > seq.num_shared_pages:
            self._publish(seq)  # (a decode step mostly completes no page: nothing to insert)
        if self.window is not None:
            lo = self.window_first_page(seq.num_computed)
            if lo > seq.window_lo:
                self._unpin_window(seq, seq.window_lo, lo, final=False)
                seq.window_lo = lo

    def _unpin_window(self, seq: Sequence, a: int, b: int, *, final: bool) -> None:
        """Unpin ``seq.page_table[a:b]``. Cached, they keep their slots longer where a later
        match may end after them: in the window before the end of a node on the sequence's
        path that branches, or (``final``: the sequence is done) in the window and a quarter
        before its own end (the next turn of a conversation continues at the end; another
        question on the same document branches a little before it); the others, a window
        merely passed, are taken first (WindowSlots' two orders)."""
        window = self.window
        assert window is not None
        pages = seq.page_table[a:b]
        if not self.enabled:  # no match will ever read them
            window.unpin(pages, keep=False)
            return
        ps = self.page_size
        keep: set[int] = set()
        tail = 0
        if final:  # the span it keeps
            end = seq.locked_node.depth_tokens if seq.locked_node is not None else 0
            tail = window_start_page(end, self._final_window, ps)
            keep.update(range(max(a, tail), min(b, pages_for(end, ps))))
        node = seq.locked_node
        while node is not None and node.depth_tokens > a * ps:  # depths shrink going up
            if node.is_branch:
                end = node.depth_tokens
                lo = window_start_page(end, self.window_tokens, ps)
                keep.update(range(max(a, lo), min(b, pages_for(end, ps))))
            node = node.parent
        if keep:
            window.unpin([p for i, p in enumerate(pages, a) if i in keep])
        window.unpin([p for i, p in enumerate(pages, a) if i not in keep], passed=True)
        if final:  # the part of that span its window passed already goes to the kept order
            window.keep(seq.page_table[tail : min(a, seq.num_shared_pages)])

    def _publish(self, seq: Sequence) -> None:
        ps = self.page_size
        k = seq.num_computed // ps  # whole pages computed
        shared = seq.num_shared_pages
        if k <= shared:
            return
        mine = seq.page_table[shared:k]
        r = self.cache.insert(seq.token_ids[: k * ps], seq.page_table[:k], namespace=seq.namespace)
        self.cache.lock(r.node)
        if seq.locked_node is not None:
            self.cache.unlock(seq.locked_node)
        seq.locked_node = r.node
        if self.window is not None:  # a pinned duplicate hands its pins (and slot) over
            lo = seq.window_lo
            for j, (old, new) in enumerate(zip(mine, r.pages[shared:k]), start=shared):
                if old != new and j >= lo:
                    self.window.replace(old, new)
        seq.page_table[:k] = r.pages
        self.num_private_pages -= k - shared
        seq.num_shared_pages = k

    def fork(
        self,
        parent: Sequence,
        child: Sequence,
        copy_pages: Callable[[list[int], list[int]], None],
    ) -> bool:
        """Give ``child`` (holding nothing) the KV of ``parent``'s computed tokens: the same
        shared pages under one more lock on the parent's node, and a copy of each private page
        (``copy_pages(src, dst)`` copies page contents; with the prefix cache on, only the
        partial tail page is private once ``commit`` ran). Sets the child's page fields and
        ``num_computed``. False, changing nothing, when the pool cannot supply the copies."""
        assert not child.page_table and child.locked_node is None, child
        shared = parent.num_shared_pages
        private = parent.page_table[shared:]
        lo = parent.window_lo
        # with window slots, the copies of pages the parent's windows read get slots too
        windowed = len(private) - max(0, lo - shared)
        try:
            self._check_window_slots(windowed)
            pages = self.cache.alloc(len(private)) if private else []
        except OutOfPages:
            return False
        window = self.window
        if window is not None:
            window.attach(pages[len(pages) - windowed :])
        if pages:
            copy_pages(private, pages)
            self.num_private_pages += len(pages)
        node = parent.locked_node
        if node is not None:
            self.cache.lock(node)
        child.locked_node = node
        child.page_table = parent.page_table[:shared] + pages
        child.num_shared_pages = shared
        child.num_computed = parent.num_computed
        if window is not None:
            child.window_lo = lo
            window.pin(child.page_table[lo:shared])
        return True

    # ------------------------------------------------------------------ release
    def release(self, seq: Sequence, *, insert: bool = True) -> None:
        """Drop everything the sequence holds: publish its computed full pages (if ``insert``
        and the cache is on), unlock its node and free its private pages. Idempotent."""
        if insert:
            # publishing is an optimisation; freeing below must happen even if it fails
            with contextlib.suppress(Exception):
                self.commit(seq)
        # a load still in flight keeps its own lock until the cache retires it (poll)
        seq.load = None
        if self.window is not None:  # private pages' slots go back with the pages
            self._unpin_window(seq, seq.window_lo, len(seq.page_table), final=True)
            seq.window_lo = 0
        private = seq.page_table[seq.num_shared_pages :]
        if private:
            self.cache.pool.free(private)
            self.num_private_pages -= len(private)
        if seq.locked_node is not None:
            self.cache.unlock(seq.locked_node)
        seq.locked_node = None
        seq.page_table = []
        seq.num_shared_pages = 0
        seq.num_computed = 0

    def rollback_uncomputed(self, seq: Sequence) -> None:
        """Free private pages allocated past ``num_computed`` (a step that failed)."""
        keep = max(seq.num_shared_pages, pages_for(seq.num_computed, self.page_size))
        extra = seq.page_table[keep:]
        if extra:
            if self.window is not None:
                self.window.unpin(extra, keep=False)
            self.cache.pool.free(extra)
            self.num_private_pages -= len(extra)
            del seq.page_table[keep:]

    # ------------------------------------------------------------------ pins (sessions)
    def pin(self, tokens: list[int], namespace: Namespace) -> TreeNode | None:
        """Lock the deepest cached node of ``tokens`` so its pages stay cached until
        :meth:`unpin`; None (nothing pinned) with the prefix cache off. With window slots,
        the window before the node's end keeps its slots too (when it still has them all),
        so the state can be continued from there."""
        if not self.enabled:
            return None
        m = self.cache.match_prefix(tokens, namespace=namespace)
        node = m.node
        self.cache.lock(node)
        self._pins[node] = self._pins.get(node, 0) + 1
        window = self.window
        if window is not None:
            pages = m.pages
            held: list[int] = []
            if window.usable_prefix(pages, self.window_tokens, self.page_size) == len(pages):
                held = pages[self.window_first_page(len(pages) * self.page_size) :]
                window.pin(held)
            self._pin_windows.setdefault(node, []).append(held)
        return node

    def unpin(self, node: TreeNode) -> None:
        """Release a lock taken by :meth:`pin`; a no-op for a pin :meth:`drop_pins` dropped."""
        count = self._pins.get(node)
        if count is None:
            return
        if count == 1:
            del self._pins[node]
        else:
            self._pins[node] = count - 1
        self._unpin_pin_window(node)
        self.cache.unlock(node)

    def _unpin_pin_window(self, node: TreeNode) -> None:
        if self.window is not None:
            held = self._pin_windows[node].pop()
            if not self._pin_windows[node]:
                del self._pin_windows[node]
            self.window.unpin(held)

    @property
    def num_pins(self) -> int:
        """Locks held by :meth:`pin` and not yet released."""
        return sum(self._pins.values())

    def drop_pins(self) -> int:
        """Release every pin now (their holders' later ``unpin`` does nothing); returns how
        many. For KV that must not be reused (new weights): a pinned node cannot be reset."""
        n = 0
        for node, count in self._pins.items():
            for _ in range(count):
                self._unpin_pin_window(node)
                self.cache.unlock(node)
            n += count
        self._pins.clear()
        return n

    # ------------------------------------------------------------------ storage prefetch results
    def storage_hit_tokens(self, seq: Sequence, hit: int, loaded: int) -> int:
        """Of ``hit`` tokens, ``loaded`` of them from the host tier, those its request's storage
        prefetch had put there (0 without one; the prefetch itself: storage_tier.py)."""
        job = seq.group.prefetch
        return 0 if job is None else job.hit_tokens(hit, loaded)

    def prefetch_pending(self, seq: Sequence) -> bool:
        """Whether the sequence should wait for its request's storage prefetch before
        admission (not landed yet, and before its deadline)."""
        job = seq.group.prefetch
        return job is not None and job.holds_back(time.monotonic())

    # ------------------------------------------------------------------ cache-wide
    def poll(self) -> None:
        """Retire finished host-tier copies (backups, load-backs) without blocking; no-op
        without a host tier."""
        if self.tiered:
            self.cache.poll()

    @property
    def copies_in_flight(self) -> int:
        """Host-tier copies still running (each locks its nodes' pages until it is retired)."""
        return self.cache.copies_in_flight if self.tiered else 0

    def wait_copies(self) -> None:
        """Wait for every host-tier copy in flight and retire it (before the copier stops);
        no-op without a host tier."""
        if self.tiered:
            self.cache.wait_all()

    def _check_window(self, running: Iterable[Sequence], *, idle: bool) -> None:
        """The window slots' own invariants, and the pins are exactly the running sequences':
        each pins ``page_table[window_lo:]``, which starts no later than what its windows
        read next step."""
        window = self.window
        assert window is not None
        window.check_invariants(self.cache.pool)
        want: Counter[int] = Counter()
        for s in running:
            assert s.window_lo <= self.window_first_page(s.num_computed), (
                f"{s}: pins from page {s.window_lo}, its windows read from "
                f"{self.window_first_page(s.num_computed)}"
            )
            want.update(s.page_table[s.window_lo :])
        for held in self._pin_windows.values():  # sessions' pins
            for pages in held:
                want.update(pages)
        assert want == window.pinned(), "window slot pins differ from the running sequences'"
        if idle and not self._pins:
            assert not window.num_pinned, "window slots pinned after drain"

    @property
    def num_free_pages(self) -> int:
        return self.cache.pool.num_free

    @property
    def num_cached_pages(self) -> int:
        return self.cache.num_cached_pages

    @property
    def num_locked_pages(self) -> int:
        """Cached pages that locks protect from eviction (running requests', pins')."""
        return self.cache.num_locked_pages

    def add_listener(self, fn: Listener) -> None:
        """Call ``fn(event)`` for every KV event of the cache (BlockStored, BlockRemoved,
        AllBlocksCleared), synchronously, in the thread that steps the engine: add and remove
        listeners from that thread too."""
        self.cache.add_listener(fn)

    def remove_listener(self, fn: Listener) -> None:
        """Stop calling ``fn`` (added by :meth:`add_listener`)."""
        self.cache.remove_listener(fn)

    def cache_stats(self) -> CacheStats:
        """A snapshot of every cache counter (a report's; it builds some 30 fields, so hot
        paths read the counters they need instead)."""
        return self.cache.stats

    def namespaces(self) -> list[Namespace]:
        """The namespaces other than the default (None) that hold cached entries."""
        return self.cache.namespaces

    def invalidate(self) -> tuple[int, int]:
        """Drop every cached page of the device and host tiers, pinned ones included: KV that
        must never be reused (the weights changed; the storage tier's prefetches in flight
        are dropped by its ``rekey``). No sequence may hold pages (retract or finish them
        first). Returns the (device, host) pages dropped."""
        cache = self.cache
        cache.wait_all()  # a copy in flight locks its node: retire it first
        self.drop_pins()
        dropped = cache.num_cached_pages, cache.num_host_pages
        cache.reset()
        if cache.num_cached_pages or cache.num_host_pages:  # a lock nobody accounts for
            raise RuntimeError(
                f"{cache.num_cached_pages} device and {cache.num_host_pages} host pages stayed "
                "locked in the cache when every user had released them"
            )
        return dropped

    def reset_cache(self, namespaces: Iterable[Namespace] | None = None) -> None:
        """Drop every unlocked cache entry (running sequences and pins keep theirs), or only
        those of ``namespaces``."""
        if namespaces is None:
            self.cache.reset()
        else:
            for ns in namespaces:
                self.cache.reset(namespace=ns)

    def check_invariants(self, running: Iterable[Sequence], *, idle: bool) -> None:
        """Raise AssertionError unless: the cache's invariants hold; free + cached + private ==
        total pages; each running sequence's shared pages are exactly its locked node's path;
        no page is held twice; no host page is held (storage landings give theirs to the trie
        or back). ``idle`` (nothing queued or running): unless a pin is held,
        every lock count is zero (once the host tier's copies in flight are retired) and no
        private page remains."""
        cache, pool = self.cache, self.cache.pool
        cache.check_invariants()
        total = pool.num_free + cache.num_cached_pages + self.num_private_pages
        assert total == pool.num_pages, (
            f"pages: free {pool.num_free} + cached {cache.num_cached_pages} + private "
            f"{self.num_private_pages} != {pool.num_pages}"
        )
        seen: set[int] = set()
        for node in cache.iter_nodes():
            seen.update(node.pages)
        private_total = 0
        for s in running:
            if s.locked_node is not None:
                # the root's own count is not kept (locking it is a no-op)
                assert s.locked_node is cache.root or s.locked_node.lock_ref > 0, (
                    f"{s}: locked node has lock_ref 0"
                )
                path = cache.path_pages(s.locked_node)
                assert path == s.page_table[: s.num_shared_pages], f"{s}: shared pages != path"
            if not self.enabled:
                assert s.locked_node is None and s.num_shared_pages == 0, s
            private = s.page_table[s.num_shared_pages :]
            assert seen.isdisjoint(private), f"{s}: a private page is also elsewhere"
            seen.update(private)
            private_total += len(private)
        assert private_total == self.num_private_pages, "private page count out of sync"
        assert len(seen) + pool.num_free == pool.num_pages, "a page is held twice"
        if self.window is not None:
            self._check_window(running, idle=idle)
        if self.tiered:  # host pages are held only inside a call (a backup, a landing)
            assert cache.host_pool.num_held == 0, "host pages held outside a call"
        if idle and not self.num_pins:
            assert self.num_private_pages == 0, "private pages remain after drain"
            # a host-tier copy in flight holds its own lock until poll() retires it
            busy = self.tiered and cache.copies_in_flight
            for node in () if busy else cache.iter_nodes():
                if node.parent is not None:
                    assert node.lock_ref == 0, f"lock_ref {node.lock_ref} after drain"
