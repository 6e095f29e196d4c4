"""In-batch prefix sharing: which full pages running sequences are about to compute.

When several waiting requests share a prefix nobody has cached yet, only one should compute it.
A sequence admitted for prefill *announces* the keys of the full pages it will compute; a
candidate whose first uncached page is announced by someone else waits instead of computing it
too. When the announcing sequence's chunk finishes, its pages are inserted into the trie and the
candidate then hits them. ``n > 1`` samples rely on this to prefill their prompt once.

A page's key is the cache's own chained page hash (radixkv/cache/hashing.py ``page_hashes``:
it names the whole prefix up to that page, within the sequence's namespace). A collision can
only make a candidate wait a step for nothing: the trie compares tokens before it shares a page.

Owned by the scheduler. Mutates only its own counts and each sequence's ``page_keys`` (a memo)
and ``inflight_keys`` (what that sequence announced, in page order, not yet retired).
"""

from __future__ import annotations

from collections import deque

from radixkv.cache.hashing import page_hashes
from radixkv.engine.request import Sequence


class InflightPages:
    """Counts of announced page keys: ``key -> number of sequences computing that page``."""

    def __init__(self, page_size: int, *, enabled: bool) -> None:
        self.page_size = page_size
        self.enabled = enabled  # off with the prefix cache: nothing could be shared
        self.counts: dict[int, int] = {}

    def page_key(self, seq: Sequence, i: int) -> int:
        """Key of full page ``i`` of ``seq`` (memoised on the sequence)."""
        keys = seq.page_keys
        if len(keys) <= i:
            # the chain starts at page 0, so extend it by recomputing it up to page i: rare
            # (once per admission, as far as the prompt goes) and C-speed hashing
            ps = self.page_size
            keys[:] = page_hashes(seq.token_ids[: (i + 1) * ps], ps, seq.namespace)
        return keys[i]

    def computed_elsewhere(self, seq: Sequence) -> bool:
        """Another running sequence is computing ``seq``'s first uncached full page."""
        if not self.enabled or not self.counts:
            return False
        j = seq.num_computed // self.page_size
        if (j + 1) * self.page_size > seq.reuse_limit:
            # a page it could not take from the cache anyway (past its last token, or where
            # it owes prompt logprobs): nothing to wait for
            return False
        return self.page_key(seq, j) in self.counts

    def announce(self, seq: Sequence) -> None:
        """``seq`` was admitted: announce every full page of its prompt it has yet to compute."""
        if not self.enabled:
            return
        ps = self.page_size
        first = seq.num_computed // ps
        last = len(seq.token_ids) // ps  # full pages once the prompt is computed
        if last > first:
            self.page_key(seq, last - 1)  # grow the memo once, to the last page
        keys = deque((i, seq.page_keys[i]) for i in range(first, last))
        for _, k in keys:
            self.counts[k] = self.counts.get(k, 0) + 1
        seq.inflight_keys = keys

    def retire(self, seq: Sequence) -> None:
        """After a forward: pages ``seq`` has now computed (and published) are no longer news."""
        keys = seq.inflight_keys
        done = seq.num_computed // self.page_size
        while keys and keys[0][0] < done:
            self._unref(keys.popleft()[1])

    def drop(self, seq: Sequence) -> None:
        """``seq`` left the running set (finished, aborted, preempted): withdraw the rest."""
        for _, k in seq.inflight_keys:
            self._unref(k)
        seq.inflight_keys.clear()

    def _unref(self, key: int) -> None:
        c = self.counts[key] - 1
        if c:
            self.counts[key] = c
        else:
            del self.counts[key]

    def check(self, running: list[Sequence]) -> None:
        """The counts equal a recount over the running sequences' announcements."""
        counts: dict[int, int] = {}
        for s in running:
            for _, k in s.inflight_keys:
                counts[k] = counts.get(k, 0) + 1
        assert counts == self.counts, "in-flight page announcements out of sync"
