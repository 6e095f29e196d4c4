"""The host tier of RadixCache: residency, load back, write policies, host eviction, locks over
copies in flight, failures, events and stats (FakeCopier moves Python "page contents")."""

from __future__ import annotations

from typing import Any

import pytest
from cache_helpers import HASH_FNS, FakeCopier, make_tiered, serve, snapshot

from radixkv.cache import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ForeignNodeError,
    OutOfPages,
    PagePool,
    RadixCache,
    TieredRadixCache,
    build_cache,
    page_hashes,
)
from radixkv.cache.tiers import HOST_MEDIUM, Copier, CopyHandle, LoadBack

A = list(range(10, 16))  # three pages of two tokens
B = [*A[:2], 90, 91, 92, 93]  # shares A's first page
C = [50, 51, 52, 53]


@pytest.fixture(params=list(HASH_FNS), ids=list(HASH_FNS))
def hash_fn(request: pytest.FixtureRequest) -> Any:
    return HASH_FNS[request.param]


def residency(cache: RadixCache) -> dict[tuple[int, ...], str]:
    """Own tokens of every node -> its residency."""
    return {tuple(n.tokens): n.residency for n in cache.iter_nodes() if n.num_tokens}


# ------------------------------------------------------------------------------ construction
def test_constructor_validation() -> None:
    pool = PagePool(4)
    cp = FakeCopier()
    with pytest.raises(ValueError, match="no pages"):
        build_cache(pool, 2, host_pool=PagePool(0), copier=cp)
    with pytest.raises(ValueError, match="of its own"):
        build_cache(pool, 2, host_pool=pool, copier=cp)
    used = PagePool(4)
    used.alloc(1)
    with pytest.raises(ValueError, match="unused"):
        build_cache(pool, 2, host_pool=used, copier=cp)
    with pytest.raises(ValueError, match="needs a copier"):
        build_cache(pool, 2, host_pool=PagePool(4))
    with pytest.raises(ValueError, match="without a host_pool"):
        build_cache(pool, 2, copier=cp)
    with pytest.raises(TypeError, match="to_host"):
        build_cache(pool, 2, host_pool=PagePool(4), copier=object())
    with pytest.raises(TypeError, match="host_pool must be a PagePool"):
        build_cache(pool, 2, host_pool=4, copier=cp)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="write_policy"):
        build_cache(pool, 2, write_policy="write_around")
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="write_through_threshold"):
            build_cache(pool, 2, write_through_threshold=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs a host_pool"):
        TieredRadixCache(pool, 2, host_pool=None, copier=cp)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="host_pool"):
        RadixCache(pool, 2, host_pool=PagePool(4), copier=cp)  # type: ignore[call-arg]
    # the one factory picks the class
    assert type(build_cache(pool, 2)) is RadixCache
    assert type(build_cache(pool, 2, host_pool=PagePool(4), copier=cp)) is TieredRadixCache
    assert isinstance(cp, Copier)
    assert isinstance(cp.to_host([(0, 0)]), CopyHandle)


def test_exports_and_import_stays_torch_free() -> None:
    import subprocess
    import sys

    import radixkv

    assert radixkv.LoadBack is LoadBack
    assert radixkv.HostKVPool.__name__ == "HostKVPool" and radixkv.KVCopier.__name__ == "KVCopier"
    code = (
        "import sys, radixkv\n"
        "from radixkv.cache import CompletedCopy, PagePool, TieredRadixCache, build_cache\n"
        "class C:\n"
        "    def to_host(self, pairs): return CompletedCopy()\n"
        "    to_device = to_host\n"
        "c = build_cache(PagePool(4), 1, host_pool=PagePool(4), copier=C())\n"
        "assert type(c) is TieredRadixCache\n"
        "c.insert([1, 2], c.alloc(2)); c.evict(2); lb = c.load_back(c.match_prefix([1, 2]))\n"
        "assert c.wait_load(lb) and lb.num_loaded_tokens == 2; c.check_invariants()\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_without_a_tier_nothing_changes() -> None:
    cache = RadixCache(PagePool(8), page_size=2)
    r = cache.insert(A, cache.alloc(3))
    m = cache.match_prefix(A)
    assert m == (r.node, r.pages, 6, r.node, (), 0)
    lb = cache.load_back(m)
    assert (lb.node, lb.pages, lb.num_tokens, lb.handle) == (m.node, m.pages, 6, None)
    assert cache.wait_load(lb) and cache.poll() == 0 and cache.copies_in_flight == 0
    assert not hasattr(cache, "evict_host")  # host eviction is TieredRadixCache's
    assert cache.peek_prefix(A, host=True) == 6
    assert "host" not in cache.pretty() and "device" not in cache.to_dot()
    st = cache.stats
    assert st.host_cached_pages == st.backup_pages == st.host_free_pages == 0
    cache.check_invariants()


# ------------------------------------------------------------------------------ residency
def test_evicted_backed_node_stays_host_only_and_matches_as_continuation(hash_fn: Any) -> None:
    cache, cp = make_tiered(num_pages=8, hash_fn=hash_fn)
    serve(cache, cp, A)
    serve(cache, cp, B)
    cache.wait_all()
    assert set(residency(cache).values()) == {"device+host"}
    assert cache.evict(4) == 4  # A's tail (LRU), then B's tail
    cache.check_invariants()
    assert residency(cache) == {
        (10, 11): "device+host",
        (12, 13, 14, 15): "host",
        (90, 91, 92, 93): "host",
    }
    m = cache.match_prefix(A)
    assert m.num_tokens == 2 and len(m.pages) == 1
    assert m.num_host_tokens == 4 and m.host_node.tokens == [12, 13, 14, 15]
    assert [cp.host[h] for h in m.host_pages] == [(None, tuple(A[:4])), (None, tuple(A))]
    assert cache.peek_prefix(A) == 2 and cache.peek_prefix(A, host=True) == 6
    assert cache.peek_pages(A) == m.pages  # the device-resident part only
    assert cache.peek_prefix(A[:4]) == 2 and cache.peek_prefix(A[:4], host=True) == 4
    st = cache.stats
    assert st.hit_tokens >= 2 and st.host_hit_tokens == 4 and st.demoted_pages == 4


def test_device_residency_is_top_closed_and_eviction_goes_bottom_up(hash_fn: Any) -> None:
    cache, cp = make_tiered(num_pages=8, hash_fn=hash_fn)
    serve(cache, cp, A)
    serve(cache, cp, B)
    cache.wait_all()
    order = [n.tokens for n in cache.eviction_order()]
    assert [10, 11] not in order  # it has device-resident children
    assert cache.evict(5) == 5  # both leaves go to host, then the shared page
    assert residency(cache) == {
        (10, 11): "host",
        (12, 13, 14, 15): "host",
        (90, 91, 92, 93): "host",
    }
    assert cache.num_cached_pages == 0 and cache.num_host_pages == 5
    cache.check_invariants()


def test_unbacked_victim_is_dropped_with_its_host_only_subtree(hash_fn: Any) -> None:
    """write_through_selective with a high threshold backs nothing up: eviction drops."""
    cache, cp = make_tiered(
        num_pages=8, write_policy="write_through_selective", write_through_threshold=2,
        hash_fn=hash_fn,
    )  # fmt: skip
    serve(cache, cp, A)
    cache.match_prefix(A)
    cache.match_prefix(A)  # A's one node was hit twice: backed up now
    cache.wait_all()
    serve(cache, cp, [*A, 70, 71])  # a child of A, not backed up
    assert residency(cache) == {tuple(A): "device+host", (70, 71): "device"}
    events: list[Any] = []
    cache.add_listener(events.append)
    assert cache.evict(1) == 1  # the child: unbacked, dropped
    assert residency(cache) == {tuple(A): "device+host"}
    assert cache.evict(3) == 3  # A: backed, demoted
    assert residency(cache) == {tuple(A): "host"}
    assert [type(e).__name__ for e in events] == ["BlockRemoved", "BlockRemoved"]
    assert all(e.medium is None for e in events)
    cache.check_invariants()


def test_dropping_an_unbacked_node_takes_its_host_only_children() -> None:
    cache, cp = make_tiered(num_pages=8, host_pages=2)
    serve(cache, cp, A)  # A needs 3 host pages, the tier has 2: not backed up
    assert residency(cache) == {tuple(A): "device"}
    assert cache.stats.backup_skipped_pages == 3
    serve(cache, cp, [*A, 70, 71])
    cache.wait_all()
    assert residency(cache) == {tuple(A): "device", (70, 71): "device+host"}
    assert cache.evict(1) == 1
    assert residency(cache) == {tuple(A): "device", (70, 71): "host"}
    assert cache.evict(3) == 3  # A has no host copy: it goes, and its host-only child with it
    assert residency(cache) == {} and cache.num_host_pages == 0 and cache.num_nodes == 1
    assert cache.stats.evicted_nodes == 2 and cache.stats.host_evicted_pages == 1
    cache.check_invariants()


def test_partial_eviction_frees_exactly_what_was_asked(hash_fn: Any) -> None:
    cache, cp = make_tiered(num_pages=8, hash_fn=hash_fn)
    serve(cache, cp, A)
    cache.wait_all()
    assert cache.evict(1) == 1  # A's last page goes to the host tier; the rest stays
    assert residency(cache) == {(10, 11, 12, 13): "device+host", (14, 15): "host"}
    assert cache.evict(0) == 0
    assert cache.evict(10) == 2
    assert cache.evict(1) == 0
    cache.check_invariants()


# ------------------------------------------------------------------------------ load back
def test_load_back_under_eviction_pressure(hash_fn: Any) -> None:
    cache, cp = make_tiered(num_pages=4, hash_fn=hash_fn)
    serve(cache, cp, A)
    cache.wait_all()
    cache.evict(3)
    serve(cache, cp, C)  # two pages on the device
    cache.wait_all()
    m = cache.match_prefix(A)
    assert m.num_host_tokens == 6
    lb = cache.load_back(m)  # 3 pages needed, 2 free: C is evicted (demoted) to make room
    cache.lock(lb.node)
    assert cache.wait_load(lb) and lb.num_tokens == lb.num_loaded_tokens == 6
    assert [cp.dev[p] for p in lb.pages] == [(None, tuple(A[: 2 * i])) for i in (1, 2, 3)]
    assert len(lb.copies) == 3 and lb.copies == [(h, d) for h, d in zip(m.host_pages, lb.pages)]
    assert residency(cache) == {tuple(A): "device+host", (50, 51): "device+host", (52, 53): "host"}
    cache.unlock(lb.node)
    cache.check_invariants()
    assert cache.stats.loaded_pages == 3


def test_load_back_loads_the_longest_prefix_that_fits(hash_fn: Any) -> None:
    cache, cp = make_tiered(num_pages=4, hash_fn=hash_fn)
    serve(cache, cp, A)
    cache.wait_all()
    cache.evict(3)
    held = cache.alloc(2)  # only two pages can be had
    lb = cache.load_back(cache.match_prefix(A))
    cache.lock(lb.node)
    assert cache.wait_load(lb) and lb.num_tokens == 4 and lb.num_loaded_tokens == 4
    assert residency(cache) == {(10, 11, 12, 13): "device+host", (14, 15): "host"}
    cache.unlock(lb.node)
    cache.pool.free(held)
    lb = cache.load_back(cache.match_prefix(A))  # the rest now
    assert cache.wait_load(lb) and lb.num_tokens == 6 and lb.num_loaded_tokens == 2
    cache.alloc(cache.pool.num_free)  # nothing free or evictable now but...
    cache.check_invariants()


def test_load_back_with_no_room_is_a_miss_that_changes_nothing() -> None:
    cache, cp = make_tiered(num_pages=3)
    serve(cache, cp, A)
    cache.wait_all()
    cache.evict(3)
    held = cache.alloc(3)
    m = cache.match_prefix(A)
    before = snapshot(cache)
    lb = cache.load_back(m)
    assert (lb.node, lb.pages, lb.num_tokens, lb.num_loaded_tokens) == (cache.root, [], 0, 0)
    assert cache.wait_load(lb) and snapshot(cache) == before
    cache.pool.free(held)
    cache.check_invariants()


def test_a_load_in_flight_is_locked_and_waited_for_by_other_readers() -> None:
    cache, cp = make_tiered(num_pages=6, asynchronous=True)
    serve(cache, cp, A)
    cache.wait_all()
    cache.evict(3)
    lb = cache.load_back(cache.match_prefix(A))
    assert lb.handle is not None and not lb.handle.done() and cache.copies_in_flight == 1
    assert cache.num_locked_pages == 3 and cache.num_evictable_pages == 0
    assert cache.evict(3) == 0  # the pages being filled cannot go
    with pytest.raises(OutOfPages):
        cache.alloc(4)
    m = cache.match_prefix(A)  # a second reader of the same pages waits for the load
    assert cp.pending == [] and cache.copies_in_flight == 0
    assert m.num_tokens == 6 and [cp.dev[p] for p in m.pages][-1] == (None, tuple(A))
    assert cache.wait_load(lb)  # already retired: the result is remembered
    cache.check_invariants()


def test_load_back_of_a_stale_match() -> None:
    cache, cp = make_tiered(num_pages=6)
    serve(cache, cp, A)
    cache.wait_all()
    cache.evict(3)
    m = cache.match_prefix(A)
    serve(cache, cp, A)  # someone else loaded it meanwhile (a second match + load)
    lb = cache.load_back(m)  # nothing left to load: the device prefix as it is now
    assert lb.num_tokens == 6 and lb.num_loaded_tokens == 0 and lb.handle is None
    cache.reset()
    with pytest.raises(ForeignNodeError):
        cache.load_back(m)  # its node is gone
    assert isinstance(lb, LoadBack) and "num_tokens=6" in repr(lb)


# ------------------------------------------------------------------------------ failures
@pytest.mark.parametrize("when", ["issue", "copy"])
def test_failed_load_is_a_miss_with_nothing_leaked(when: str) -> None:
    cache, cp = make_tiered(num_pages=6, asynchronous=True)
    serve(cache, cp, A)
    cache.wait_all()
    cache.evict(3)
    free_before = cache.pool.num_free
    (cp.fail_issue if when == "issue" else cp.fail_copy).add("to_device")
    m = cache.match_prefix(A)
    lb = cache.load_back(m)
    cache.lock(lb.node)
    if when == "issue":  # the load back reports what is on the device: nothing
        assert lb.error is not None and lb.num_loaded_tokens == 0 and lb.node is cache.root
        assert cache.wait_load(lb) and lb.pages == [] and lb.num_tokens == 0
    else:
        assert lb.error is None and lb.num_loaded_tokens == 6
        assert not cache.wait_load(lb)
    cache.unlock(lb.node)
    assert residency(cache) == {tuple(A): "host"}
    assert cache.pool.num_free == free_before and cache.num_locked_pages == 0
    assert all(n.lock_ref == 0 for n in cache.iter_nodes())
    assert cache.stats.load_failures == 1 and cache.stats.loaded_pages == 0
    cache.check_invariants()
    serve(cache, cp, A)  # and it loads fine the next time
    assert cache.stats.loaded_pages == 3


def test_failed_load_retired_by_poll_while_the_engine_holds_its_lock() -> None:
    cache, cp = make_tiered(num_pages=6, asynchronous=True)
    serve(cache, cp, A)
    cache.wait_all()
    cache.evict(3)
    cp.fail_copy.add("to_device")
    lb = cache.load_back(cache.match_prefix(A))
    cache.lock(lb.node)
    cp.complete()
    assert cache.poll() == 1  # retired: undone although the engine still holds lb.node
    assert residency(cache) == {tuple(A): "host"} and cache.pool.num_free == 6
    cache.check_invariants()
    assert not cache.wait_load(lb)
    cache.unlock(lb.node)
    assert cache.num_host_evictable_pages == 3
    cache.check_invariants()


@pytest.mark.parametrize("when", ["issue", "copy"])
def test_failed_backup_leaves_the_node_on_the_device_only(when: str) -> None:
    cache, cp = make_tiered(num_pages=6, asynchronous=True)
    (cp.fail_issue if when == "issue" else cp.fail_copy).add("to_host")
    serve(cache, cp, A)
    if when == "copy":
        assert residency(cache) == {tuple(A): "device+host"} and cache.copies_in_flight == 1
        cp.complete()
        cache.poll()
    assert residency(cache) == {tuple(A): "device"}
    assert cache.num_host_pages == 0 and cache.host_pool.num_free == cache.host_pool.num_pages
    assert cache.stats.backup_failures == 1 and cache.stats.backup_pages == 0
    assert cache.num_locked_pages == 0
    cache.check_invariants()
    assert cache.evict(3) == 3 and cache.num_nodes == 1  # unbacked: dropped


def test_write_back_with_a_failing_copy_drops_the_victim() -> None:
    cache, cp = make_tiered(num_pages=6, write_policy="write_back")
    serve(cache, cp, A)
    cp.fail_copy.add("to_host")
    assert cache.evict(3) == 3
    assert cache.num_nodes == 1 and cache.num_host_pages == 0
    assert cache.host_pool.num_free == cache.host_pool.num_pages
    assert cache.stats.backup_failures == 1
    cache.check_invariants()


# ------------------------------------------------------------------------------ write policies
def test_write_through_backs_up_on_insert() -> None:
    cache, cp = make_tiered(num_pages=6, asynchronous=True)
    serve(cache, cp, A)
    (node,) = [n for n in cache.iter_nodes() if n.num_tokens]
    assert node.residency == "device+host" and node.copies_in_flight == 1 and node.lock_ref == 1
    assert cache.stats.backup_pages == 0  # counted when it succeeded
    assert cache.evict(3) == 0 and cache.evict_host(3) == 0  # in flight: locked in both tiers
    cp.complete()
    assert cache.poll() == 1 and node.lock_ref == 0 and node.copies_in_flight == 0
    assert [cp.host[h] for h in node.host_pages] == [(None, tuple(A[: 2 * i])) for i in (1, 2, 3)]
    assert cache.stats.backup_pages == 3
    cache.check_invariants()


def test_write_through_selective_waits_for_the_threshold() -> None:
    cache, cp = make_tiered(num_pages=8, write_policy="write_through_selective",
                            write_through_threshold=3)  # fmt: skip
    serve(cache, cp, A)  # its own match counts as no hit on the new node
    for i in range(3):
        assert residency(cache) == {tuple(A): "device"}, i
        cache.match_prefix(A)
    cache.wait_all()
    assert residency(cache) == {tuple(A): "device+host"}
    assert cache.stats.backup_pages == 3


def test_write_back_backs_up_only_on_eviction() -> None:
    cache, cp = make_tiered(num_pages=6, write_policy="write_back")
    serve(cache, cp, A)
    assert residency(cache) == {tuple(A): "device"} and cp.issued == 0
    assert cache.evict(2) == 2  # a partial eviction backs up (and demotes) just the tail
    assert residency(cache) == {(10, 11): "device", (12, 13, 14, 15): "host"}
    st = cache.stats
    assert st.write_back_pages == st.backup_pages == 2 and st.demoted_pages == 2
    assert [cp.host[h] for h in cache.match_prefix(A).host_pages] == [
        (None, tuple(A[:4])),
        (None, tuple(A)),
    ]
    cache.check_invariants()


def test_write_back_makes_room_by_host_eviction() -> None:
    cache, cp = make_tiered(num_pages=8, host_pages=3, write_policy="write_back")
    serve(cache, cp, A)
    cache.evict(3)
    assert residency(cache) == {tuple(A): "host"}
    serve(cache, cp, C)
    cache.evict(2)  # C is backed up; the host tier makes room by evicting A's tail
    assert residency(cache) == {(10, 11): "host", tuple(C): "host"}
    assert cache.stats.host_evicted_pages == 2
    cache.check_invariants()


# ------------------------------------------------------------------------------ host eviction
def test_host_eviction_takes_only_unlocked_host_leaves(hash_fn: Any) -> None:
    cache, cp = make_tiered(num_pages=8, hash_fn=hash_fn)
    serve(cache, cp, A)
    serve(cache, cp, B)
    cache.wait_all()
    cache.evict(4)  # A's and B's tails are host-only now
    order = [n.tokens for n in cache.host_eviction_order()]
    assert [10, 11] not in order  # its children are host-resident
    m = cache.match_prefix(B)
    cache.lock(m.host_node)  # a locked host-only node stays
    assert cache.evict_host(100) == 2  # A's tail only
    assert residency(cache) == {(10, 11): "device+host", (90, 91, 92, 93): "host"}
    cache.unlock(m.host_node)
    assert cache.evict_host(1) == 1  # B's tail, partially: exactly one page
    assert residency(cache) == {(10, 11): "device+host", (90, 91): "host"}
    assert cache.evict_host(2) == 2  # B's rest, then the host copy of the shared page
    assert residency(cache) == {(10, 11): "device"}
    assert cache.num_host_pages == 0
    cache.check_invariants()
    with pytest.raises(ValueError):
        cache.evict_host(-1)


def test_host_eviction_is_lru(hash_fn: Any) -> None:
    cache, cp = make_tiered(num_pages=8, hash_fn=hash_fn)
    serve(cache, cp, A)
    serve(cache, cp, C)
    cache.wait_all()
    cache.evict(5)
    cache.match_prefix(A)  # A is more recent now
    assert [n.tokens for n in cache.host_eviction_order()] == [C, A]
    cache.evict_host(2)
    assert residency(cache) == {tuple(A): "host"}


# ------------------------------------------------------------------------------ insert
def test_insert_over_host_only_nodes_promotes_them(hash_fn: Any) -> None:
    cache, cp = make_tiered(num_pages=8, hash_fn=hash_fn)
    serve(cache, cp, A)
    cache.wait_all()
    cache.evict(3)
    fresh = cache.alloc(4)  # the request recomputed everything instead of loading back
    r = cache.insert([*A, 7, 7], fresh)
    assert r.pages == fresh and r.num_cached_before == 0  # nothing on the device before
    assert residency(cache) == {tuple(A): "device+host", (7, 7): "device+host"}
    assert cache.stats.duplicate_pages == 0
    cache.check_invariants()


def test_insert_with_a_bad_page_over_host_nodes_changes_nothing() -> None:
    cache, cp = make_tiered(num_pages=8)
    serve(cache, cp, A)
    cache.wait_all()
    cache.evict(3)
    before = snapshot(cache)
    with pytest.raises(ValueError):
        cache.insert(A, [0, 0, 1])
    assert snapshot(cache) == before


# ------------------------------------------------------------------------------ events, stats
def test_events_say_which_medium(hash_fn: Any) -> None:
    cache, cp = make_tiered(num_pages=8, hash_fn=hash_fn)
    events: list[Any] = []
    cache.add_listener(events.append)
    serve(cache, cp, A)
    cache.wait_all()
    cache.evict(3)
    serve(cache, cp, A)  # loaded back
    cache.evict_host(3)
    h = page_hashes(A, 2)
    assert events == [
        BlockStored(h, None, A, 2, None),
        BlockStored(h, None, A, 2, None, HOST_MEDIUM),
        BlockRemoved(h, None),
        BlockStored(h, None, A, 2, None),  # the load back landed
        BlockRemoved(h, None, HOST_MEDIUM),
    ]
    # the first and last events read as they always did by a consumer that ignores medium
    assert events[0].medium is None and events[2].medium is None
    cache.reset()
    assert events[-1] == AllBlocksCleared()


def test_reset_with_a_locked_path_removes_both_tiers_per_node() -> None:
    cache, cp = make_tiered(num_pages=8)
    serve(cache, cp, A)
    serve(cache, cp, C)
    serve(cache, cp, [60, 61])
    cache.wait_all()
    keep = cache.match_prefix(A)  # A is the most recent now
    cache.evict(2)  # C (the least recent) to host
    cache.lock(keep.node)
    events: list[Any] = []
    cache.add_listener(events.append)
    cache.reset()
    assert residency(cache) == {tuple(A): "device+host"}
    assert sorted((len(e.block_hashes), e.medium or "") for e in events) == [
        (1, ""),  # [60, 61] from the device
        (1, HOST_MEDIUM),  # and from the host
        (2, HOST_MEDIUM),  # C from the host
    ]
    cache.unlock(keep.node)
    cache.check_invariants()


def test_stats_per_tier() -> None:
    cache, cp = make_tiered(num_pages=4, host_pages=5)
    serve(cache, cp, A)
    cache.wait_all()
    cache.evict(3)
    serve(cache, cp, A)
    st = cache.stats
    assert (st.backup_pages, st.demoted_pages, st.loaded_pages, st.host_hit_tokens) == (3, 3, 3, 6)
    assert (st.host_cached_pages, st.host_free_pages, st.host_evictable_pages) == (3, 2, 3)
    assert st.copies_in_flight == 0 and st.cached_pages == 3


def test_pictures_show_residency() -> None:
    cache, cp = make_tiered(num_pages=8, asynchronous=True)
    serve(cache, cp, A)
    serve(cache, cp, C)
    text = cache.pretty()
    assert "copying=1" in text and "2 copies in flight" in text
    cache.wait_all()
    cache.match_prefix(A)
    cache.evict(2)
    text = cache.pretty()
    assert "[50 51 52 53] 4 tok, host, pages [], host [" in text
    assert "[10 11 12 13 14 15] 6 tok, device+host, pages [0,1,2]" in text
    dot = cache.to_dot()
    assert "\\nhost" in dot and "dotted" in dot and "device+host" in dot
