"""Sliding-window attention on the torch backend against a dense banded reference: fresh and
cached prefills shorter and longer than the window, decode groups mixing both, layers of
both kinds in one step, and the cascade backend falling back where a window cuts a prefix."""

from __future__ import annotations

import pytest
import torch

from radixkv.attention import matmul_attention
from radixkv.attention.base import BatchLayout
from radixkv.attention.paged_ops import token_slots
from radixkv.attention.registry import get_backend
from radixkv.kv.kv_pool import KVPool

HQ, HKV, D = 6, 2, 8


def _banded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
            window: int) -> torch.Tensor:  # fmt: skip
    """fp64 reference: the query at position p sees keys max(0, p - window + 1) .. p
    (window 0: all of 0 .. p)."""
    g = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(g, dim=1)
    v = v.double().repeat_interleave(g, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q.double(), k) * q.shape[-1] ** -0.5
    keys = torch.arange(k.shape[0]).unsqueeze(0)
    seen = keys <= q_pos.unsqueeze(1)
    if window:
        seen &= keys > q_pos.unsqueeze(1) - window
    return torch.einsum("hnl,lhd->nhd", torch.softmax(s.masked_fill(~seen, float("-inf")), -1), v)


def _run(page_size: int, num_past: list[int], num_new: list[int], windows: tuple[int, ...],
         seed: int = 0, mode: str = "auto") -> None:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    needs = [(p + n + page_size - 1) // page_size for p, n in zip(num_past, num_new)]
    kv = KVPool(len(windows), sum(needs), page_size, HKV, D)
    kv.k.copy_(torch.randn(kv.k.shape, generator=gen))
    kv.v.copy_(torch.randn(kv.v.shape, generator=gen))
    perm = torch.randperm(sum(needs), generator=gen).tolist()
    tables, used = [], 0
    for n in needs:
        tables.append(perm[used : used + n])
        used += n
    old = matmul_attention.MODE
    matmul_attention.MODE = mode
    try:
        backend = get_backend(
            "torch", kv, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, layer_windows=windows
        )
    finally:
        matmul_attention.MODE = old
    backend.plan(BatchLayout.build(tables, num_past, num_new))
    t = sum(num_new)
    for layer, window in enumerate(windows):
        q = torch.randn(t, HQ, D, generator=gen)
        k = torch.randn(t, HKV, D, generator=gen)
        v = torch.randn(t, HKV, D, generator=gen)
        with torch.inference_mode():
            out = backend.forward(layer, q, k, v)
        row = 0
        for pt, past, new in zip(tables, num_past, num_new):
            slots = token_slots(torch.tensor(pt), 0, past + new, page_size)
            keys, vals = kv.k_flat(layer)[slots], kv.v_flat(layer)[slots]
            ref = _banded(q[row : row + new], keys, vals, torch.arange(past, past + new), window)
            where = f"layer {layer} (window {window}), past {past}, new {new}"
            torch.testing.assert_close(
                out[row : row + new].double(), ref, atol=1e-5, rtol=1e-5,
                msg=lambda m, where=where: f"{where}: {m}",
            )  # fmt: skip
            row += new


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("mode", ["never", "always"])
def test_mixed_batch_with_full_and_windowed_layers(page_size: int, mode: str) -> None:
    """Fresh prefills shorter and longer than the window, chunks on a cached past that ends
    inside or past it, decodes inside and past it: the windowed layers see only their band,
    the full layer everything, in one planned step (both CPU prefill paths for the short
    sequences, which attend as in full)."""
    num_past = [0, 0, 37, 5, 64, 130, 0, 300, 3, 700]
    num_new = [20, 300, 1, 1, 1, 300, 1, 17, 40, 1]
    _run(page_size, num_past, num_new, (24, 0, 24, 100), seed=page_size, mode=mode)


@pytest.mark.parametrize("window", [1, 2, 16, 17, 255, 256, 257])
def test_window_edges(window: int) -> None:
    """Windows of one key, at and around page and query-chunk boundaries (256)."""
    _run(16, [0, 0, window - 1, window, 2 * window, 600], [window, 600, 1, 1, 1, 40],
         (window,), seed=window)  # fmt: skip


def test_no_window_plan_when_every_sequence_fits() -> None:
    """Sequences no longer than the window attend exactly as in full: no second plan."""
    kv = KVPool(2, 8, 4, HKV, D)
    backend = get_backend(
        "torch", kv, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, layer_windows=(8, 0)
    )
    backend.plan(BatchLayout.build([[0, 1], [2, 3]], [0, 7], [8, 1]))
    assert backend._windowed == {}
    backend.plan(BatchLayout.build([[0, 1, 4], [2, 3]], [0, 7], [9, 1]))
    assert list(backend._windowed) == [8]


@pytest.mark.parametrize(
    ("windows", "match"),
    [
        ((4,), "2 layers"),
        ((4, -1), r"layer_windows\[1\]"),
        ((4, 2.5), r"layer_windows\[1\]"),
        ((True, 0), r"layer_windows\[0\]"),
    ],
)
def test_bad_layer_windows(windows: tuple, match: str) -> None:
    kv = KVPool(2, 8, 4, HKV, D)
    with pytest.raises(ValueError, match=match):
        get_backend("torch", kv, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D,
                    layer_windows=windows)  # fmt: skip
