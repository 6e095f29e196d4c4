"""RadixCache unit tests: every edge, each run with the real hash and a constant hash."""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np
import pytest
from cache_helpers import HASH_FNS, fill, make_cache, snapshot

import radixkv
from radixkv.cache import (
    ForeignNodeError,
    LockError,
    OutOfPages,
    PagePool,
    RadixCache,
    TieredRadixCache,
)


@pytest.fixture(params=list(HASH_FNS), ids=list(HASH_FNS))
def hash_fn(request: pytest.FixtureRequest) -> Any:
    return HASH_FNS[request.param]


def seq(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


# ----------------------------------------------------------------------------- basics
def test_exports() -> None:
    assert radixkv.RadixCache is RadixCache
    assert radixkv.MatchResult.__name__ == "MatchResult"
    assert radixkv.InsertResult.__name__ == "InsertResult"
    assert radixkv.CacheStats.__name__ == "CacheStats"


@pytest.mark.parametrize("tokens", [[], (), array("q"), np.zeros(0, np.int64), [1, 2, 3]])
def test_empty_cache_and_short_queries_match_root(hash_fn: Any, tokens: Any) -> None:
    cache = make_cache(page_size=4, hash_fn=hash_fn)
    m = cache.match_prefix(tokens)
    assert m.node is cache.root and m.pages == [] and m.num_tokens == 0
    fill(cache, seq(8))
    m = cache.match_prefix(tokens)  # shorter than one page: nothing to match
    assert m.node is cache.root and m.pages == [] and m.num_tokens == 0
    cache.check_invariants()


@pytest.mark.parametrize("page_size", [1, 16])
def test_exact_page_boundaries(hash_fn: Any, page_size: int) -> None:
    cache = make_cache(num_pages=32, page_size=page_size, hash_fn=hash_fn)
    toks = seq(3 * page_size, 100)
    pages = cache.alloc(3)
    r = cache.insert(toks, pages)
    assert r.pages == pages and r.num_cached_before == 0 and r.node.depth_tokens == len(toks)
    for n in range(len(toks) + page_size + 1):
        q = toks[:n] + [7] * (n > len(toks))
        m = cache.match_prefix(q)
        whole = min(n, len(toks)) // page_size
        assert m.num_tokens == whole * page_size
        assert m.pages == pages[:whole]
        assert m.node.depth_tokens == m.num_tokens
        cache.check_invariants()
    # a trailing partial page is never cached
    assert cache.num_cached_pages == 3


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_split_at_every_offset(hash_fn: Any, page_size: int, k: int) -> None:
    cache = make_cache(page_size=page_size, hash_fn=hash_fn)
    toks = seq(6 * page_size, 10)
    r = fill(cache, toks)
    assert cache.num_nodes == 2
    other = toks[: k * page_size] + [999] * page_size
    m = cache.match_prefix(other)  # ends inside the node: splits it
    assert m.num_tokens == k * page_size and m.pages == r.pages[:k]
    assert cache.num_nodes == 3 and cache.stats.splits == 1
    assert m.node.num_tokens == k * page_size and m.node.pages == r.pages[:k]
    assert [c.depth_tokens for c in m.node.children] == [len(toks)]
    cache.check_invariants()
    r2 = fill(cache, other)
    assert r2.num_cached_before == k * page_size and r2.pages[:k] == r.pages[:k]
    assert cache.num_nodes == 4 and len(m.node.children) == 2
    # the original leaf node object survived the split and still ends at the full sequence
    assert r.node.depth_tokens == len(toks) and r.node.parent is m.node
    assert cache.match_prefix(toks).pages == r.pages
    cache.check_invariants()


def test_peek_prefix_changes_nothing(hash_fn: Any) -> None:
    cache = make_cache(page_size=2, hash_fn=hash_fn)
    fill(cache, [1, 2, 3, 4, 5, 6])
    before = snapshot(cache)
    assert cache.peek_prefix([1, 2, 3, 4, 9]) == 4  # would split, but does not
    assert cache.peek_prefix([1, 2, 3, 4, 5, 6, 7]) == 6
    assert cache.peek_prefix([1]) == 0 and cache.peek_prefix([1, 2], namespace="x") == 0
    full = cache.match_prefix([1, 2, 3, 4, 5, 6]).pages
    before = snapshot(cache)
    assert cache.peek_pages([1, 2, 3, 4, 9]) == full[:2]  # the pages, without the split
    peeked = cache.peek_pages([1, 2, 3, 4, 5, 6, 7])
    assert peeked == full and peeked is not cache.peek_pages([1, 2, 3, 4, 5, 6])
    peeked.clear()  # the caller's own list
    assert cache.peek_pages([1, 2, 3, 4, 5, 6]) == full
    assert cache.peek_pages([1]) == [] == cache.peek_pages([1, 2], namespace="x")
    assert snapshot(cache) == before and cache.num_nodes == 2
    assert cache.peek_prefix([1, 2, 3, 4, -5, 6]) == 4  # -5 is a key like any other: not cached
    with pytest.raises(TypeError):
        cache.peek_prefix([1, 2, 3, 4, 5.0])
    with pytest.raises(TypeError):
        cache.peek_pages([1, 2, 3, 4, 5.0])
    assert cache.match_prefix([1, 2, 3, 4, 9]).num_tokens == 4


def test_split_during_insert(hash_fn: Any) -> None:
    cache = make_cache(page_size=2, hash_fn=hash_fn)
    a = fill(cache, [1, 2, 3, 4, 5, 6])
    b_pages = cache.alloc(3)
    b = cache.insert([1, 2, 3, 4, 9, 9], b_pages)  # shares 2 pages, diverges in the 3rd
    assert b.num_cached_before == 4
    assert b.pages == a.pages[:2] + b_pages[2:]
    assert cache.pool.num_free == 64 - 4  # two duplicates freed
    assert cache.stats.duplicate_pages == 2 and cache.stats.splits == 1
    cache.check_invariants()


def test_match_pages_are_built_on_read_and_survive_splits_below(hash_fn: Any) -> None:
    """MatchResult.pages is built from the node's path when first read: a split of that path
    or an insert below it in between changes nothing; the list is kept, one per result."""
    cache = make_cache(page_size=2, hash_fn=hash_fn)
    a = fill(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9])
    cache.lock(m.node)
    b = cache.insert([1, 2, 9, 9], [a.pages[0], *cache.alloc(1)])  # splits m's path at page 1
    c = cache.insert([1, 2, 3, 4, 5, 6, 7, 8, 5, 5], [*a.pages, *cache.alloc(1)])  # below m
    assert cache.stats.splits == 1 and c.node.parent is m.node
    assert b.node.parent is m.node.parent and m.node.parent.num_tokens == 2
    assert m.pages == a.pages and m.pages is m.pages and m.num_tokens == 8
    assert tuple(m) == (m.node, a.pages, 8, m.node, (), 0) == m
    assert len(m) == 6 and m[2] == 8 and m[-1] == 0 and m._replace(num_tokens=4)[:3] == (
        m.node, a.pages, 4,
    )  # fmt: skip
    cache.unlock(m.node)
    miss = cache.match_prefix([7, 7])
    assert miss.pages == [] and miss.node is cache.root
    cache.check_invariants()


def test_insert_keeps_matched_pages_and_frees_duplicates(hash_fn: Any) -> None:
    cache = make_cache(num_pages=16, page_size=2, hash_fn=hash_fn)
    first = fill(cache, [1, 2, 3, 4])
    m = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert m.pages == first.pages
    new = cache.alloc(1)
    r = cache.insert([1, 2, 3, 4, 5, 6], m.pages + new)
    assert r.pages == first.pages + new and r.num_cached_before == 4
    assert cache.stats.duplicate_pages == 0
    # same tokens again with private pages: all are duplicates and are freed
    dup = cache.alloc(3)
    free_before = cache.pool.num_free
    r2 = cache.insert([1, 2, 3, 4, 5, 6], dup)
    assert r2.pages == r.pages and r2.num_cached_before == 6 and r2.node is r.node
    assert cache.pool.num_free == free_before + 3
    assert all(cache.pool.state(p) == "free" for p in dup)
    cache.check_invariants()


def test_insert_empty_and_mismatched(hash_fn: Any) -> None:
    cache = make_cache(page_size=4, hash_fn=hash_fn)
    r = cache.insert([], [])
    assert r.node is cache.root and r.pages == [] and r.num_cached_before == 0
    pages = cache.alloc(2)
    before = snapshot(cache)
    for toks, pgs in [(seq(8), pages[:1]), (seq(7), pages), (seq(9), pages), ([], pages)]:
        with pytest.raises(ValueError, match="len\\(pages\\)"):
            cache.insert(toks, pgs)
        assert snapshot(cache) == before
    cache.check_invariants()


def test_insert_bad_pages_leave_cache_unchanged(hash_fn: Any) -> None:
    cache = make_cache(num_pages=16, page_size=2, hash_fn=hash_fn)
    a = fill(cache, [1, 2, 3, 4])
    held = cache.alloc(3)
    free_page = cache.pool._free[-1]
    cases = [
        ([free_page, held[0]], "not held"),  # a free (never allocated) page
        ([99, held[0]], "out of range"),
        ([held[0], held[0]], "more than once"),
        ([a.pages[1], held[0]], "owned by the cache"),  # cached page for other tokens
        ([held[0], 1.5], "ints"),
    ]
    before = snapshot(cache)
    for pages, msg in cases:
        with pytest.raises((ValueError, TypeError), match=msg):
            cache.insert([7, 7, 8, 8], pages)
        assert snapshot(cache) == before
    # a cached prefix passed with the right page for page 0 and a bad duplicate for page 1
    with pytest.raises(ValueError, match="owned by the cache"):
        cache.insert([1, 2, 3, 4], [a.pages[0], a.pages[0]])
    assert snapshot(cache) == before
    # foreign page from another pool's numbering is just out of range / not held here
    other = make_cache(num_pages=200, hash_fn=hash_fn)
    foreign = other.alloc(100)[-1]
    with pytest.raises(ValueError):
        cache.insert([7, 7], [foreign])
    assert snapshot(cache) == before
    cache.check_invariants()


# ----------------------------------------------------------------------------- locking
def test_lock_protects_node_and_ancestors(hash_fn: Any) -> None:
    cache = make_cache(num_pages=32, page_size=2, hash_fn=hash_fn)
    trunk = [1, 1, 2, 2]
    fill(cache, [*trunk, 3, 3, 4, 4])
    deep = fill(cache, [*trunk, 5, 5, 6, 6, 7, 7])
    fill(cache, [9, 9, 9, 9])
    m = cache.match_prefix([*trunk, 5, 5, 6, 6, 7, 7])
    assert m.node is deep.node
    cache.lock(m.node)
    assert cache.num_locked_pages == 5 and deep.node.lock_ref == 1
    assert deep.node.parent.lock_ref == 1
    freed = cache.evict(100)
    assert freed == 4  # only the unlocked [3,3,4,4] and [9,9,9,9] leaves
    assert cache.match_prefix([*trunk, 5, 5, 6, 6, 7, 7]).num_tokens == 10
    assert cache.num_evictable_pages == 0
    cache.check_invariants()
    cache.unlock(m.node)
    assert cache.num_locked_pages == 0
    assert cache.evict(100) == 5
    cache.check_invariants()


def test_lock_counts_nest_and_unlock_below_zero(hash_fn: Any) -> None:
    cache = make_cache(page_size=2, hash_fn=hash_fn)
    r = fill(cache, [1, 2, 3, 4])
    cache.lock(r.node)
    cache.lock(r.node)
    cache.unlock(r.node)
    assert r.node.lock_ref == 1 and cache.num_locked_pages == 2
    cache.unlock(r.node)
    before = snapshot(cache)
    with pytest.raises(LockError, match="not locked"):
        cache.unlock(r.node)
    assert snapshot(cache) == before and r.node.lock_ref == 0
    # the root may be locked and unlocked freely: no-ops
    cache.lock(cache.root)
    cache.unlock(cache.root)
    cache.unlock(cache.root)
    assert cache.root.lock_ref == 0
    cache.check_invariants()


def test_foreign_and_evicted_nodes(hash_fn: Any) -> None:
    a = make_cache(page_size=2, hash_fn=hash_fn)
    b = make_cache(page_size=2, hash_fn=hash_fn)
    ra = fill(a, [1, 2])
    before = snapshot(b)
    for op in (b.lock, b.unlock, b.path_pages):
        with pytest.raises(ForeignNodeError, match="another"):
            op(ra.node)
    with pytest.raises(ForeignNodeError):
        b.lock(a.root)
    assert snapshot(b) == before
    a.evict(1)
    with pytest.raises(ForeignNodeError, match="no longer"):
        a.lock(ra.node)
    with pytest.raises(TypeError):
        a.lock("node")  # type: ignore[arg-type]
    a.check_invariants()


# ----------------------------------------------------------------------------- eviction
def test_evict_zero_negative_and_more_than_exists(hash_fn: Any) -> None:
    cache = make_cache(page_size=2, hash_fn=hash_fn)
    assert cache.evict(0) == 0
    assert cache.evict(10) == 0  # empty cache
    fill(cache, [1, 2, 3, 4])
    fill(cache, [5, 6])
    assert cache.evict(0) == 0 and cache.num_cached_pages == 3
    with pytest.raises(ValueError):
        cache.evict(-1)
    with pytest.raises(ValueError):
        cache.evict(1.0)  # type: ignore[arg-type]
    assert cache.evict(1000) == 3
    assert cache.num_cached_pages == 0 and cache.pool.num_free == 64 and cache.num_nodes == 1
    cache.check_invariants()


def test_evict_never_frees_more_than_asked(hash_fn: Any) -> None:
    cache = make_cache(page_size=2, hash_fn=hash_fn)
    r = fill(cache, seq(10))  # one leaf of 5 pages
    assert cache.evict(2) == 2
    assert cache.num_cached_pages == 3
    assert r.node.num_tokens == 6 and r.node.pages == r.pages[:3]
    assert cache.match_prefix(seq(10)).pages == r.pages[:3]
    cache.check_invariants()


def test_lru_order(hash_fn: Any) -> None:
    cache = make_cache(page_size=2, policy="lru", hash_fn=hash_fn)
    a = fill(cache, [1, 1])
    b = fill(cache, [2, 2])
    c = fill(cache, [3, 3])
    assert cache.eviction_order() == [a.node, b.node, c.node]
    cache.match_prefix([1, 1])  # touch a
    assert cache.eviction_order() == [b.node, c.node, a.node]
    assert cache.evict(1) == 1
    assert cache.match_prefix([2, 2]).num_tokens == 0
    assert cache.match_prefix([3, 3]).num_tokens == 2
    assert cache.eviction_order() == [a.node, c.node]
    cache.check_invariants()


def test_lfu_order(hash_fn: Any) -> None:
    cache = make_cache(page_size=2, policy="lfu", hash_fn=hash_fn)
    a = fill(cache, [1, 1])
    b = fill(cache, [2, 2])
    c = fill(cache, [3, 3])
    for _ in range(3):
        cache.match_prefix([1, 1])
    cache.match_prefix([2, 2])
    cache.match_prefix([3, 3])
    cache.match_prefix([3, 3])
    # hits (after the fill matches): a 3, b 1, c 2
    assert cache.eviction_order() == [b.node, c.node, a.node]
    assert cache.evict(2) == 2
    assert cache.match_prefix([1, 1]).num_tokens == 2
    assert cache.match_prefix([2, 2]).num_tokens == 0
    cache.check_invariants()


def test_parent_becomes_candidate_after_last_child(hash_fn: Any) -> None:
    cache = make_cache(page_size=1, hash_fn=hash_fn)
    fill(cache, [1, 2, 3])
    fill(cache, [1, 2, 4])
    parent = cache.match_prefix([1, 2]).node
    assert parent not in cache.eviction_order()
    assert cache.evict(2) == 2  # both leaves
    assert cache.eviction_order() == [parent]
    assert cache.evict(5) == 2
    assert cache.num_nodes == 1
    cache.check_invariants()


def test_alloc_evicts_when_short_and_fails_cleanly(hash_fn: Any) -> None:
    cache = make_cache(num_pages=8, page_size=2, hash_fn=hash_fn)
    keep = fill(cache, seq(8))  # 4 pages
    fill(cache, seq(4, 50))  # 2 pages
    assert cache.pool.num_free == 2
    cache.match_prefix(seq(8))  # keep is now the most recently used
    pages = cache.alloc(3)  # evicts 1 page of the LRU leaf
    assert len(pages) == 3 and cache.stats.evicted_pages == 1
    cache.check_invariants()
    cache.lock(keep.node)
    before = snapshot(cache)
    with pytest.raises(OutOfPages, match="free or evictable"):
        cache.alloc(3)  # 0 free + 1 evictable
    assert snapshot(cache) == before
    assert len(cache.alloc(1)) == 1  # the last evictable page goes
    assert cache.num_evictable_pages == 0 and cache.num_locked_pages == 4
    cache.check_invariants()


def test_reset_keeps_locked_paths(hash_fn: Any) -> None:
    cache = make_cache(page_size=2, hash_fn=hash_fn)
    locked = fill(cache, [1, 1, 2, 2])
    fill(cache, [1, 1, 3, 3])
    fill(cache, [4, 4], namespace="t")
    held = cache.alloc(2)
    cache.lock(locked.node)
    cache.reset()
    assert cache.num_cached_pages == 2 and cache.num_locked_pages == 2
    assert cache.match_prefix([1, 1, 2, 2]).num_tokens == 4
    assert cache.match_prefix([4, 4], namespace="t").num_tokens == 0
    assert all(cache.pool.state(p) == "held" for p in held)
    cache.check_invariants()
    cache.unlock(locked.node)
    cache.reset()
    assert cache.num_cached_pages == 0 and cache.num_nodes == 1
    assert cache.pool.num_free == 62 and cache.stats.resets == 2
    cache.reset()  # empty: fine
    cache.check_invariants()


# ----------------------------------------------------------------------------- namespaces
def test_namespaces_partition_the_trie(hash_fn: Any) -> None:
    cache = make_cache(page_size=2, hash_fn=hash_fn)
    toks = [1, 2, 3, 4]
    ra = fill(cache, toks, namespace="a")
    assert cache.match_prefix(toks).num_tokens == 0
    assert cache.match_prefix(toks, namespace="b").num_tokens == 0
    assert cache.match_prefix(toks, namespace="a").pages == ra.pages
    rn = fill(cache, toks)  # same tokens without a namespace: separate pages
    r7 = fill(cache, toks, namespace=7)
    assert len({*ra.pages, *rn.pages, *r7.pages}) == 6
    assert ra.node.namespace == "a" and r7.node.namespace == 7 and rn.node.namespace is None
    cache.check_invariants()
    # once a namespace's last entry is evicted its root disappears too
    assert cache.evict(4) == 4  # LRU: the "a" entry, then the None entry
    assert list(cache._ns_roots) == [7]
    assert cache.num_nodes == 3  # root, namespace 7's root, its entry
    cache.check_invariants()
    with pytest.raises(TypeError):
        cache.insert([1, 1], cache.alloc(1), namespace=["unhashable"])
    cache.check_invariants()


# ----------------------------------------------------------------------------- accessors
def test_node_accessors_stats_and_rendering(hash_fn: Any) -> None:
    cache = make_cache(page_size=2, hash_fn=hash_fn)
    r = fill(cache, [5, 6, 7, 8])
    fill(cache, [5, 6, 9, 9])
    m = cache.match_prefix([5, 6, 7, 8, 1])
    assert m.node is r.node and m.node.tokens == [7, 8] and m.node.num_tokens == 2
    assert cache.path_pages(m.node) == m.pages == r.pages
    assert m.node.parent.tokens == [5, 6] and m.node.parent.depth_tokens == 2
    assert {tuple(c.tokens) for c in m.node.parent.children} == {(7, 8), (9, 9)}
    nodes = list(cache.iter_nodes())
    assert nodes[0] is cache.root and len(nodes) == cache.num_nodes == 4
    assert cache.path_pages(cache.root) == []
    s = cache.stats
    assert s.match_queries == 3 and s.query_tokens == 4 + 4 + 5
    assert s.hit_tokens == 2 + 4 and s.hit_rate == pytest.approx(6 / 13)
    assert s.cached_pages == 3 and s.num_nodes == 4 and s.inserted_pages == 3
    text = cache.pretty()
    assert "[5 6]" in text and "[7 8]" in text and "lock=0" in text
    dot = cache.to_dot()
    assert dot.startswith("digraph") and dot.count("->") == 3
    assert "RadixCache(" in repr(cache)


def test_constructor_validation() -> None:
    pool = PagePool(4)
    with pytest.raises(ValueError, match="policy"):
        RadixCache(pool, policy="random")
    with pytest.raises(ValueError, match="page_size"):
        RadixCache(pool, page_size=0)
    with pytest.raises(TypeError):
        RadixCache(object())  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        RadixCache(pool, hash_fn=3)  # type: ignore[arg-type]
    assert RadixCache(pool).page_size == 16 and RadixCache(pool).pool is pool


def test_collision_buckets_are_exact() -> None:
    cache = make_cache(num_pages=64, page_size=2, hash_fn=lambda b: 0)
    results = {first: fill(cache, [first, first, 1, 1]) for first in range(6)}
    assert len(cache.root._children) == 1  # one bucket holding all six children
    for first, r in results.items():
        m = cache.match_prefix([first, first, 1, 1])
        assert m.pages == r.pages
    assert cache.match_prefix([9, 9, 1, 1]).num_tokens == 0
    assert cache.evict(12) == 12
    assert cache.root._children == {}
    cache.check_invariants()


def test_user_hash_fn_gets_bytes() -> None:
    seen: list[type] = []

    def fn(page: bytes) -> int:
        seen.append(type(page))
        return hash(page) & 3  # few buckets: collisions too

    cache = make_cache(page_size=2, hash_fn=fn)
    for first in range(6):
        fill(cache, array("q", [first, first, 1, 1]))
        fill(cache, [first, first, 2, 2])
    assert cache.match_prefix(np.array([3, 3, 2, 2])).num_tokens == 4
    assert set(seen) == {bytes}
    cache.check_invariants()


# ----------------------------------------------------------------------------- edge compression
def _publish_page_by_page(cache: RadixCache, tokens: list[int]) -> Any:
    """What a decoding request does: publish each new page, lock the new leaf, unlock the
    previous one. Returns the last node (still locked)."""
    ps = cache.page_size
    pages: list[int] = []
    held = None
    for k in range(1, len(tokens) // ps + 1):
        r = cache.insert(tokens[: k * ps], pages + cache.alloc(1))
        pages = r.pages
        cache.lock(r.node)
        if held is not None:
            cache.unlock(held)
        held = r.node
        cache.check_invariants()
    return held


def test_a_run_published_page_by_page_merges_into_one_node(hash_fn: Any) -> None:
    cache = make_cache(page_size=4, hash_fn=hash_fn)
    fill(cache, seq(8, 500))  # a sibling branch: the run hangs under the root beside it
    events: list[Any] = []
    cache.add_listener(events.append)
    tokens = seq(40)
    last = _publish_page_by_page(cache, tokens)
    assert cache.num_nodes == 1 + 1 + 10  # while it runs, one node per page
    pages = cache.path_pages(last)
    cache.unlock(last)
    assert cache.num_nodes == 12  # merged by the next alloc or insert, not by unlock
    stored = len(events)
    fill(cache, seq(4, 900))
    cache.check_invariants()
    assert cache.num_nodes == 1 + 1 + 1 + 1 and cache.stats.merged_nodes == 9
    assert len(events) == stored + 1  # the new page's BlockStored: merging emits nothing
    m = cache.match_prefix([*tokens, 7])
    assert m.node is last and last.depth_tokens == 40 and m.pages == pages  # the lowest survives
    assert last.parent is cache.root and last.num_tokens == 40
    assert cache.match_prefix(tokens[:20]).num_tokens == 20  # a prefix of it splits it again
    cache.check_invariants()


def test_lock_targets_and_branching_nodes_are_not_merged_away(hash_fn: Any) -> None:
    cache = make_cache(page_size=2, hash_fn=hash_fn)
    tokens = seq(16)
    last = _publish_page_by_page(cache, tokens)
    reader = cache.match_prefix(tokens[:6]).node  # another request holds the first 3 pages
    cache.lock(reader)
    cache.unlock(last)
    fill(cache, seq(2, 300))
    # the reader's node, a lock target, survives: the two nodes above it (locked only through
    # it) merge into it, the five unlocked pages below it merge into one node
    path = []
    n = last
    while n is not cache.root:
        path.append(n.num_tokens)
        n = n.parent
    assert path[::-1] == [6, 10] and cache.stats.merged_nodes == 6
    assert last.parent is reader and reader.lock_ref == 1 and reader.num_tokens == 6
    cache.check_invariants()
    cache.unlock(reader)
    fill(cache, [*tokens[:2], 99, 98])  # the run branches after its first page from now on
    fill(cache, seq(2, 400))
    cache.check_invariants()
    assert (
        cache.match_prefix(tokens).num_tokens == 16
        and cache.match_prefix([*tokens[:2], 99, 98]).num_tokens == 4
    )
    top = cache.match_prefix(tokens[:2]).node
    assert len(list(top.children)) == 2  # a branch point: never merged


def test_a_conversation_stays_one_node_turn_after_turn(hash_fn: Any) -> None:
    """One chat at a time: each turn matches the conversation so far, locks it, allocates
    (the alloc merges the last turn into the conversation's locked end) and inserts; the
    conversation is the branch of a shared system prompt plus at most the newest turn's leaf,
    however many turns (at page size 1, SGLang's default, a turn is one node per page run)."""
    cache = make_cache(num_pages=400, page_size=1, hash_fn=hash_fn)
    fill(cache, [*seq(8, 900), *seq(4, 800)])  # another conversation on the system prompt
    history = seq(8, 900)
    for turn in range(8):
        prompt = [*history, *seq(3, 1000 + 10 * turn)]
        m = cache.match_prefix(prompt)
        assert m.num_tokens == len(history)
        cache.lock(m.node)
        node = m.node
        full = [*prompt, *seq(5, 2000 + 10 * turn)]
        r = cache.insert(full, m.pages + cache.alloc(len(full) - m.num_tokens))
        assert r.pages[: m.num_tokens] == m.pages and node.parent is not None  # still there
        cache.unlock(node)
        cache.check_invariants()
        depth = 0
        n = r.node
        while n is not cache.root:
            depth += 1
            n = n.parent
        assert depth <= 3, depth  # system prompt, conversation, newest turn
        history = full
    assert cache.match_prefix(history).num_tokens == len(history)
    cache.check_invariants()


def test_a_merged_away_node_is_no_longer_in_the_cache(hash_fn: Any) -> None:
    cache = make_cache(page_size=2, hash_fn=hash_fn)
    last = _publish_page_by_page(cache, seq(6))
    upper = last.parent
    cache.unlock(last)
    fill(cache, seq(2, 300))
    assert cache.stats.merged_nodes == 2
    with pytest.raises(ForeignNodeError, match="no longer in the cache"):
        cache.lock(upper)
    cache.check_invariants()


def test_no_merging_with_a_host_tier() -> None:
    from cache_helpers import FakeCopier

    cache = TieredRadixCache(PagePool(64), page_size=2, host_pool=PagePool(64), copier=FakeCopier())
    last = _publish_page_by_page(cache, seq(8))
    cache.unlock(last)
    fill(cache, seq(2, 300))
    assert cache.stats.merged_nodes == 0 and cache.num_nodes == 1 + 4 + 1
    cache.check_invariants()


def test_a_conversation_merges_turn_after_turn(hash_fn: Any) -> None:
    """Turn 2 locks turn 1's last node before anything merged it; once turn 2 is done, the
    next alloc merges the whole conversation into one node, and runs on both sides of a branch
    point merge separately (the branch point stays)."""
    cache = make_cache(page_size=2, hash_fn=hash_fn)
    turn1 = seq(8)
    last1 = _publish_page_by_page(cache, turn1)
    cache.unlock(last1)
    m = cache.match_prefix([*turn1, 50, 51])
    cache.lock(m.node)  # turn 2 starts from turn 1's end
    last2 = _publish_page_by_page(cache, [*turn1, *seq(6, 50)])
    cache.unlock(m.node)
    cache.unlock(last2)
    cache.alloc(0)
    assert last2.parent is cache.root and last2.depth_tokens == 14 and cache.num_nodes == 2
    # a branch inside turn 1: two runs above and below it, each merged, the branch point kept
    other = _publish_page_by_page(cache, [*turn1[:4], *seq(4, 80)])
    cache.unlock(other)
    cache.alloc(0)
    cache.check_invariants()
    branch = cache.match_prefix(turn1[:4]).node
    assert branch.parent is cache.root and len(list(branch.children)) == 2
    assert {c.num_tokens for c in branch.children} == {10, 4}
    assert cache.match_prefix([*turn1, *seq(6, 50)]).node is last2
