"""Per-sequence page bookkeeping against the radix cache: match/lock, allocate, insert, release.

``SeqKV`` is the only engine code that calls the cache. Ownership of a sequence's pages:
``page_table[:num_shared_pages]`` are trie pages kept alive by one lock on ``locked_node``;
``page_table[num_shared_pages:]`` are private (allocated from ``cache.alloc``, freed or handed
to the trie by ``insert``). With the prefix cache disabled nothing is matched or inserted:
every page is private and is freed when the sequence is released. Sessions' pins (locks that
keep a state's pages cached between requests, session.py) are taken and counted here too.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable

from radixkv.cache import RadixCache, TreeNode
from radixkv.engine.request import Namespace, Sequence
from radixkv.pages import pages_for


class SeqKV:
    """Moves sequences' pages between the pool, the trie and the sequences.

    Every method leaves the cache's invariants intact; on ``OutOfPages`` nothing is changed.
    """

    def __init__(self, cache: RadixCache, *, enable_prefix_cache: bool) -> None:
        self.cache = cache
        self.page_size: int = cache.page_size
        self.enabled = enable_prefix_cache
        self.num_private_pages = 0  # pages held privately by sequences (for invariants/stats)
        self.num_pins = 0  # locks held by pin() and not yet unpinned
        self.tiered = cache.host_pool is not None
        # host tier: tokens the last acquire() loaded back, and cumulative load-back wait time
        self.last_loaded_tokens = 0
        self.load_back_seconds = 0.0

    # ------------------------------------------------------------------ lookups
    def peek_match_len(self, seq: Sequence) -> int:
        """Tokens a fresh ``acquire`` would hit now (no lock taken, nothing in the cache changes:
        no split, no recency or hit-count refresh, so LFU/LRU order and stats stay honest)."""
        if not self.enabled or len(seq.token_ids) <= 1:
            return 0
        # a host continuation counts: loading it back is a copy, not a forward
        return self.cache.peek_prefix(seq.token_ids[:-1], namespace=seq.namespace, host=True)

    def available_pages(self) -> int:
        """Pages an allocation could get now: free ones plus cached ones eviction could free."""
        return self.cache.pool.num_free + self.cache.num_evictable_pages

    # ------------------------------------------------------------------ admission
    def acquire(self, seq: Sequence) -> int:
        """Match the sequence's longest cached prefix (capped at len - 1 so the last token is
        computed and yields logits) and lock it. Requires a sequence holding no pages.
        Returns the number of tokens hit.

        With a host tier, a continuation found there is loaded back into device pages (a copy)
        that is only started here: it runs (copier thread / side stream) while the rest of the
        batch is scheduled, and :meth:`finish_loads` waits for it before the forward reads
        it. ``last_loaded_tokens`` says how many of the tokens hit are being loaded. A sequence
        whose earlier load failed (``skip_host``) hits its device prefix only."""
        assert not seq.page_table and seq.locked_node is None, seq
        self.last_loaded_tokens = 0
        if not self.enabled or len(seq.token_ids) <= 1:
            seq.num_computed = 0
            return 0
        cache = self.cache
        m = cache.match_prefix(seq.token_ids[:-1], namespace=seq.namespace)
        node, pages, hit = m.node, m.pages, m.num_tokens
        if m.num_host_tokens and not seq.skip_host:
            t = time.perf_counter()
            lb = cache.load_back(m)
            node, pages, hit = lb.node, lb.pages, lb.num_tokens
            if lb.num_loaded_tokens:
                seq.load = lb
                self.last_loaded_tokens = lb.num_loaded_tokens
            self.load_back_seconds += time.perf_counter() - t
        cache.lock(node)
        seq.locked_node = node
        seq.page_table = list(pages)
        seq.num_shared_pages = len(pages)
        seq.num_computed = hit
        return hit

    def finish_loads(self, seqs: Iterable[Sequence]) -> list[Sequence]:
        """Wait for the host-tier loads the sequences started in :meth:`acquire`; call before a
        forward reads their pages. Returns the sequences whose copy failed: their loaded pages
        went back to the pool (the nodes are host-only again), so their page tables are not
        valid past the device prefix (their ``load`` stays set until then, for the record);
        the caller must release them (``insert=False``) and admit them again, which then hits
        the device prefix only."""
        failed = []
        t = time.perf_counter()
        for seq in seqs:
            lb = seq.load
            if lb is None:
                continue
            if self.cache.wait_load(lb):
                seq.load = None
            else:
                seq.skip_host = True
                failed.append(seq)
        self.load_back_seconds += time.perf_counter() - t
        return failed

    def pages_needed(self, seq: Sequence, num_new: int) -> int:
        """Private pages to allocate so ``num_new`` more tokens have slots."""
        return max(0, pages_for(seq.num_computed + num_new, self.page_size) - len(seq.page_table))

    def reserve(self, seq: Sequence, num_new: int) -> None:
        """Give the sequence slots for ``num_new`` more tokens (may evict unlocked cache
        entries). Raises OutOfPages and changes nothing if the pool cannot supply them."""
        n = self.pages_needed(seq, num_new)
        if n:
            seq.page_table.extend(self.cache.alloc(n))
            self.num_private_pages += n

    # ------------------------------------------------------------------ publishing
    def commit(self, seq: Sequence) -> None:
        """Insert the sequence's computed full pages not yet in the trie; from then on it uses
        the canonical pages (duplicates computed concurrently by another sequence are freed by
        the cache) and holds its lock on the deeper node."""
        if not self.enabled:
            return
        ps = self.page_size
        k = seq.num_computed // ps  # whole pages computed
        if k <= seq.num_shared_pages:
            return
        r = self.cache.insert(seq.token_ids[: k * ps], seq.page_table[:k], namespace=seq.namespace)
        self.cache.lock(r.node)
        if seq.locked_node is not None:
            self.cache.unlock(seq.locked_node)
        seq.locked_node = r.node
        seq.page_table[:k] = r.pages
        self.num_private_pages -= k - seq.num_shared_pages
        seq.num_shared_pages = k

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
            self.cache.pool.free(extra)
            self.num_private_pages -= len(extra)
            del seq.page_table[keep:]

    # ------------------------------------------------------------------ pins (sessions)
    def pin(self, tokens: list[int], namespace: Namespace) -> TreeNode | None:
        """Lock the deepest cached node of ``tokens`` so its pages stay cached until
        :meth:`unpin`; None (nothing pinned) with the prefix cache off."""
        if not self.enabled:
            return None
        node = self.cache.match_prefix(tokens, namespace=namespace).node
        self.cache.lock(node)
        self.num_pins += 1
        return node

    def unpin(self, node: TreeNode) -> None:
        """Release a lock taken by :meth:`pin`."""
        self.cache.unlock(node)
        self.num_pins -= 1

    # ------------------------------------------------------------------ cache-wide
    def poll(self) -> None:
        """Retire finished host-tier copies (write-through backups); no-op without a tier."""
        if self.tiered:
            self.cache.poll()

    @property
    def num_free_pages(self) -> int:
        return self.cache.pool.num_free

    @property
    def num_cached_pages(self) -> int:
        return self.cache.num_cached_pages

    @property
    def num_evicted_pages(self) -> int:
        """Pages evicted from the cache since it was built."""
        return self.cache.stats.evicted_pages

    def reset_cache(self) -> None:
        """Drop every unlocked cache entry (running sequences and pins keep theirs)."""
        self.cache.reset()

    def check_invariants(self, running: Iterable[Sequence], *, idle: bool) -> None:
        """Raise AssertionError unless: the cache's invariants hold; free + cached + private ==
        total pages; each running sequence's shared pages are exactly its locked node's path;
        no page is held twice. ``idle`` (nothing queued or running): unless a pin is held,
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
        if idle and not self.num_pins:
            assert self.num_private_pages == 0, "private pages remain after drain"
            # a host-tier copy in flight holds its own lock until poll() retires it
            busy = self.tiered and cache.stats.copies_in_flight
            for node in () if busy else cache.iter_nodes():
                if node.parent is not None:
                    assert node.lock_ref == 0, f"lock_ref {node.lock_ref} after drain"
