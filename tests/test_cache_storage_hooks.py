"""What the radix cache gives a storage tier (torch-free): host pages allocated for outside data
(``alloc_host``), attached as a host continuation (``insert_host``), loaded back like any host
hit; and the host observer that tells which host pages to write, with their data valid."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from cache_helpers import HASH_FNS, make_tiered, serve, snapshot

from radixkv.cache import BlockStored, OutOfPages, PagePool, RadixCache
from radixkv.cache.tiers import HOST_HIT, HOST_LEAVING, HOST_MEDIUM, HOST_STORED, HostRun

A = list(range(10, 18))  # four pages of two tokens


@pytest.fixture(params=list(HASH_FNS), ids=list(HASH_FNS))
def hash_fn(request: pytest.FixtureRequest) -> Any:
    return HASH_FNS[request.param]


def land(cache: RadixCache, cp: Any, tokens: list[int], first: int, ns: Any = None) -> int:
    """Storage landing: host pages for pages ``first..`` of ``tokens``, filled, inserted."""
    ps = cache.page_size
    n = len(tokens) // ps - first
    pages = cache.alloc_host(n)
    for i, p in enumerate(pages, start=first):
        cp.host[p] = (ns, tuple(tokens[: (i + 1) * ps]))
    return cache.insert_host(tokens, pages, ns)


def test_insert_host_continues_a_cached_prefix_and_loads_back(hash_fn: Any) -> None:
    cache, cp = make_tiered(num_pages=16, host_pages=16, hash_fn=hash_fn)
    serve(cache, cp, A[:4])  # two pages on the device (and backed up)
    cache.wait_all()
    events: list[Any] = []
    cache.add_listener(events.append)
    assert land(cache, cp, A, 2) == 2
    cache.check_invariants()
    assert [type(e).__name__ for e in events] == ["BlockStored"]
    assert events[0].medium == HOST_MEDIUM and events[0].token_ids == A[4:]
    m = cache.match_prefix(A)
    assert m.num_tokens == 4 and m.num_host_tokens == 4
    # loaded back like any host hit: the device pages then hold exactly these tokens
    r = serve(cache, cp, A)
    assert [cp.dev[p] for p in r.pages] == [(None, tuple(A[: 2 * (i + 1)])) for i in range(4)]
    assert cache.stats.host_inserted_pages == 2
    cache.check_invariants()


def test_insert_host_at_the_root_of_a_namespace_and_under_a_split(hash_fn: Any) -> None:
    cache, cp = make_tiered(num_pages=16, host_pages=16, hash_fn=hash_fn)
    assert land(cache, cp, A[:4], 0, ns="t") == 2  # nothing cached in "t" yet: a new root
    assert cache.match_prefix(A, "t").num_host_tokens == 4
    assert cache.match_prefix(A).num_host_tokens == 0  # other namespaces see nothing
    # a continuation that diverges inside a node splits it and becomes a sibling
    other = [*A[:2], 70, 71, 72, 73]
    assert land(cache, cp, other, 1, ns="t") == 2
    assert cache.match_prefix(other, "t").num_host_tokens == 6
    assert cache.match_prefix(A[:4], "t").num_host_tokens == 4
    cache.check_invariants()


def test_insert_host_frees_duplicates_and_pages_with_nothing_to_attach_to() -> None:
    cache, cp = make_tiered(num_pages=16, host_pages=16)
    serve(cache, cp, A[:6])
    cache.wait_all()
    used = cache.host_pool.num_cached
    # pages 1..3 offered, 1..2 cached already: only page 3 joins
    assert land(cache, cp, A, 1) == 1
    assert cache.host_pool.num_cached == used + 1 and cache.host_pool.num_held == 0
    # a prefix that is not cached: nothing attaches, every page goes back
    assert land(cache, cp, [1, 2, 3, 4, 5, 6], 2) == 0
    # everything cached already
    assert land(cache, cp, A, 2) == 0
    assert cache.host_pool.num_held == 0
    cache.check_invariants()


def test_insert_host_checks_its_input_before_any_change() -> None:
    cache, cp = make_tiered(num_pages=8, host_pages=8)
    serve(cache, cp, A[:4])
    cache.wait_all()
    pages = cache.alloc_host(2)
    before = snapshot(cache)
    with pytest.raises(ValueError, match="whole pages"):
        cache.insert_host(A[:7], pages)
    with pytest.raises(ValueError, match="whole pages"):
        cache.insert_host(A[:2], pages)  # more pages than the tokens hold
    with pytest.raises(ValueError, match="not held"):
        cache.insert_host(A, [pages[0], 7 if pages[0] != 7 else 6])
    with pytest.raises(ValueError, match="int64"):
        cache.insert_host([*A[:6], 2**63, 3], pages)
    assert snapshot(cache) == before and cache.host_pool.num_held == 2
    cache.host_pool.free(pages)
    plain = RadixCache(PagePool(4), page_size=2)
    # the storage side door is TieredRadixCache's alone
    assert not hasattr(plain, "insert_host") and not hasattr(plain, "alloc_host")


def test_alloc_host_evicts_unlocked_host_pages_or_raises() -> None:
    cache, cp = make_tiered(num_pages=16, host_pages=4)
    serve(cache, cp, A)  # four pages backed up: the host tier is full
    cache.wait_all()
    m = cache.match_prefix(A[:4])
    cache.lock(m.node)  # two host pages locked
    with pytest.raises(OutOfPages):
        cache.alloc_host(3)
    assert cache.host_pool.num_cached == 4  # nothing was evicted
    got = cache.alloc_host(2)  # the unlocked tail's host copy makes room
    assert len(got) == 2 and cache.stats.host_evicted_pages == 2
    cache.host_pool.free(got)
    cache.unlock(m.node)
    cache.check_invariants()


def test_host_observer_sees_valid_pages_stored_hit_and_leaving() -> None:
    cache, cp = make_tiered(num_pages=6, host_pages=4, asynchronous=True)
    runs: list[HostRun] = []

    def observe(run: HostRun) -> None:
        tokens = np.frombuffer(run.prefix, np.int64).tolist()
        n = len(tokens) // 2
        for i, p in enumerate(run.host_pages, start=n - len(run.host_pages)):
            assert cp.host[p] == (run.namespace, tuple(tokens[: 2 * (i + 1)]))  # valid now
        runs.append(run)

    cache.set_host_observer(observe)
    serve(cache, cp, A[:6])
    assert runs == []  # the backup is still in flight: not valid yet
    cache.wait_all()
    assert [r.event for r in runs] == [HOST_STORED] and len(runs[0].host_pages) == 3
    assert cache.host_runs()[0].prefix == np.asarray(A[:6], np.int64).tobytes()
    cache.match_prefix(A[:6])  # hit count 1 == write_through_threshold
    assert runs[-1].event == HOST_HIT
    cache.match_prefix(A[:6])
    assert [r.event for r in runs].count(HOST_HIT) == 1  # once, when it reaches the count
    serve(cache, cp, [1, 2, 3, 4, 5, 6])  # the host tier must make room: A's pages leave
    cache.wait_all()
    leaving = [r for r in runs if r.event == HOST_LEAVING]
    assert leaving and all(
        r.prefix.startswith(np.asarray(A[:2], np.int64).tobytes()) for r in leaving
    )
    cache.set_host_observer(None)
    n = len(runs)
    serve(cache, cp, [7, 8, 9, 10])
    cache.wait_all()
    assert len(runs) == n
    with pytest.raises(TypeError):
        cache.set_host_observer(42)  # type: ignore[arg-type]


def test_landed_pages_are_not_reported_to_the_observer() -> None:
    cache, cp = make_tiered(num_pages=8, host_pages=8)
    runs: list[HostRun] = []
    cache.set_host_observer(runs.append)
    stored: list[BlockStored] = []
    cache.add_listener(lambda e: stored.append(e) if isinstance(e, BlockStored) else None)
    assert land(cache, cp, A[:4], 0) == 2
    assert runs == [] and stored[-1].medium == HOST_MEDIUM
