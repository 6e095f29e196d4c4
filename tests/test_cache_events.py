"""KV events and Dynamo-compatible page hashes."""

from __future__ import annotations

import struct
from typing import Any

import pytest
import xxhash
from cache_helpers import HASH_FNS, fill, make_cache

from radixkv.cache import AllBlocksCleared, BlockRemoved, BlockStored, page_hashes
from radixkv.cache.hashing import namespace_hash


def reference_hashes(tokens: list[int], page_size: int, start: int | None = None) -> list[int]:
    """Independent re-statement of Dynamo's router hashing (XXH3-64, seed 1337)."""
    out: list[int] = []
    prev = start
    for i in range(len(tokens) // page_size):
        page = tokens[i * page_size : (i + 1) * page_size]
        local = xxhash.xxh3_64_intdigest(struct.pack(f"<{page_size}I", *page), seed=1337)
        if prev is None:
            prev = local
        else:
            prev = xxhash.xxh3_64_intdigest(struct.pack("<QQ", prev, local), seed=1337)
        out.append(prev)
    return out


def test_page_hashes_match_dynamo_scheme() -> None:
    toks = list(range(1000, 1040))
    assert page_hashes(toks, 16) == reference_hashes(toks, 16)  # partial last page ignored
    assert len(page_hashes(toks, 16)) == 2
    assert page_hashes(toks, 1) == reference_hashes(toks, 1)
    assert page_hashes([], 4) == []
    # the first page's hash is the plain local block hash
    assert page_hashes([1, 2, 3, 4], 4)[0] == xxhash.xxh3_64_intdigest(
        struct.pack("<4I", 1, 2, 3, 4), seed=1337
    )
    # prefix property: hashes of a prefix are a prefix of the hashes
    assert page_hashes(toks[:32], 8) == page_hashes(toks, 8)[:4]
    with pytest.raises(ValueError):
        page_hashes(toks, 0)


def test_namespaces_never_share_hashes() -> None:
    toks = list(range(8))
    plain = page_hashes(toks, 4)
    a = page_hashes(toks, 4, namespace="a")
    b = page_hashes(toks, 4, namespace="b")
    assert a == reference_hashes(toks, 4, start=namespace_hash("a"))
    assert len({*plain, *a, *b}) == 6
    assert page_hashes(toks, 4, namespace=1) != page_hashes(toks, 4, namespace="1")


@pytest.fixture(params=list(HASH_FNS), ids=list(HASH_FNS))
def cache_and_events(request: pytest.FixtureRequest) -> tuple[Any, list[Any]]:
    cache = make_cache(num_pages=32, page_size=2, hash_fn=HASH_FNS[request.param])
    events: list[Any] = []
    cache.add_listener(events.append)
    return cache, events


def test_block_stored_on_insert(cache_and_events: tuple[Any, list[Any]]) -> None:
    cache, events = cache_and_events
    toks = [1, 2, 3, 4, 5, 6]
    fill(cache, toks, namespace="t")
    h = page_hashes(toks, 2, namespace="t")
    assert events == [BlockStored(h, namespace_hash("t"), toks, 2, "t")]
    events.clear()
    fill(cache, toks, namespace="t")  # fully cached: no event
    assert events == []
    fill(cache, [1, 2, 3, 4, 9, 9], namespace="t")  # splits, stores one page
    h2 = page_hashes([1, 2, 3, 4, 9, 9], 2, namespace="t")
    assert events == [BlockStored(h2[2:], h[1], [9, 9], 2, "t")]
    cache.check_invariants()


def test_block_removed_on_evict_and_truncation(cache_and_events: tuple[Any, list[Any]]) -> None:
    cache, events = cache_and_events
    toks = [1, 2, 3, 4, 5, 6]
    fill(cache, toks)
    h = page_hashes(toks, 2)
    events.clear()
    assert cache.evict(1) == 1  # truncates the tail page
    assert events == [BlockRemoved([h[2]], None)]
    assert cache.evict(5) == 2
    assert events[1] == BlockRemoved(h[:2], None)
    cache.check_invariants()


def test_reset_events(cache_and_events: tuple[Any, list[Any]]) -> None:
    cache, events = cache_and_events
    a = fill(cache, [1, 1, 2, 2])
    fill(cache, [3, 3])
    cache.lock(a.node)
    events.clear()
    cache.reset()  # partial: the locked path stays
    assert events == [BlockRemoved(page_hashes([3, 3], 2), None)]
    cache.unlock(a.node)
    events.clear()
    cache.reset()
    assert events == [AllBlocksCleared()]
    cache.check_invariants()


def test_event_stream_rebuilds_the_cache(cache_and_events: tuple[Any, list[Any]]) -> None:
    """A router applying the events holds exactly the cached prefixes' hashes."""
    cache, _ = cache_and_events
    router: set[int] = set()

    def apply(ev: Any) -> None:
        if isinstance(ev, BlockStored):
            router.update(ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            router.difference_update(ev.block_hashes)
        else:
            router.clear()

    cache.add_listener(apply)
    seqs = [[1, 1, 2, 2, 3, 3], [1, 1, 2, 2, 4, 4], [5, 5], [1, 1, 6, 6, 6, 6], [5, 5, 7, 7]]
    for i, s in enumerate(seqs):
        fill(cache, s, namespace=i % 2)
        if i == 3:
            cache.evict(3)
    expected: set[int] = set()
    for node in cache.iter_nodes():
        if node.num_tokens:
            path = cache.path_pages(node)
            toks: list[int] = []
            n = node
            while n is not None:
                toks = n.tokens + toks
                n = n.parent
            expected.update(page_hashes(toks, 2, node.namespace)[-len(node.pages) :])
            assert len(path) * 2 == len(toks)
    assert router == expected
    cache.remove_listener(apply)
    with pytest.raises(ValueError):
        cache.remove_listener(apply)
    with pytest.raises(TypeError):
        cache.add_listener(3)


def test_events_are_msgspec_encodable() -> None:
    import msgspec

    ev = BlockStored([1, 2], None, [5, 6], 1, "ns")
    data = msgspec.msgpack.encode(ev)
    assert msgspec.msgpack.decode(data, type=BlockStored | BlockRemoved | AllBlocksCleared) == ev
