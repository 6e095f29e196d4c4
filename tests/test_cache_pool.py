"""PagePool: allocation, freeing, errors leave the pool unchanged."""

from __future__ import annotations

import numpy as np
import pytest

import radixkv
from radixkv.cache.errors import OutOfPages
from radixkv.cache.page_pool import PagePool


def test_alloc_order_and_counts() -> None:
    pool = PagePool(8)
    assert pool.num_pages == 8 and pool.num_free == 8
    assert pool.alloc(0) == []
    assert pool.alloc(3) == [0, 1, 2]
    assert pool.num_free == 5 and pool.num_held == 3
    assert pool.state(0) == "held" and pool.state(7) == "free"
    pool.free([1])
    assert pool.num_free == 6
    assert 1 in pool.alloc(6)
    assert pool.num_free == 0
    pool.check_invariants()


def test_out_of_pages_leaves_pool_unchanged() -> None:
    pool = PagePool(4)
    pool.alloc(3)
    before = (bytes(pool._state), list(pool._free))
    with pytest.raises(OutOfPages, match="cannot allocate 2") as exc:
        pool.alloc(2)
    assert exc.value.requested == 2 and exc.value.available == 1
    assert (bytes(pool._state), list(pool._free)) == before
    assert radixkv.OutOfPages is OutOfPages
    assert radixkv.PagePool is PagePool


@pytest.mark.parametrize("bad", [-1, 1.0, True, "2", None])
def test_alloc_rejects_bad_counts(bad: object) -> None:
    pool = PagePool(4)
    with pytest.raises(ValueError):
        pool.alloc(bad)  # type: ignore[arg-type]
    assert pool.num_free == 4


@pytest.mark.parametrize(
    ("pages", "message"),
    [
        ([0, 0], "more than once"),
        ([5], "not held"),  # never allocated
        ([99], "out of range"),
        ([-1], "out of range"),
        ([0, 7], "not held"),  # one good, one bad: nothing freed
    ],
)
def test_free_errors_leave_pool_unchanged(pages: list[int], message: str) -> None:
    pool = PagePool(8)
    pool.alloc(3)
    before = (bytes(pool._state), list(pool._free))
    with pytest.raises(ValueError, match=message):
        pool.free(pages)
    assert (bytes(pool._state), list(pool._free)) == before
    pool.check_invariants()


def test_double_free_and_type_errors() -> None:
    pool = PagePool(4)
    pages = pool.alloc(2)
    pool.free(pages)
    with pytest.raises(ValueError, match="double free"):
        pool.free([pages[0]])
    got = pool.alloc(1)
    with pytest.raises(TypeError):
        pool.free([1.5])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        pool.free([True])  # type: ignore[list-item]
    pool.free(np.array(got))  # numpy ints are accepted as ints
    assert pool.num_free == 4
    pool.check_invariants()


@pytest.mark.parametrize("bad", [-1, 2.0, "3"])
def test_constructor_validates(bad: object) -> None:
    with pytest.raises(ValueError):
        PagePool(bad)  # type: ignore[arg-type]


def test_empty_pool() -> None:
    pool = PagePool(0)
    assert pool.alloc(0) == []
    with pytest.raises(OutOfPages):
        pool.alloc(1)
    pool.check_invariants()
