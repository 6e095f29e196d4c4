"""Prefill attention as blocked matmuls (the torch backend's CPU bf16 path, and its fp32 path
through oneDNN): causal, GQA, prefills on past keys, block edges, peaked rows; as accurate as
PyTorch's flash kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixkv import onednn
from radixkv.attention import matmul_attention
from radixkv.attention.base import BatchLayout
from radixkv.attention.matmul_attention import causal_matmul_attention
from radixkv.attention.registry import get_backend
from radixkv.kv.kv_pool import KVPool

BF16 = torch.bfloat16


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """fp64 causal attention of the last n positions over all L (q [n,Hq,D], k/v [L,Hkv,D])."""
    n, hq, d = q.shape
    g = hq // k.shape[1]
    kk = k.double().repeat_interleave(g, dim=1)
    vv = v.double().repeat_interleave(g, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q.double(), kk) * d**-0.5
    past = k.shape[0] - n
    visible = torch.arange(k.shape[0])[None, :] <= torch.arange(past, past + n)[:, None]
    s = s.masked_fill(~visible, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", torch.softmax(s, -1), vv)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """PyTorch's kernel on the same bf16 inputs (past keys: an explicit bottom-right mask)."""
    n, past = q.shape[0], k.shape[0] - q.shape[0]
    mask = torch.arange(k.shape[0])[None, :] <= torch.arange(past, past + n)[:, None]
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        enable_gqa=True,
    )
    return o[0].transpose(0, 1)


def _qkv(
    n: int, length: int, hq: int, hkv: int, d: int, amp: float, seed: int, dtype=BF16
) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    q = (amp * torch.randn(n, hq, d, generator=gen)).to(dtype)
    k = (amp * torch.randn(length, hkv, d, generator=gen)).to(dtype)
    v = torch.randn(length, hkv, d, generator=gen).to(dtype)
    return q, k, v


@pytest.mark.parametrize(
    ("n", "past", "hq", "hkv"),
    [(70, 0, 4, 2), (70, 37, 4, 2), (33, 200, 8, 8), (2, 64, 16, 4), (96, 0, 1, 1)],
)
@pytest.mark.parametrize("amp", [1.0, 2.5])
def test_matches_fp64_as_closely_as_the_flash_kernel(
    monkeypatch: pytest.MonkeyPatch, n: int, past: int, hq: int, hkv: int, amp: float
) -> None:
    monkeypatch.setattr(matmul_attention, "BLOCK_BYTES", 1)  # minimum rows: several blocks
    q, k, v = _qkv(n, past + n, hq, hkv, 32, amp, seed=n + past)
    out = causal_matmul_attention(q, k, v, 32**-0.5)
    assert out.dtype == BF16 and out.shape == q.shape
    ref = _reference(q, k, v)
    err = (out.double() - ref).abs().mean().item()
    flash_err = (_flash(q, k, v).double() - ref).abs().mean().item()
    # one bf16 rounding of the output alone costs ~2^-9 of its size
    print("RATIO", n, past, hq, hkv, amp, err / flash_err)
    assert err <= 1.25 * flash_err + 1e-4, (err, flash_err)
    torch.testing.assert_close(out.double(), ref, atol=0.05, rtol=0.02)


@pytest.mark.parametrize(
    ("n", "past", "hq", "hkv"),
    [(70, 0, 4, 2), (70, 37, 4, 2), (33, 200, 8, 8), (2, 64, 16, 4), (96, 0, 1, 1)],
)
def test_fp32_matches_fp64_as_closely_as_the_flash_kernel_through_onednn(
    monkeypatch: pytest.MonkeyPatch, n: int, past: int, hq: int, hkv: int
) -> None:
    monkeypatch.setattr(matmul_attention, "BLOCK_BYTES", 1)
    calls = []
    op = onednn._ONEDNN_LINEAR
    if op is not None:  # count the products that really go through oneDNN

        def counted(*args: object) -> torch.Tensor:
            calls.append(1)
            return op(*args)

        monkeypatch.setattr(onednn, "_ONEDNN_LINEAR", counted)
    q, k, v = _qkv(n, past + n, hq, hkv, 32, 1.0, seed=n + past, dtype=torch.float32)
    with torch.inference_mode():
        out = causal_matmul_attention(q, k, v, 32**-0.5)
    assert out.dtype == torch.float32 and out.shape == q.shape
    ref = _reference(q, k, v)
    err = (out.double() - ref).abs().mean().item()
    flash_err = (_flash(q, k, v).double() - ref).abs().mean().item()
    assert err <= 2.0 * flash_err, (err, flash_err)
    torch.testing.assert_close(out.double(), ref, atol=1e-6, rtol=1e-5)
    if op is not None:  # two products per kv head and row block (32 rows: BLOCK_BYTES 1)
        assert len(calls) == 2 * hkv * -(-n // matmul_attention.MIN_ROWS)
    # the fallback (no oneDNN, or autograd on) computes the same through F.linear
    monkeypatch.setattr(onednn, "USE_ONEDNN", False)
    with torch.inference_mode():
        torch.testing.assert_close(causal_matmul_attention(q, k, v, 32**-0.5), out)


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_never_sees_a_later_key(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    monkeypatch.setattr(matmul_attention, "BLOCK_BYTES", 1)
    q, k, v = _qkv(80, 100, 4, 2, 16, 1.0, seed=1, dtype=dtype)
    with torch.inference_mode():
        out = causal_matmul_attention(q, k, v, 0.25)
        for i in (0, 31, 32, 33, 79):  # across block edges
            k2, v2 = k.clone(), v.clone()
            k2[20 + i + 1 :] = 50.0  # what the query at position 20 + i may not see
            v2[20 + i + 1 :] = -50.0
            again = causal_matmul_attention(q, k2, v2, 0.25)
            assert torch.equal(again[i], out[i]), i


def test_peaked_rows_stay_exact_where_it_matters() -> None:
    """Scores spanning thousands (a trained model's sharp heads): exponentials far below the
    row maximum underflow; the result still matches the reference, with no NaN."""
    q, k, v = _qkv(64, 64, 2, 2, 32, 12.0, seed=2)
    out = causal_matmul_attention(q, k, v, 32**-0.5)
    assert torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.double(), _reference(q, k, v), atol=0.03, rtol=0.02)


def test_torch_backend_uses_it_for_cpu_bf16_prefills_with_and_without_past(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(matmul_attention, "MODE", "always")  # (where it pays)
    ps, hq, hkv, d = 4, 4, 2, 16
    kv = KVPool(1, 80, ps, hkv, d, BF16)
    backend = get_backend("torch", kv, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d)
    assert backend._matmul_prefill
    q, k, v = _qkv(90, 90, hq, hkv, d, 1.0, seed=3)
    # all 90 tokens at once, into pages 0..22
    backend.plan(BatchLayout.build([list(range(23))], [0], [90]))
    fresh = backend.forward(0, q, k, v)
    # the same tokens as 50 cached (scattered pages) + 40 new
    table = list(range(60, 73)) + list(range(30, 40))
    backend.plan(BatchLayout.build([table], [0], [50]))
    backend.forward(0, q[:50], k[:50], v[:50])
    backend.plan(BatchLayout.build([table], [50], [40]))
    cached = backend.forward(0, q[50:], k[50:], v[50:])
    ref = _reference(q, k, v)
    torch.testing.assert_close(fresh.double(), ref, atol=0.03, rtol=0.02)
    torch.testing.assert_close(cached.double(), ref[50:], atol=0.03, rtol=0.02)
    torch.testing.assert_close(cached.float(), fresh[50:].float(), atol=0.02, rtol=0.02)


def test_torch_backend_takes_it_in_fp32_only_with_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    def make() -> object:
        return get_backend(
            "torch", KVPool(1, 8, 4, 2, 16), num_qo_heads=4, num_kv_heads=2, head_dim=16
        )

    monkeypatch.setattr(matmul_attention, "MODE", "always")  # (where it pays)
    assert make()._matmul_prefill == (onednn._ONEDNN_LINEAR is not None)
    monkeypatch.setattr(matmul_attention, "MODE", "never")  # where the flash kernel is faster
    assert not make()._matmul_prefill
    monkeypatch.setattr(matmul_attention, "MODE", "always")
    monkeypatch.setattr(onednn, "USE_ONEDNN", False)
    assert not make()._matmul_prefill  # without oneDNN the flash kernel is faster
    half = KVPool(1, 8, 4, 2, 16, torch.float16)
    assert not get_backend(
        "torch", half, num_qo_heads=4, num_kv_heads=2, head_dim=16
    )._matmul_prefill


@pytest.mark.parametrize("heads", [(4, 2), (1, 1)])
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_strided_inputs_as_a_fused_qkv_projection_gives_them(
    dtype: torch.dtype, heads: tuple[int, int]
) -> None:
    hq, hkv = heads
    q, k, v = _qkv(40, 40, hq, hkv, 16, 1.0, seed=4, dtype=dtype)
    fused = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)  # [n, (Hq+2Hkv) * 16]
    qs, ks, vs = fused.split([hq * 16, hkv * 16, hkv * 16], dim=1)
    qs, ks, vs = qs.view(40, hq, 16), ks.view(40, hkv, 16), vs.view(40, hkv, 16)
    assert not ks.is_contiguous() and not vs.is_contiguous()
    with torch.inference_mode():
        want = causal_matmul_attention(q, k, v, 0.25)
        got = causal_matmul_attention(qs, ks, vs, 0.25)
    torch.testing.assert_close(got, want)


def test_it_runs_where_it_pays_measured_once_per_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """``pays`` times the blocks against the flash kernel once per (dtype, group, head_dim,
    threads) and keeps the answer; the torch backend follows it."""
    monkeypatch.setattr(matmul_attention, "_PAYS", {})
    timings = {BF16: (1.0, 2.0), torch.float32: (2.0, 1.0)}  # (blocks, flash) seconds
    calls: list[tuple[torch.dtype, int, int, int]] = []

    def fake(dtype: torch.dtype, hq: int, hkv: int, d: int) -> tuple[float, float]:
        calls.append((dtype, hq, hkv, d))
        return timings[dtype]

    monkeypatch.setattr(matmul_attention, "_time_both", fake)
    assert matmul_attention.pays(BF16, 32, 8, 128)
    assert matmul_attention.pays(BF16, 32, 8, 128)  # kept, not timed again
    assert calls == [(BF16, 8, 2, 128)]  # 4 query heads per kv head, on two kv heads
    assert not matmul_attention.pays(torch.float32, 32, 8, 128)
    assert len(calls) == 2

    def make(dtype: torch.dtype) -> object:
        pool = KVPool(1, 8, 4, 8, 128, dtype)
        return get_backend("torch", pool, num_qo_heads=32, num_kv_heads=8, head_dim=128)

    assert make(BF16)._matmul_prefill
    assert make(BF16).prefill_path == "blocked matmuls"
    assert not make(torch.float32)._matmul_prefill  # slower here: the flash kernel runs
    assert make(torch.float32).prefill_path == "flash kernel"
    assert len(calls) == 2


@pytest.mark.parametrize(("blocks_s", "chosen"), [(0.97, False), (0.86, False), (0.84, True)])
def test_a_near_tie_keeps_the_flash_kernel(
    monkeypatch: pytest.MonkeyPatch, blocks_s: float, chosen: bool
) -> None:
    """The blocks must take under MIN_SHARE of the kernel's time: a near tie, which timing
    noise would decide either way from one process to the next (and with it the rounding of
    every prefill), keeps the kernel."""
    assert matmul_attention.MIN_SHARE == 0.85
    monkeypatch.setattr(matmul_attention, "_PAYS", {})
    monkeypatch.setattr(matmul_attention, "_time_both", lambda *a: (blocks_s, 1.0))
    assert matmul_attention.pays(BF16, 8, 4, 64) is chosen


def test_the_measurement_times_both_for_real(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(matmul_attention, "CALIBRATION_TOKENS", 64)
    for dtype in (BF16, torch.float32):
        blocks, flash = matmul_attention._time_both(dtype, 4, 2, 16)
        assert 0 < blocks < 1 and 0 < flash < 1
