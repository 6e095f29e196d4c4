"""KVPool: shapes, memory budget sizing, slot arithmetic and writes."""

from __future__ import annotations

import pytest
import torch

from radixkv.kv.kv_pool import KVPool


def test_shapes_and_bytes() -> None:
    kv = KVPool(3, 10, 4, 2, 8, torch.float16, "cpu")
    assert kv.k.shape == (3, 10, 4, 2, 8)
    assert kv.k[1].shape == (10, 4, 2, 8)
    assert kv.bytes_per_page == 2 * 3 * 4 * 2 * 8 * 2
    assert kv.total_bytes == 10 * kv.bytes_per_page
    assert kv.k.abs().sum() == 0


def test_from_memory_budget() -> None:
    per_page = KVPool.page_bytes(2, 16, 2, 64, torch.float32)
    kv = KVPool.from_memory_budget(
        per_page * 7 + per_page // 2,
        num_layers=2,
        page_size=16,
        num_kv_heads=2,
        head_dim=64,
        dtype=torch.float32,
        device="cpu",
    )
    assert kv.num_pages == 7
    capped = KVPool.from_memory_budget(
        per_page * 7, num_layers=2, page_size=16, num_kv_heads=2, head_dim=64, max_pages=3
    )
    assert capped.num_pages == 3
    with pytest.raises(ValueError, match="hold no page"):
        KVPool.from_memory_budget(
            per_page - 1, num_layers=2, page_size=16, num_kv_heads=2, head_dim=64
        )


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_rejects_bad_sizes(bad: object) -> None:
    with pytest.raises(ValueError, match="page_size"):
        KVPool(1, 4, bad, 1, 8)  # type: ignore[arg-type]


def test_slots_and_write() -> None:
    kv = KVPool(2, 6, 4, 1, 2)
    pt = [5, 2, 0]
    assert kv.slot_indices(pt, 3, 9) == [23, 8, 9, 10, 11, 0]
    with pytest.raises(ValueError, match="need 4 pages"):
        kv.slot_indices(pt, 0, 13)
    slots = torch.tensor(kv.slot_indices(pt, 3, 6))
    k = torch.arange(6, dtype=torch.float32).view(3, 1, 2)
    kv.write(1, slots, k, -k)
    assert torch.equal(kv.k[1, 5, 3], k[0])
    assert torch.equal(kv.k[1, 2, 0], k[1])
    assert torch.equal(kv.v[1, 2, 1], -k[2])
    assert kv.k[0].abs().sum() == 0  # other layer untouched
