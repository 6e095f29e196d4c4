"""Hypothesis state machine: RadixCache against a naive model of cached prefixes.

The model holds, per namespace, every cached page-aligned prefix (a tuple of tokens) and the
page that holds its last page. Inserts add prefixes; evictions are chosen by the cache, so
the model learns which prefixes went from the cache's BlockRemoved/AllBlocksCleared events
(mapped back through page_hashes) and then checks that what went was sound: the model stays
prefix-closed (only leaves go), locked prefixes never go, and the number of pages evicted is
exactly what was asked for or all that was evictable. Matches must equal the model's longest
cached prefix, pages included. Runs with the real hash and with a constant hash function.
"""

from __future__ import annotations

from typing import Any

from cache_helpers import constant_hash, snapshot
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from radixkv.cache import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    LockError,
    OutOfPages,
    PagePool,
    RadixCache,
    page_hashes,
)
from radixkv.cache.hashing import chain_start

# Trunks over a tiny alphabet so sequences share prefixes and diverge at every offset.
TRUNKS = [
    [0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2],
    [0, 1, 2, 0, 2, 2, 1, 0, 1, 2, 2, 0],
    [1, 1, 0, 0, 2, 1, 0, 2, 1, 1, 0, 0],
]
token_seqs = st.builds(
    lambda t, cut, tail: TRUNKS[t][:cut] + tail,
    st.integers(0, len(TRUNKS) - 1),
    st.integers(0, 12),
    st.lists(st.integers(0, 2), max_size=6),
)
namespaces = st.sampled_from([None, "a", 3])
Prefix = tuple[int, ...]


class CacheMachine(RuleBasedStateMachine):
    hash_fn: Any = None

    @initialize(
        page_size=st.sampled_from([1, 2, 3]),
        num_pages=st.integers(3, 20),
        policy=st.sampled_from(["lru", "lfu"]),
    )
    def setup(self, page_size: int, num_pages: int, policy: str) -> None:
        self.ps = page_size
        self.total = num_pages
        self.cache = RadixCache(
            PagePool(num_pages), page_size=page_size, policy=policy, hash_fn=type(self).hash_fn
        )
        self.model: dict[Any, dict[Prefix, int]] = {}
        self.by_hash: dict[int, tuple[Any, Prefix]] = {}
        self.locks: list[tuple[Any, Prefix, Any]] = []
        self.held: list[int] = []
        self.stored: list[BlockStored] = []
        self.cache.add_listener(self.on_event)

    # ------------------------------------------------------------------ model helpers
    def on_event(self, ev: Any) -> None:
        if isinstance(ev, BlockStored):
            self.stored.append(ev)
        elif isinstance(ev, BlockRemoved):
            for h in ev.block_hashes:
                ns, prefix = self.by_hash[h]
                assert ns == ev.namespace
                page = self.model[ns].pop(prefix)  # KeyError: removed twice / never stored
                assert self.cache.pool.state(page) == "free"
        else:
            assert isinstance(ev, AllBlocksCleared)
            self.model.clear()

    def whole(self, tokens: list[int]) -> list[int]:
        return tokens[: len(tokens) // self.ps * self.ps]

    def longest(self, ns: Any, tokens: list[int]) -> list[int]:
        """Pages of the longest cached page-aligned prefix in the model."""
        cached = self.model.get(ns, {})
        pages = []
        for i in range(1, len(tokens) // self.ps + 1):
            page = cached.get(tuple(tokens[: i * self.ps]))
            if page is None:
                break
            pages.append(page)
        return pages

    def protected(self) -> set[tuple[Any, Prefix]]:
        """Prefixes that a lock keeps (the locked prefix and every page-aligned ancestor)."""
        out = set()
        for ns, prefix, _ in self.locks:
            for i in range(self.ps, len(prefix) + 1, self.ps):
                out.add((ns, prefix[:i]))
        return out

    def num_model_pages(self) -> int:
        return sum(len(d) for d in self.model.values())

    def check_match(self, ns: Any, tokens: list[int]) -> Any:
        m = self.cache.match_prefix(tokens, ns)
        expected = self.longest(ns, tokens)
        assert m.pages == expected, (m.pages, expected)
        assert m.num_tokens == len(expected) * self.ps
        assert m.node.depth_tokens == m.num_tokens
        assert (m.node is self.cache.root) == (m.num_tokens == 0)
        return m

    # ------------------------------------------------------------------ rules
    @rule(ns=namespaces, tokens=token_seqs, reuse=st.booleans())
    def insert(self, ns: Any, tokens: list[int], reuse: bool) -> None:
        tokens = self.whole(tokens)
        n = len(tokens) // self.ps
        m = self.check_match(ns, tokens)
        k = len(m.pages)
        self.cache.lock(m.node)
        need = n - k if reuse else n
        evictable = self.num_model_pages() - len(
            self.protected() | {(ns, tuple(tokens[: i * self.ps])) for i in range(1, k + 1)}
        )
        try:
            fresh = self.cache.alloc(need)
        except OutOfPages:
            assert self.cache.pool.num_free + evictable < need
            self.cache.unlock(m.node)
            return
        assert self.longest(ns, tokens) == m.pages  # the locked match survived eviction
        self.stored.clear()
        r = self.cache.insert(tokens, (m.pages if reuse else []) + fresh, ns)
        self.cache.unlock(m.node)
        assert r.num_cached_before == k * self.ps
        new_pages = fresh[-(n - k) :] if n > k else []
        assert r.pages == m.pages + new_pages
        assert r.node.depth_tokens == (len(tokens) if n else 0)
        if not reuse:
            assert all(self.cache.pool.state(p) == "free" for p in fresh[:k])
        hashes = page_hashes(tokens, self.ps, ns)
        cached = self.model.setdefault(ns, {})
        for i in range(k, n):
            prefix = tuple(tokens[: (i + 1) * self.ps])
            cached[prefix] = r.pages[i]
            self.by_hash[hashes[i]] = (ns, prefix)
        if not cached:
            del self.model[ns]
        if n > k:
            parent = hashes[k - 1] if k else chain_start(ns)
            assert self.stored == [
                BlockStored(hashes[k:], parent, tokens[k * self.ps :], self.ps, ns)
            ]
        else:
            assert self.stored == []

    @rule(ns=namespaces, tokens=token_seqs)
    def match(self, ns: Any, tokens: list[int]) -> None:
        before = snapshot(self.cache)
        assert self.cache.peek_prefix(tokens, ns) == len(self.longest(ns, tokens)) * self.ps
        assert snapshot(self.cache) == before  # peeking changes nothing
        self.check_match(ns, tokens)

    @rule(ns=namespaces, tokens=token_seqs)
    def lock(self, ns: Any, tokens: list[int]) -> None:
        m = self.check_match(ns, tokens)
        self.cache.lock(m.node)
        self.locks.append((ns, tuple(tokens[: m.num_tokens]), m.node))

    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        if not self.locks:
            return
        i = data.draw(st.integers(0, len(self.locks) - 1))
        _, _, node = self.locks.pop(i)
        self.cache.unlock(node)

    @rule(data=st.data())
    def unlock_unlocked_fails(self, data: st.DataObject) -> None:
        free_nodes = [n for n in self.cache.iter_nodes() if n.num_tokens and n.lock_ref == 0]
        if not free_nodes:
            return
        node = data.draw(st.sampled_from(free_nodes))
        before = snapshot(self.cache)
        try:
            self.cache.unlock(node)
        except LockError:
            pass
        else:
            raise AssertionError("unlock of an unlocked node succeeded")
        assert snapshot(self.cache) == before

    @rule(n=st.integers(0, 6))
    def alloc_private(self, n: int) -> None:
        evictable = self.num_model_pages() - len(self.protected())
        free = self.cache.pool.num_free
        try:
            pages = self.cache.alloc(n)
        except OutOfPages:
            assert free + evictable < n
            return
        assert free + evictable >= n
        assert len(pages) == n and not set(pages) & set(self.held)
        self.held += pages

    @rule(data=st.data())
    def free_private(self, data: st.DataObject) -> None:
        if not self.held:
            return
        chosen = data.draw(st.lists(st.sampled_from(self.held), unique=True, min_size=1))
        self.cache.pool.free(chosen)
        self.held = [p for p in self.held if p not in chosen]

    @rule(n=st.integers(0, 8))
    def evict(self, n: int) -> None:
        evictable = self.num_model_pages() - len(self.protected())
        before = self.num_model_pages()
        freed = self.cache.evict(n)
        assert freed == min(n, evictable)
        assert self.num_model_pages() == before - freed

    @rule()
    def reset(self) -> None:
        keep = self.protected()
        self.cache.reset()
        remaining = {(ns, p) for ns, d in self.model.items() for p in d}
        assert remaining == keep

    # ------------------------------------------------------------------ invariants
    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "cache"):
            return
        cache = self.cache
        cache.check_invariants()
        self.model = {ns: d for ns, d in self.model.items() if d}
        assert cache.num_cached_pages == self.num_model_pages()
        for d in self.model.values():
            for prefix in d:  # prefix-closed: eviction only ever removed leaves
                assert len(prefix) == self.ps or prefix[: -self.ps] in d
        protected = self.protected()
        for ns, prefix in protected:
            assert prefix in self.model.get(ns, {}), "a locked prefix was evicted"
        assert cache.num_locked_pages == len(protected)
        assert cache.pool.num_held == len(self.held)
        trie_pages = {p for n in cache.iter_nodes() for p in n.pages}
        assert trie_pages == {p for d in self.model.values() for p in d.values()}

    def teardown(self) -> None:
        if hasattr(self, "cache"):
            for _, _, node in self.locks:
                self.cache.unlock(node)
            self.cache.check_invariants()
            assert self.cache.num_locked_pages == 0


class ConstantHashCacheMachine(CacheMachine):
    hash_fn = staticmethod(constant_hash)


# Scaled from the loaded profile: under "ci" 60 x 30 runs of 50 steps, about half a minute per
# hash variant on 2 quiet cores (about a minute for both); far more under "fuzz".
_steps = settings(max_examples=settings.default.max_examples * 30, stateful_step_count=50)
CacheMachine.TestCase.settings = _steps
ConstantHashCacheMachine.TestCase.settings = _steps
TestCacheStateMachine = CacheMachine.TestCase
TestCacheStateMachineConstantHash = ConstantHashCacheMachine.TestCase
