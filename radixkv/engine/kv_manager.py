"""Per-sequence page bookkeeping against the radix cache: match/lock, allocate, insert, release.

This is the only engine code that calls the cache. Ownership of a sequence's pages:
``page_table[:num_shared_pages]`` are trie pages kept alive by one lock on ``locked_node``;
``page_table[num_shared_pages:]`` are private (allocated from ``cache.alloc``, freed or handed
to the trie by ``insert``). With the prefix cache disabled nothing is matched or inserted:
every page is private and is freed when the sequence is released.
"""

from __future__ import annotations

import contextlib
from typing import Any

from radixkv.engine.request import Sequence


class SeqKV:
    """Moves sequences' pages between the pool, the trie and the sequences.

    Every method leaves the cache's invariants intact; on ``OutOfPages`` nothing is changed.
    """

    def __init__(self, cache: Any, *, enable_prefix_cache: bool) -> None:
        self.cache = cache
        self.page_size: int = cache.page_size
        self.enabled = enable_prefix_cache
        self.num_private_pages = 0  # pages held privately by sequences (for invariants/stats)

    # ------------------------------------------------------------------ lookups
    def peek_match_len(self, seq: Sequence) -> int:
        """Tokens a fresh ``acquire`` would hit now (no lock taken, nothing in the cache changes:
        no split, no recency or hit-count refresh, so LFU/LRU order and stats stay honest)."""
        if not self.enabled or len(seq.token_ids) <= 1:
            return 0
        return self.cache.peek_prefix(seq.token_ids[:-1], namespace=seq.namespace)

    # ------------------------------------------------------------------ admission
    def acquire(self, seq: Sequence) -> int:
        """Match the sequence's longest cached prefix (capped at len - 1 so the last token is
        computed and yields logits) and lock it. Requires a sequence holding no pages.
        Returns the number of tokens hit."""
        assert not seq.page_table and seq.locked_node is None, seq
        if not self.enabled or len(seq.token_ids) <= 1:
            seq.num_computed = 0
            return 0
        m = self.cache.match_prefix(seq.token_ids[:-1], namespace=seq.namespace)
        self.cache.lock(m.node)
        seq.locked_node = m.node
        seq.page_table = list(m.pages)
        seq.num_shared_pages = len(m.pages)
        seq.num_computed = m.num_tokens
        return m.num_tokens

    def pages_needed(self, seq: Sequence, num_new: int) -> int:
        """Private pages to allocate so ``num_new`` more tokens have slots."""
        ps = self.page_size
        return max(0, -(-(seq.num_computed + num_new) // ps) - len(seq.page_table))

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
        k = seq.num_computed // ps
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
        keep = max(seq.num_shared_pages, -(-seq.num_computed // self.page_size))
        extra = seq.page_table[keep:]
        if extra:
            self.cache.pool.free(extra)
            self.num_private_pages -= len(extra)
            del seq.page_table[keep:]
