"""Token inputs: every accepted container gives the same key; bad input fails cleanly."""

from __future__ import annotations

import subprocess
import sys
from array import array
from typing import Any

import numpy as np
import pytest
import torch
from cache_helpers import HASH_FNS, fill, make_cache, snapshot

from radixkv.cache import page_hashes
from radixkv.cache.tokens import key_to_list, to_token_bytes

TOKS = [3, 1, 4, 1, 5, 9, 2, 6]
GOOD = [
    TOKS,
    tuple(TOKS),
    array("q", TOKS),
    array("i", TOKS),
    array("L", TOKS),
    np.array(TOKS, np.int64),
    np.array(TOKS, np.int32),
    np.array(TOKS, np.uint16),
    np.array(TOKS, dtype=">i4"),  # non-native byte order
    np.array(TOKS * 2, np.int64)[::2] * 0 + np.array(TOKS, np.int64),
    torch.tensor(TOKS),
    torch.tensor(TOKS, dtype=torch.int32),
    torch.tensor(TOKS + TOKS)[::2] * 0 + torch.tensor(TOKS),  # non-contiguous
    range(3, 3),  # empty range handled below
]


@pytest.mark.parametrize("tokens", GOOD[:-1], ids=lambda t: type(t).__name__)
def test_containers_give_the_same_key(tokens: Any) -> None:
    key = to_token_bytes(tokens)
    assert key_to_list(key) == TOKS
    cache = make_cache(page_size=4)
    pages = cache.alloc(2)
    r = cache.insert(tokens, pages)
    assert cache.match_prefix(TOKS).pages == r.pages
    assert cache.match_prefix(tokens).pages == r.pages
    cache.check_invariants()


def test_empty_and_range_inputs() -> None:
    assert to_token_bytes(range(0)) == b""
    assert key_to_list(to_token_bytes(range(4))) == [0, 1, 2, 3]
    with pytest.raises(TypeError, match="float32"):  # the dtype is wrong even when empty
        to_token_bytes(np.zeros(0, np.float32))
    # a token id is any int64 (the trie compares ids; it never reads them as uint32)
    wide = [2**32 - 1, 2**32, -1, -(2**63), 2**63 - 1]
    for tokens in (wide, array("q", wide), np.array(wide), torch.tensor(wide)):
        assert key_to_list(to_token_bytes(tokens)) == wide
    assert key_to_list(to_token_bytes(np.array([2**63 - 1], np.uint64))) == [2**63 - 1]


BAD: list[tuple[Any, type[Exception], str]] = [
    ([1, 2**63], ValueError, "int64"),
    ([1, -(2**63) - 1], ValueError, "int64"),
    ((1, 2**70), ValueError, "int64"),
    (np.array([2**63], np.uint64), ValueError, "int64"),
    (array("Q", [1, 2**64 - 1]), ValueError, "int64"),
    ([1.0, 2.0], TypeError, "ints"),
    ([1, "2"], TypeError, "ints"),
    ([[1, 2], [3, 4]], TypeError, "ints"),
    (np.array([1.0, 2.0]), TypeError, "float64"),
    (np.array([True, False]), TypeError, "bool"),
    (np.array([[1, 2], [3, 4]]), ValueError, "1-D"),
    (np.array(5), ValueError, "1-D"),
    (np.array([1, None], dtype=object), TypeError, "integer"),
    (torch.tensor([1.0, 2.0]), TypeError, "integer tensor"),
    (torch.tensor([True, False]), TypeError, "bool"),
    (torch.tensor([[1, 2]]), ValueError, "1-D"),
    (array("d", [1.0]), TypeError, "array"),
    ("1234", TypeError, "str"),
    (b"\x01\x02", TypeError, "bytes"),
    (None, TypeError, "NoneType"),
    (5, TypeError, "int"),
]


@pytest.mark.parametrize(("bad", "exc", "msg"), BAD, ids=[repr(b)[:30] for b, _, _ in BAD])
@pytest.mark.parametrize("hash_name", list(HASH_FNS))
def test_bad_tokens_leave_cache_unchanged(bad: Any, exc: type, msg: str, hash_name: str) -> None:
    cache = make_cache(page_size=2, hash_fn=HASH_FNS[hash_name])
    fill(cache, [1, 2, 3, 4])
    held = cache.alloc(2)
    before = snapshot(cache)
    with pytest.raises(exc, match=msg):
        cache.match_prefix(bad)
    with pytest.raises(exc, match=msg):
        cache.peek_prefix(bad)
    assert snapshot(cache) == before
    with pytest.raises(exc, match=msg):
        cache.insert(bad, held)
    assert snapshot(cache) == before
    cache.check_invariants()


def test_cache_module_does_not_import_torch() -> None:
    code = (
        "import sys, radixkv\n"
        "from radixkv import RadixCache, PagePool\n"
        "from radixkv.cache import page_hashes\n"
        "c = RadixCache(PagePool(4), page_size=1)\n"
        "c.insert([1, 2], c.alloc(2)); c.check_invariants(); c.pretty(); c.to_dot()\n"
        "page_hashes([1, 2], 1)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


WIDE = [-1, 2**32, -(2**63), 2**63 - 1, 2**32 + 5]


@pytest.mark.parametrize("tail_len", [1, 511, 1024, 2000])
@pytest.mark.parametrize("wide", WIDE)
@pytest.mark.parametrize("hash_name", list(HASH_FNS))
def test_any_int64_id_is_a_key(tail_len: int, wide: int, hash_name: str) -> None:
    """Ids outside [0, 2**32) are keys like any other: stored, matched exactly (never as their
    uint32 wrap), split at, evicted, and published with hashes no uint32 page has."""
    cache = make_cache(num_pages=2100, page_size=2, hash_fn=HASH_FNS[hash_name])
    events: list[Any] = []
    cache.add_listener(events.append)
    fill(cache, [1, 2, 3, 4, 7, 7])
    key = array("q", [1, 2, 3, 4, *([7] * (tail_len - 1)), wide])
    key = key[: len(key) // 2 * 2]
    key[-1] = wide
    m = cache.match_prefix(key)
    assert m.num_tokens == min(6, len(key) - 2)
    cache.lock(m.node)
    r = cache.insert(key, m.pages + cache.alloc(len(key) // 2 - len(m.pages)))
    cache.unlock(m.node)
    cache.check_invariants()
    assert cache.match_prefix(key).pages == r.pages
    assert cache.peek_prefix(key) == len(key)
    wrapped = array("q", key)
    wrapped[-1] = wide & (2**32 - 1)  # what a uint32 reading of the id gives
    assert cache.match_prefix(wrapped).num_tokens == len(key) - 2
    stored = events[-1]
    assert stored.token_ids[-1] == wide and stored.block_hashes[-1] == page_hashes(key, 2)[-1]
    assert page_hashes(key, 2)[:-1] == page_hashes(wrapped, 2)[:-1]
    assert page_hashes(key, 2)[-1] != page_hashes(wrapped, 2)[-1]
    # the other half of the same page (the wide id moved to the first slot) hashes apart too
    swapped = array("q", key[:-2]) + array("q", [wide, key[-2]])
    assert page_hashes(swapped, 2)[-1] not in (page_hashes(key, 2)[-1], page_hashes(wrapped, 2)[-1])
    assert cache.evict(cache.num_evictable_pages) > 0
    assert cache.match_prefix(key).num_tokens == 0
    cache.check_invariants()


def test_array_input_is_not_kept_or_locked() -> None:
    """array('q') input is read through a view: the cache keeps no reference to it, and the
    caller can resize it again once a call returns or raises."""
    cache = make_cache(page_size=2)
    toks = array("q", [1, 2, 3, 4])
    r = cache.insert(toks, cache.alloc(2))
    toks.append(5)  # BufferError if the cache still held a view
    m = cache.match_prefix(toks)
    assert m.pages == r.pages and cache.peek_prefix(toks) == 4
    toks[0] = 9  # mutating the caller's array afterwards does not touch the cache
    toks.append(6)
    assert all(type(n.key) is bytes for n in cache.iter_nodes())
    assert cache.match_prefix([1, 2, 3, 4]).pages == r.pages
    odd = array("q", [1, 2, 3])  # not whole pages
    with pytest.raises(ValueError, match="page_size"):
        cache.insert(odd, cache.alloc(2))
    odd.append(7)
    # a failed insert releases its view of the array even while the caller keeps the traceback
    cache = make_cache(num_pages=4096, page_size=2)
    long = array("q", range(100, 100 + 2 * 1500))
    with pytest.raises(ValueError, match=r"not held|free") as kept:  # pages the caller lacks
        cache.insert(long, list(range(4096 - 1500, 4096)))
    long.append(1)  # BufferError if the failed insert still held a view, here through the
    assert kept.tb is not None  # traceback the caller keeps
    with pytest.raises(ValueError, match="page_size") as kept:
        cache.insert(long, cache.alloc(1500))
    long.append(1)
    del long[-2:]
    r = cache.insert(long, cache.alloc(1500))
    long.append(1)
    assert cache.match_prefix(long).pages == r.pages
    cache.check_invariants()
