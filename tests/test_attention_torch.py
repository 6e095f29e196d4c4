"""The torch paged-attention backend and the reusable paged ops, against dense references."""

from __future__ import annotations

import sys

import pytest
import torch

from radixkv.attention import matmul_attention
from radixkv.attention.base import BatchLayout
from radixkv.attention.paged_ops import (
    attend_pages_with_lse,
    flash_query_rows,
    merge_attention_states,
    token_slots,
)
from radixkv.attention.registry import get_backend
from radixkv.kv.kv_pool import KVPool
from radixkv.onednn import onednn_available

HQ, HKV, D = 6, 2, 8


def _dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, Hq, D], k/v [L, Hkv, D]; query at position p sees keys 0..p. fp64 reference."""
    g = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(g, dim=1)
    v = v.double().repeat_interleave(g, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q.double(), k) * q.shape[-1] ** -0.5
    visible = torch.arange(k.shape[0]).unsqueeze(0) <= q_pos.unsqueeze(1)
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, -1)
    o = torch.einsum("hnl,lhd->nhd", torch.softmax(s, -1), v)
    return o, lse.T


def _random_pool(page_size: int, num_pages: int, seed: int) -> KVPool:
    kv = KVPool(2, num_pages, page_size, HKV, D)
    gen = torch.Generator().manual_seed(seed)
    kv.k.copy_(torch.randn(kv.k.shape, generator=gen))
    kv.v.copy_(torch.randn(kv.v.shape, generator=gen))
    return kv


@pytest.mark.parametrize("way", ["matmul", "lse-split", "masked-chunks"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_backend_matches_dense_on_mixed_batch(page_size: int, way: str) -> None:
    """Every way of a prefill on past tokens: blocked matmuls over past and own keys (the CPU
    default with oneDNN), past/own keys merged by log-sum-exp (the CPU flash kernel), and query
    chunks with causal masks (elsewhere, or without the CPU kernel)."""
    gen = torch.Generator().manual_seed(page_size)
    num_past = [0, 37, 5, 64, 130, 0, 300]
    num_new = [20, 1, 1, 1, 300, 1, 17]
    needs = [(p + n + page_size - 1) // page_size for p, n in zip(num_past, num_new)]
    kv = _random_pool(page_size, sum(needs), seed=page_size)
    perm = torch.randperm(sum(needs), generator=gen).tolist()  # distinct, scattered pages
    tables, used = [], 0
    for n in needs:
        tables.append(perm[used : used + n])
        used += n
    backend = get_backend("torch", kv, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D)
    assert backend._split_past  # the CPU default, when PyTorch has the kernel (it does here)
    assert backend._matmul_prefill == (
        onednn_available() and matmul_attention.pays(torch.float32, HQ, HKV, D)
    )
    backend._matmul_prefill = way == "matmul"
    backend._split_past = way == "lse-split"
    layout = BatchLayout.build(tables, num_past, num_new)
    backend.plan(layout)
    t = sum(num_new)
    q = torch.randn(t, HQ, D, generator=gen)
    k = torch.randn(t, HKV, D, generator=gen)
    v = torch.randn(t, HKV, D, generator=gen)
    with torch.inference_mode():  # (oneDNN's products run only without autograd)
        out = backend.forward(1, q, k, v)
    assert out.shape == q.shape
    row = 0
    for pt, past, new in zip(tables, num_past, num_new):
        table = torch.tensor(pt)
        slots = token_slots(table, 0, past + new, page_size)
        keys, vals = kv.k_flat(1)[slots], kv.v_flat(1)[slots]
        torch.testing.assert_close(keys[past:], k[row : row + new])  # new K written in place
        torch.testing.assert_close(vals[past:], v[row : row + new])
        ref, _ = _dense_attention(q[row : row + new], keys, vals, torch.arange(past, past + new))
        torch.testing.assert_close(out[row : row + new].double(), ref, atol=1e-5, rtol=1e-5)
        row += new
    assert kv.k[0].abs().sum() > 0  # layer 0 unchanged but still holds the random data


def test_pure_decode_batch_with_equal_and_unequal_lengths() -> None:
    kv = _random_pool(4, 64, seed=3)
    gen = torch.Generator().manual_seed(3)
    for lens in ([9, 9, 9], [1, 14, 6]):
        tables = [list(range(i * 16, i * 16 + (n + 3) // 4)) for i, n in enumerate(lens)]
        backend = get_backend("auto", kv, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D)
        assert backend.name == "torch"
        backend.plan(BatchLayout.build(tables, [n - 1 for n in lens], [1] * len(lens)))
        q = torch.randn(len(lens), HQ, D, generator=gen)
        kn = torch.randn(len(lens), HKV, D, generator=gen)
        out = backend.forward(0, q, kn, kn)
        for i, n in enumerate(lens):
            slots = token_slots(torch.tensor(tables[i]), 0, n, 4)
            ref, _ = _dense_attention(
                q[i : i + 1], kv.k_flat(0)[slots], kv.v_flat(0)[slots], torch.tensor([n - 1])
            )
            torch.testing.assert_close(out[i : i + 1].double(), ref, atol=1e-5, rtol=1e-5)


def test_flash_query_rows_pads_only_lone_bf16_rows() -> None:
    """A lone bf16 query row per head goes to the CPU flash kernel twice (its one-row product
    is 3x slower); fp32, fp16 and multi-row queries pass through as they are."""
    q = torch.randn(3, 2, 1, 8).bfloat16()
    padded = flash_query_rows(q)
    assert padded.shape == (3, 2, 2, 8) and padded.is_contiguous()
    assert torch.equal(padded[:, :, :1], q) and torch.equal(padded[:, :, 1:], q)
    for same in (q.float(), q.half(), torch.randn(3, 2, 2, 8).bfloat16()):
        assert flash_query_rows(same) is same


def test_bf16_decode_with_one_query_row_per_kv_head() -> None:
    """Multi-head attention (as many query as kv heads) decoding in bf16: the padded kernel
    call keeps each sequence's own row, for equal and unequal lengths."""
    ps, h, d = 4, 3, 16
    kv = KVPool(1, 64, ps, h, d, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(5)
    kv.k.copy_(torch.randn(kv.k.shape, generator=gen))
    kv.v.copy_(torch.randn(kv.v.shape, generator=gen))
    for lens in ([9, 9, 9, 9], [1, 14, 6, 30]):
        tables = [list(range(i * 16, i * 16 + (n + ps - 1) // ps)) for i, n in enumerate(lens)]
        backend = get_backend("torch", kv, num_qo_heads=h, num_kv_heads=h, head_dim=d)
        backend.plan(BatchLayout.build(tables, [n - 1 for n in lens], [1] * len(lens)))
        q = torch.randn(len(lens), h, d, generator=gen).bfloat16()
        kn = torch.randn(len(lens), h, d, generator=gen).bfloat16()
        out = backend.forward(0, q, kn, kn)
        assert out.dtype == torch.bfloat16 and out.shape == q.shape
        for i, n in enumerate(lens):
            slots = token_slots(torch.tensor(tables[i]), 0, n, ps)
            keys, vals = kv.k_flat(0)[slots], kv.v_flat(0)[slots]
            ref, _ = _dense_attention(q[i : i + 1], keys, vals, torch.tensor([n - 1]))
            torch.testing.assert_close(out[i : i + 1].double(), ref, atol=2e-2, rtol=2e-2)
            # and the same as the kernel with the lone row (no padding), to bf16 rounding
            lone = torch.nn.functional.scaled_dot_product_attention(
                q[i].unsqueeze(1), keys.transpose(0, 1), vals.transpose(0, 1)
            )
            torch.testing.assert_close(out[i], lone[:, 0], atol=1e-2, rtol=1e-2)


def test_attend_pages_with_lse_and_merge() -> None:
    kv = _random_pool(4, 32, seed=5)
    gen = torch.Generator().manual_seed(5)
    pages = torch.tensor([7, 2, 30, 11, 4])
    slots = token_slots(pages, 0, 18, 4)
    keys, vals = kv.k_flat(0)[slots], kv.v_flat(0)[slots]
    q = torch.randn(5, HQ, D, generator=gen)
    pos = torch.tensor([17, 3, 10, 0, 12])
    ref_o, ref_lse = _dense_attention(q, keys, vals, pos)
    o, lse = attend_pages_with_lse(q, kv.k[0], kv.v[0], pages, 18, q_positions=pos)
    torch.testing.assert_close(o.double(), ref_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    # no mask: all 18 keys
    o_all, lse_all = attend_pages_with_lse(q, kv.k[0], kv.v[0], pages, 18)
    ref_all, ref_lse_all = _dense_attention(q, keys, vals, torch.full((5,), 17))
    torch.testing.assert_close(o_all.double(), ref_all, atol=1e-5, rtol=1e-5)
    # split the keys into a shared prefix (first 2 pages) and the rest: merge == whole
    o1, l1 = attend_pages_with_lse(q, kv.k[0], kv.v[0], pages[:2], 8)
    rest_ref, rest_lse = _dense_attention(q, keys[8:], vals[8:], torch.full((5,), 9))
    merged, merged_lse = merge_attention_states(o1, l1, rest_ref.float(), rest_lse.float())
    torch.testing.assert_close(merged.double(), ref_all, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merged_lse.double(), ref_lse_all, atol=1e-5, rtol=1e-5)
    # a query that sees nothing: lse -inf, o 0, and merging it is a no-op
    o_none, lse_none = attend_pages_with_lse(
        q[:1], kv.k[0], kv.v[0], pages, 18, q_positions=torch.tensor([-1])
    )
    assert torch.isinf(lse_none).all() and (o_none == 0).all()
    m, _ = merge_attention_states(o_none, lse_none, o_all[:1], lse_all[:1])
    torch.testing.assert_close(m, o_all[:1])


def test_attend_pages_with_lse_batched_rows() -> None:
    kv = _random_pool(2, 40, seed=6)
    gen = torch.Generator().manual_seed(6)
    tables = torch.tensor([[3, 9, 1, 0], [22, 5, 6, 7], [30, 31, 0, 0]])
    lens = torch.tensor([7, 8, 3])
    q = torch.randn(3, HQ, D, generator=gen)
    o, lse = attend_pages_with_lse(q, kv.k[1], kv.v[1], tables, lens)
    for b in range(3):
        n = int(lens[b])
        slots = token_slots(tables[b], 0, n, 2)
        ref, ref_lse = _dense_attention(
            q[b : b + 1], kv.k_flat(1)[slots], kv.v_flat(1)[slots], torch.tensor([n - 1])
        )
        torch.testing.assert_close(o[b : b + 1].double(), ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[b : b + 1].double(), ref_lse, atol=1e-5, rtol=1e-5)
    with pytest.raises(TypeError, match="kv_lens"):
        attend_pages_with_lse(q, kv.k[1], kv.v[1], tables, 3)


def test_registry_and_plan_errors() -> None:
    kv = KVPool(1, 4, 4, HKV, D)
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_backend("xformers", kv, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D)
    with pytest.raises(ValueError, match="multiple"):
        get_backend("torch", kv, num_qo_heads=5, num_kv_heads=HKV, head_dim=D)
    with pytest.raises(ValueError, match="kv heads"):
        get_backend("torch", kv, num_qo_heads=HQ, num_kv_heads=3, head_dim=D)
    backend = get_backend("auto", kv, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D)
    assert "flashinfer" not in sys.modules  # CPU pool: never imported
    with pytest.raises(RuntimeError, match="before plan"):
        backend.forward(0, torch.zeros(1, HQ, D), torch.zeros(1, HKV, D), torch.zeros(1, HKV, D))
    with pytest.raises(ValueError, match="page table has 1"):
        backend.plan(BatchLayout.build([[0]], [3], [2]))
    with pytest.raises(ValueError, match="differ in length"):
        BatchLayout.build([[0]], [0, 1], [1])
    backend.plan(BatchLayout.build([[0]], [0], [2]))
    with pytest.raises(ValueError, match="planned 2 tokens"):
        backend.forward(0, torch.zeros(3, HQ, D), torch.zeros(3, HKV, D), torch.zeros(3, HKV, D))


def test_backend_used_inside_and_outside_inference_mode() -> None:
    kv = _random_pool(4, 16, seed=9)
    backend = get_backend("torch", kv, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D)
    layout = BatchLayout.build([[0, 1, 2], [5, 6]], [9, 4], [1, 1])
    q, k = torch.randn(2, HQ, D), torch.randn(2, HKV, D)
    with torch.inference_mode():
        backend.plan(layout)
        first = backend.forward(0, q, k, k)
    backend.plan(layout)
    second = backend.forward(0, q, k, k)  # reuses the gather buffer made under inference mode
    torch.testing.assert_close(first, second)


def test_batch_layout_page_tables_are_int_tuples() -> None:
    """Tensors and other sequences of page ids are converted to plain ints; the engine's lists
    of ints are copied as they are."""
    layout = BatchLayout.build(
        [torch.tensor([3, 4]), [5, 6], range(7, 9)], [1, 1, 1], torch.tensor([1, 1, 1])
    )
    assert layout.page_tables == ((3, 4), (5, 6), (7, 8))
    assert all(type(p) is int for pt in layout.page_tables for p in pt)
    assert all(type(n) is int for n in layout.num_new)
