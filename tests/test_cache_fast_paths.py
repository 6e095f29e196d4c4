"""The cache's fast paths give exactly what the general paths give: the walks inlined in a plain
cache's match_prefix and insert, the heap-backed eviction index, the pool's run and vectorised
page checks, and children keyed by their first page's bytes."""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np
import pytest
from cache_helpers import fill, make_cache, snapshot

from radixkv.cache import PagePool, RadixCache
from radixkv.cache.errors import InvariantError
from radixkv.cache.eviction import EvictionIndex, get_policy


# ---------------------------------------------------------------- the inlined walks
@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_plain_and_hashed_caches_agree_op_by_op(page_size: int) -> None:
    """match_prefix and insert of a plain cache run the walk inlined; a cache with a hash_fn runs
    _walk: every result, split and stat must be the same."""
    rng = np.random.default_rng(page_size)
    caches = [RadixCache(PagePool(5000), page_size=page_size, hash_fn=h) for h in (None, hash)]
    for _ in range(300):
        n = int(rng.integers(0, 7)) * page_size + int(rng.integers(0, page_size))
        seq = array("q", (rng.integers(0, 3, 2).tolist() + rng.integers(0, 4, n).tolist())[:n])
        got = []
        for c in caches:
            m = c.match_prefix(seq)
            c.lock(m.node)
            whole = len(seq) // page_size
            new = c.alloc(whole - len(m.pages))
            r = c.insert(seq[: whole * page_size], m.pages + new)
            c.unlock(m.node)
            got.append((m.pages, m.num_tokens, m.node.tokens, r.pages, r.num_cached_before,
                        r.node.tokens, c.peek_prefix(seq)))  # fmt: skip
        assert got[0] == got[1]
    a, b = (sorted((n.tokens, n.pages) for n in c.iter_nodes()) for c in caches)
    assert a == b
    assert caches[0].stats == caches[1].stats
    for c in caches:
        c.check_invariants()


# ---------------------------------------------------------------- eviction index
def test_heap_index_keeps_policy_order_through_stale_keys() -> None:
    """Refreshing and discarding leave stale keys in the heap; the order stays exact and the
    heap is compacted when the stale keys outnumber the live ones."""
    cache = make_cache(num_pages=400, page_size=1)
    for i in range(100):
        fill(cache, [1000 + i, i])
    for _ in range(3):  # re-key every leaf three times (stale keys pile up, then compact)
        for i in range(99, -1, -1):
            cache.match_prefix([1000 + i, i])
    index = cache._index
    assert len(index._heap) <= 2 * len(index) + 64
    cache.check_invariants()
    order = cache.eviction_order()
    assert [n.tokens for n in order] == [[1000 + i, i] for i in range(100)][::-1]
    assert cache.evict(10) == 10  # five two-page leaves, least recently used first
    assert [n.tokens for n in cache.eviction_order()] == [[1000 + i, i] for i in range(95)][::-1]
    cache.check_invariants()


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_a_match_leaves_the_key_behind_and_eviction_catches_up(policy: str) -> None:
    """match_prefix does not re-key the leaf it ends at (LRU, LFU: keys only grow); the
    stored key is a lower bound until the leaf reaches the top of the heap, where ``first``
    re-keys it: the eviction order stays exact."""
    cache = make_cache(num_pages=64, page_size=1, policy=policy)
    a, b, c = (fill(cache, [t, t + 1]).node for t in (10, 20, 30))
    index = cache._index
    stored = dict(index.keys)
    cache.match_prefix([10, 11])  # a is now the most recently used (and most hit)
    assert index.keys == stored and len(index._heap) == 3  # nothing re-keyed yet
    assert index.lagging == {a}
    cache.check_invariants()
    assert cache.eviction_order() == [b, c, a]
    assert cache.evict(2) == 2 and cache.eviction_order() == [c, a]  # b went, not a
    assert index.keys[a] == policy_key(cache, a) and not index.lagging  # re-keyed at the top
    cache.check_invariants()
    cache.match_prefix([30, 31])
    m = cache.match_prefix([30, 31])
    assert index.lagging == {c}
    cache.lock(m.node)  # out of the index, and no longer lagging
    assert not index.lagging and c not in index.keys
    cache.unlock(m.node)
    assert index.keys[c] == policy_key(cache, c) and cache.eviction_order() == [a, c]
    cache.check_invariants()
    k = index.keys[c]
    big = k + (5 << 40)  # a stored key above the current one: corrupt
    del index._nodes[k]
    index._nodes[big] = c
    index.keys[c] = big
    index._heap.remove(k)
    index._heap.append(big)
    with pytest.raises(InvariantError, match="stored under key"):
        cache.check_invariants()


def test_other_policies_keep_their_keys_current() -> None:
    class MostRecentFirst:
        name = "mru"

        @staticmethod
        def key(node: Any) -> int:
            return ((1 << 40) - node.last_access << 40) | node.node_id

    cache = RadixCache(PagePool(64), page_size=1, policy=MostRecentFirst())
    a, b = (fill(cache, [t, t + 1]).node for t in (10, 20))
    assert not cache._index.lazy
    cache.match_prefix([10, 11])
    assert cache._index.keys[a] == MostRecentFirst.key(a)  # refreshed by the match itself
    cache.check_invariants()
    assert cache.eviction_order() == [a, b]


def policy_key(cache: RadixCache, node: Any) -> int:
    return cache.policy.key(node)


def test_heap_index_check_finds_corruption() -> None:
    cache = make_cache(page_size=1)
    fill(cache, [1, 2])
    fill(cache, [3, 4])
    cache.check_invariants()
    index = cache._index
    leaf = next(iter(index._nodes.values()))
    index._heap.remove(index.keys[leaf])
    with pytest.raises(InvariantError, match="not in the heap"):
        cache.check_invariants()


def test_heap_index_first_skips_stale_keys() -> None:
    cache = make_cache(page_size=1)
    a, b = fill(cache, [1]), fill(cache, [2])
    index = EvictionIndex(get_policy("lru"))
    index.add(a.node)
    index.add(b.node)
    index.discard(a.node)
    assert index.first() is b.node and len(index) == 1
    index.add(a.node)  # back with the same key: two copies of it in the heap
    assert index.first() is a.node
    index.discard(a.node)
    assert index.first() is b.node
    assert list(index) == [b.node] and index.check() is None
    index.clear()
    assert len(index) == 0 and b.node not in index.keys


# ---------------------------------------------------------------- the pool's fast checks
def test_runs_and_scattered_pages_are_checked_like_the_loop() -> None:
    pool = PagePool(64)
    run = pool.alloc(8)
    assert run == list(range(8))
    pool.free(run)
    assert pool.alloc(8) == list(range(8))  # freed pages come back as an ascending run
    scattered = [7, 3, 5]
    assert pool.check_held(scattered) == scattered
    assert pool.check_held(np.array(scattered, np.int64).tolist()) == scattered
    as_numpy = pool.check_held(list(np.array([3, 5, 7], np.int64)))
    assert as_numpy == [3, 5, 7] and all(type(p) is int for p in as_numpy)
    with pytest.raises(ValueError, match="listed more than once"):
        pool.check_held([3, 5, 3])
    with pytest.raises(TypeError, match="ints"):
        pool.check_held([True, 2])
    with pytest.raises(ValueError, match="out of range"):
        pool.check_held([3, 64])
    with pytest.raises(ValueError, match="out of range"):
        pool.check_held([3, -1])
    with pytest.raises(ValueError, match="not held"):
        pool.check_held([3, 9])  # 9 is free
    pool.check_invariants()


def test_adopt_run_only_takes_a_run_of_held_pages() -> None:
    pool = PagePool(32)
    pages = pool.alloc(10)
    before = (bytes(pool._state), list(pool._free))
    for not_a_run in ([3, 2, 4], [2, 9], [2], [0, True], [True, 2], [2, 3, 40], [2, 3.0]):
        assert pool.adopt_run(not_a_run) is None
        assert (bytes(pool._state), list(pool._free)) == before
    assert pool.adopt_run([8, 9, 10]) is None  # 10 is free
    run = pool.adopt_run(pages[2:6])
    assert run == [2, 3, 4, 5] and [pool.state(p) for p in range(2, 6)] == ["cached"] * 4
    assert pool.num_cached == 4 and pool.adopt_run([2, 3]) is None  # cached now
    pool.release_cached(run)
    pool.check_invariants()


def test_adopt_run_after_a_prefix_extends_it_only_on_success() -> None:
    """With ``prefix``, the pages must be exactly the prefix then a HELD run; the run is
    appended to the prefix in place, and a refusal leaves prefix and pool as they were."""
    pool = PagePool(32)
    owned = pool.alloc(3)  # stands for a matched prefix's pages
    pages = pool.alloc(6)
    before = (bytes(pool._state), list(pool._free))
    for bad in (
        [owned[0], 9, *pages[:3]],  # not the prefix
        [*owned, pages[0]],  # a run of one
        [*owned, pages[0], pages[2]],  # not a run
        [*owned, *pages, 20],  # 20 is free
        [*owned[:2], *pages],  # prefix cut short
        [*owned, True, 2],  # a bool is not a page id
    ):
        prefix = list(owned)
        assert pool.adopt_run(bad, prefix) is None and prefix == owned
        assert (bytes(pool._state), list(pool._free)) == before
    prefix = list(owned)
    run = pool.adopt_run([*owned, *pages[1:4]], prefix)
    assert run == pages[1:4] and prefix == owned + pages[1:4]
    assert [pool.state(p) for p in pages] == ["held", "cached", "cached", "cached", "held", "held"]
    assert pool.adopt_run([*owned, *pages[1:3]], list(owned)) is None  # cached now
    pool.check_invariants()


def test_adopt_held_moves_distinct_held_ints_or_nothing() -> None:
    """One pass that checks and moves: any failure (a page listed twice, free, cached, out of
    range, negative, a bool, a float, a numpy integer) undoes the moves made before it."""
    pool = PagePool(32)
    pages = pool.alloc(12)
    pool.adopt(pool.check_held([10, 11]))  # two cached pages
    before = (bytes(pool._state), list(pool._free), pool.num_cached)
    for bad in (
        [7, 3, 5, 3],  # listed twice
        [7, 3, 20],  # 20 is free
        [7, 3, 10],  # 10 is cached
        [7, 3, 32],  # out of range
        [7, 3, -1],  # negative: would index from the end
        [7, True, 3],  # a bool is not a page id
        [7, 3.0, 5],  # nor a float
        [7, np.int64(3)],  # a numpy integer takes check_held, which canonicalises it
        [7, None],  # ids that do not compare
        [7],  # one page: check_held's
    ):
        assert pool.adopt_held(bad) is False
        assert (bytes(pool._state), list(pool._free), pool.num_cached) == before, bad
    assert pool.adopt_held([9, 2, 6, 0]) is True
    assert [pool.state(p) for p in (9, 2, 6, 0)] == ["cached"] * 4 and pool.num_cached == 6
    assert pool.num_held == len(pages) - 6
    pool.check_invariants()


def test_insert_adopts_fragmented_pages_in_one_pass_and_refuses_bad_ones() -> None:
    """Pages allocated one decode step at a time across a batch (page size 1): the cached
    prefix, then pages that are no run; the insert takes them all, and a bad page anywhere
    leaves cache and pool as they were."""
    cache = make_cache(num_pages=128, page_size=1)
    m = cache.match_prefix(list(range(8)))
    prompt = cache.alloc(4)
    decode = [cache.alloc(1)[0] for _ in range(12)]
    mine, other = decode[::2], decode[1::2]  # interleaved with another sequence's pages
    r = cache.insert(list(range(10)), [*m.pages, *prompt, *mine])
    assert r.pages == [*prompt, *mine] and r.num_cached_before == 0
    cache.check_invariants()
    m = cache.match_prefix(list(range(12)))
    assert m.num_tokens == 10
    more = [cache.alloc(1)[0] for _ in range(4)]
    for bad in ([*more[:2], other[0], other[0]], [*more[:3], r.pages[0]], [*more[:3], 127]):
        before = snapshot(cache)
        with pytest.raises(ValueError):
            cache.insert(list(range(10 + len(bad))), [*m.pages, *bad])
        assert snapshot(cache) == before
    r2 = cache.insert(list(range(14)), [*m.pages, more[0], more[3], more[1], more[2]])
    assert r2.pages == [*m.pages, more[0], more[3], more[1], more[2]]
    cache.pool.free(other)
    cache.check_invariants()
    assert cache.pool.num_held == 0


@pytest.mark.parametrize("shuffled", [False, True])
def test_insert_takes_runs_and_scattered_pages_alike(shuffled: bool) -> None:
    cache = make_cache(num_pages=64, page_size=2)
    pages = cache.alloc(6)
    if shuffled:
        pages = pages[::-1]
    r = cache.insert(array("q", range(12)), pages)
    assert r.pages == pages and cache.pool.num_cached == 6
    cache.check_invariants()
    held = cache.alloc(3)
    before = snapshot(cache)
    with pytest.raises(ValueError, match="not held"):
        cache.insert(array("q", range(100, 106)), [held[0], held[1], 63])
    assert snapshot(cache) == before


# ---------------------------------------------------------------- children keyed by page bytes
def test_children_are_keyed_by_their_first_page() -> None:
    cache = make_cache(page_size=2)
    fill(cache, [1, 2, 3, 4])
    fill(cache, [1, 2, 5, 6])
    top = next(cache.root.iter_children())
    keys = sorted(top._children)
    assert keys == [array("q", [3, 4]).tobytes(), array("q", [5, 6]).tobytes()]
    child = top._children[keys[0]]
    child._hkey = keys[1]
    with pytest.raises(InvariantError, match="lookup key"):
        cache.check_invariants()
