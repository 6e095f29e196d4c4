"""HostKVPool and KVCopier: sizing, exact round trips of page data, failures, and the cache
driving them (a RadixCache with a host tier over real K/V tensors)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from radixkv.cache import PagePool, TieredRadixCache
from radixkv.kv.copier import KVCopier
from radixkv.kv.host_pool import HostKVPool
from radixkv.kv.kv_pool import KVPool

L, PS, H, D = 2, 4, 2, 8


def make_kv(num_pages: int = 8, dtype: torch.dtype = torch.float32) -> KVPool:
    kv = KVPool(L, num_pages, PS, H, D, dtype, "cpu")
    g = torch.Generator().manual_seed(0)
    kv.k.copy_(torch.randn(kv.k.shape, generator=g))
    kv.v.copy_(torch.randn(kv.v.shape, generator=g))
    return kv


def test_host_pool_shape_and_budget() -> None:
    kv = make_kv()
    host = HostKVPool.like(kv, 5)
    assert host.k.shape == (5, L, PS, H, D) and host.v.shape == host.k.shape
    assert host.bytes_per_page == kv.bytes_per_page and host.total_bytes == 5 * kv.bytes_per_page
    assert not host.pin_memory and host.matches(kv)
    sized = HostKVPool.from_memory_budget(kv.bytes_per_page * 3 + 1, kv)
    assert sized.num_pages == 3
    assert HostKVPool.from_memory_budget(kv.bytes_per_page * 3, kv, max_pages=2).num_pages == 2
    assert not HostKVPool.like(KVPool(L, 2, PS, H, D, torch.float16), 1).matches(kv)


@pytest.mark.parametrize("budget", [0, 100, -1, 1.5, True, "1GB", None])
def test_host_budget_too_small_or_invalid_is_a_clear_error(budget: object) -> None:
    kv = make_kv()
    with pytest.raises(ValueError, match="host memory") as e:
        HostKVPool.from_memory_budget(budget, kv)  # type: ignore[arg-type]
    if budget in (0, 100):
        assert f"one page needs {kv.bytes_per_page} bytes" in str(e.value)
    with pytest.raises(ValueError, match="max_pages"):
        HostKVPool.from_memory_budget(kv.bytes_per_page * 4, kv, max_pages=0)
    with pytest.raises(ValueError, match="num_pages"):
        HostKVPool(L, 0, PS, H, D)
    with pytest.raises(TypeError, match="dtype"):
        HostKVPool(L, 1, PS, H, D, torch.int32)


@pytest.mark.parametrize("layerwise", [False, True], ids=["all-at-once", "layerwise"])
@pytest.mark.parametrize("background", [True, False], ids=["thread", "inline"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_exact(background: bool, dtype: torch.dtype, layerwise: bool) -> None:
    """device page -> host page -> another device page: bit-identical, every layer, K and V."""
    kv = make_kv(dtype=dtype)
    host = HostKVPool.like(kv, 4)
    with KVCopier(kv, host, background=background, layerwise=layerwise) as copier:
        want_k = kv.k[:, [1, 5]].clone()
        want_v = kv.v[:, [1, 5]].clone()
        copier.to_host([(1, 3), (5, 0)]).wait()
        assert torch.equal(host.k[3], want_k[:, 0]) and torch.equal(host.v[0], want_v[:, 1])
        h = copier.to_device([(3, 6), (0, 2)])
        h.wait()
        assert h.done()
        assert torch.equal(kv.k[:, 6], want_k[:, 0]) and torch.equal(kv.k[:, 2], want_k[:, 1])
        assert torch.equal(kv.v[:, 6], want_v[:, 0]) and torch.equal(kv.v[:, 2], want_v[:, 1])
        assert torch.equal(kv.k[:, 1], want_k[:, 0])  # the source is untouched


@pytest.mark.parametrize("layerwise", [False, True], ids=["all-at-once", "layerwise"])
def test_copies_run_in_order_on_the_thread(layerwise: bool) -> None:
    """One worker: a load issued after a backup reads what the backup wrote."""
    kv = make_kv()
    host = HostKVPool.like(kv, 2)
    with KVCopier(kv, host, layerwise=layerwise) as copier:
        want = kv.k[:, 4].clone()
        copier.to_host([(4, 1)])
        copier.to_device([(1, 7)]).wait()
        assert torch.equal(kv.k[:, 7], want)


def _break_loads(copier: KVCopier, fn: Callable[..., None]) -> None:
    """Make ``copier``'s loads run ``fn`` instead of copying: the whole copy, or with
    layer-wise loads each layer's."""
    if copier.layerwise:
        copier._copy_layer = fn  # type: ignore[method-assign]
    else:
        copier._cpu_to_device = fn  # type: ignore[method-assign]


@pytest.mark.parametrize("layerwise", [False, True], ids=["all-at-once", "layerwise"])
def test_bad_pairs_raise_at_issue_and_copy_errors_at_wait(layerwise: bool) -> None:
    kv = make_kv()
    host = HostKVPool.like(kv, 2)
    with KVCopier(kv, host, layerwise=layerwise) as copier:
        for bad in ([(0, 2)], [(8, 0)], [(-1, 0)], [(0, 1), (1, 1)], [(True, 0)]):
            with pytest.raises(ValueError):
                copier.to_host(bad)
            with pytest.raises(ValueError):
                copier.to_device([(2, 0)] if bad == [(0, 2)] else bad)
        gate = threading.Event()

        def broken(*args: object) -> None:
            gate.wait(5)
            raise RuntimeError("DMA error")

        _break_loads(copier, broken)
        h = copier.to_device([(0, 0)])
        assert not h.done()
        assert len(kv.loads) == int(layerwise)  # a layer-wise load waits to be read
        gate.set()
        if layerwise:  # a failed layer never blocks a reader: wait() says it failed
            for layer in range(L):
                h.wait_layer(layer)  # type: ignore[attr-defined]
        for _ in range(2):  # every wait re-raises
            with pytest.raises(RuntimeError, match="DMA error"):
                h.wait()
        assert h.done() and not kv.loads
    inline = KVCopier(kv, host, background=False)
    inline._cpu_to_host = broken  # type: ignore[method-assign]
    h = inline.to_host([(0, 0)])
    assert h.done()
    with pytest.raises(RuntimeError, match="DMA error"):
        h.wait()


def test_copier_checks_its_pools() -> None:
    kv = make_kv()
    with pytest.raises(ValueError, match="shaped"):
        KVCopier(kv, HostKVPool(L, 2, PS, H, D + 1))
    with pytest.raises(TypeError):
        KVCopier(HostKVPool.like(kv, 2), HostKVPool.like(kv, 2))  # type: ignore[arg-type]


@pytest.mark.parametrize("layerwise", [False, True], ids=["all-at-once", "layerwise"])
def test_cache_with_a_real_host_tier_loads_back_exact_kv(layerwise: bool) -> None:
    """The engine's flow over real tensors: write KV, insert (backed up), evict (demoted),
    match (host continuation), load back into other pages, compare the data."""
    kv = KVPool(L, 6, PS, H, D)
    host = HostKVPool.like(kv, 8)
    with KVCopier(kv, host, layerwise=layerwise) as copier:
        cache = TieredRadixCache(
            PagePool(kv.num_pages), page_size=PS, host_pool=PagePool(host.num_pages), copier=copier
        )
        tokens = list(range(100, 100 + 3 * PS))
        pages = cache.alloc(3)
        for i, p in enumerate(pages):  # "the forward": distinct content per page
            kv.k[:, p] = float(i + 1)
            kv.v[:, p] = -float(i + 1)
        cache.insert(tokens, pages)
        cache.wait_all()
        assert cache.evict(3) == 3 and cache.num_cached_pages == 0
        private = cache.alloc(3)  # the freed pages go to someone else, who overwrites them
        kv.k[:, private] = 0.0
        m = cache.match_prefix(tokens)
        assert m.num_tokens == 0 and m.num_host_tokens == 3 * PS
        lb = cache.load_back(m)
        cache.lock(lb.node)
        assert cache.wait_load(lb) and lb.num_tokens == 3 * PS
        assert not set(lb.pages) & set(private)
        for i, p in enumerate(lb.pages):
            assert torch.all(kv.k[:, p] == float(i + 1)) and torch.all(kv.v[:, p] == -float(i + 1))
        cache.unlock(lb.node)
        cache.check_invariants()
        assert cache.stats.loaded_pages == 3 and cache.stats.backup_pages == 3


@pytest.mark.parametrize("layerwise", [False, True], ids=["all-at-once", "layerwise"])
def test_cache_turns_a_failing_copier_into_a_miss(layerwise: bool) -> None:
    kv = KVPool(L, 4, PS, H, D)
    host = HostKVPool.like(kv, 4)
    with KVCopier(kv, host, layerwise=layerwise) as copier:
        cache = TieredRadixCache(
            PagePool(kv.num_pages), page_size=PS, host_pool=PagePool(host.num_pages), copier=copier
        )
        tokens = list(range(2 * PS))
        cache.insert(tokens, cache.alloc(2))
        cache.wait_all()
        cache.evict(2)

        def broken(*args: object) -> None:
            raise RuntimeError("DMA error")

        _break_loads(copier, broken)
        lb = cache.load_back(cache.match_prefix(tokens))
        cache.lock(lb.node)
        assert lb.num_loaded_tokens == 2 * PS and lb.layered == layerwise
        assert not cache.wait_load(lb) and not kv.loads
        cache.unlock(lb.node)
        cache.check_invariants()
        assert cache.pool.num_free == kv.num_pages and cache.num_locked_pages == 0
        m = cache.match_prefix(tokens)
        assert m.num_tokens == 0 and m.num_host_tokens == 2 * PS  # still in the host tier
        assert cache.stats.load_failures == 1
