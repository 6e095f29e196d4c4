"""The model's inference-only shortcuts (no autograd): in-place SwiGLU and residual adds give the
very same numbers as the autograd path; RMSNorm of bf16 input in three passes stays within one
bf16 rounding of the reference formula."""

from __future__ import annotations

import pytest
import torch

from radixkv import onednn as onednn_mod
from radixkv.attention.base import BatchLayout
from radixkv.attention.registry import get_backend
from radixkv.kv.kv_pool import KVPool
from radixkv.model.layers import RMSNorm, SwiGLU
from radixkv.model.tiny import build_tiny_random_model


def test_rms_norm_of_bf16_within_one_rounding_of_the_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(256, 1e-5, device=None, dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(256, generator=gen))
    x = (3 * torch.randn(500, 256, generator=gen)).to(torch.bfloat16)
    with torch.inference_mode():
        fast = norm(x)
    # the reference formula (HF's): fp32 copy, mean of squares, cast back, times the weight
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
    ref = norm.weight.detach() * h.to(torch.bfloat16)
    assert fast.dtype == torch.bfloat16
    assert (fast == ref).float().mean() > 0.99
    ulp = ref.float().abs() * 2**-7  # bf16 keeps 8 significant bits
    assert ((fast.float() - ref.float()).abs() <= ulp).all()


def test_swiglu_in_place_equals_the_autograd_path() -> None:
    torch.manual_seed(1)
    mlp = SwiGLU(64, 96, False, device=None, dtype=torch.float32)
    x = torch.randn(33, 64)
    with torch.inference_mode():
        fast = mlp(x)
    slow = mlp(x)  # grad enabled: out-of-place
    assert slow.requires_grad
    assert torch.equal(fast, slow.detach())


def test_whole_forward_without_autograd_equals_with_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """In-place residual stream, SwiGLU and the cast-once RoPE tables change no bit (fp32).
    The oneDNN linear (inference only, a different summation order) is off here: it has its own
    tests; this one is about the in-place shortcuts."""
    monkeypatch.setattr(onednn_mod, "USE_ONEDNN", False)
    model = build_tiny_random_model()
    cfg = model.config
    outs = []
    for grad in (False, True):
        kv = KVPool(cfg.num_layers, 8, 16, cfg.num_kv_heads, cfg.head_dim)
        attn = get_backend(
            "torch",
            kv,
            num_qo_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
        )
        attn.plan(BatchLayout.build([[0, 1, 2]], [0], [40]))
        ids = torch.arange(3, 43)
        with torch.set_grad_enabled(grad):
            outs.append(model(ids, torch.arange(40), attn).detach())
    assert torch.equal(outs[0], outs[1])
