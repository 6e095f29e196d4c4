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
    assert key_to_list(to_token_bytes([2**32 - 1])) == [2**32 - 1]


BAD: list[tuple[Any, type[Exception], str]] = [
    ([1, -2, 3], ValueError, "non-negative"),
    (array("q", [1, -2]), ValueError, "non-negative"),
    (np.array([1, -2]), ValueError, "non-negative"),
    (torch.tensor([1, -2]), ValueError, "non-negative"),
    ([1, 2**32], ValueError, "2\\*\\*32"),
    (array("q", [2**40]), ValueError, "2\\*\\*32"),
    ([1, 2**70], ValueError, "2\\*\\*32"),
    (np.array([2**40], np.uint64), ValueError, "2\\*\\*32"),
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


def reaches_lookup(bad: Any, exc: type) -> bool:
    """Ids out of range in a list or array('q') that still fit in int64: they reach a lookup,
    which does not range-check (no stored key holds such an id); insert does."""
    return (
        exc is ValueError and type(bad) in (list, array) and all(-(2**63) <= t < 2**63 for t in bad)
    )


@pytest.mark.parametrize(("bad", "exc", "msg"), BAD, ids=[repr(b)[:30] for b, _, _ in BAD])
@pytest.mark.parametrize("hash_name", list(HASH_FNS))
def test_bad_tokens_leave_cache_unchanged(bad: Any, exc: type, msg: str, hash_name: str) -> None:
    cache = make_cache(page_size=2, hash_fn=HASH_FNS[hash_name])
    fill(cache, [1, 2, 3, 4])
    held = cache.alloc(2)
    before = snapshot(cache)
    if reaches_lookup(bad, exc):
        assert cache.peek_prefix(bad) == 0
        assert cache.match_prefix(bad).num_tokens == 0
        before = snapshot(cache)  # the match counted in the stats, nothing else changed
    else:
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


@pytest.mark.parametrize("tail_len", [1, 511, 512, 513, 1023, 1024, 1025, 2000])
@pytest.mark.parametrize("bad", [-1, 2**32, -(2**63), 2**63 - 1])
@pytest.mark.parametrize("hash_name", list(HASH_FNS))
def test_bad_id_after_a_cached_prefix(tail_len: int, bad: int, hash_name: str) -> None:
    """A lookup's match ends before the page holding a bad id (and splits nothing past it);
    an insert checks every id it would store (the uncached tail, on both sides of the short
    check's length) and fails before any change."""
    cache = make_cache(num_pages=2000, page_size=2, hash_fn=HASH_FNS[hash_name])
    fill(cache, [1, 2, 3, 4, 7, 7])
    query = array("q", [1, 2, 3, 4, *([7] * (tail_len - 1)), bad])
    bad_page = (len(query) - 1) // 2  # the page the bad id is in
    assert cache.peek_prefix(query) == min(6, 2 * bad_page)
    m = cache.match_prefix(query)
    assert m.num_tokens == min(6, 2 * bad_page)
    assert all(0 <= t < 2**32 for n in cache.iter_nodes() for t in n.tokens)
    cache.check_invariants()
    n = len(query) // 2 * 2
    pages = cache.alloc(n // 2)
    before = snapshot(cache)
    with pytest.raises(ValueError, match=r"non-negative|2\*\*32"):
        cache.insert(query[:n] if n == len(query) else query[: n - 2] + query[-2:], pages)
    assert snapshot(cache) == before
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
    bad = array("q", [1, 2, -3])
    assert cache.match_prefix(bad).num_tokens == 2  # a lookup does not range-check
    bad.append(7)
    with pytest.raises(ValueError):
        cache.insert(bad, cache.alloc(2))
    bad.append(8)
    with pytest.raises(ValueError):
        cache.insert(array("q", [1, 2, 3, 4, -1, 0]), cache.alloc(3))
    # keys past SHORT_CHECK are checked by a numpy array over the caller's view: it goes
    # with the call, raised or not
    cache = make_cache(num_pages=4096, page_size=2)
    long = array("q", range(100, 100 + 2 * 1500))
    long[-1] = 2**32
    with pytest.raises(ValueError, match=r"2\*\*32") as kept:
        cache.insert(long, cache.alloc(1500))
    long.append(1)  # BufferError if the failed insert still held a view, here through the
    assert kept.tb is not None  # traceback the caller keeps
    short = array("q", [1, 2, 3, -4])
    with pytest.raises(ValueError, match="non-negative") as kept:
        cache.insert(short, cache.alloc(2))
    short.append(1)
    del long[-3:]  # the appended id, the bad one and one more: 1,499 whole pages
    with pytest.raises(ValueError, match=r"not HELD|is free") as kept:  # valid ids, bad pages
        cache.insert(long, list(range(4096 - 1499, 4096)))
    long.append(1)
    del long[-1:]
    r = cache.insert(long, cache.alloc(1499))
    long.append(1)
    assert cache.match_prefix(long).pages == r.pages
    cache.check_invariants()
