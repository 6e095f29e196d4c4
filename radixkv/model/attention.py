"""Attention: the attention sublayer every model family shares (its projections under Hugging
Face's names, optional q/k norms, RoPE, the backend's paged attention, the output projection).

The families differ only in what they hand it: the norm class of their q/k norms and where
those norms sit (``qk_norm_over``), and how RoPE rotates (``rope``: halves, or Cohere's
adjacent pairs). Layers listed in ``ModelConfig.nope_layers`` skip RoPE.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from radixkv.attention.base import AttentionBackend
from radixkv.model.config import ModelConfig
from radixkv.model.layers import RMSNorm, apply_rope
from radixkv.model.linear import Linear

Rope = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# Where the q/k norms (ModelConfig.qk_norm) apply and what their weight covers:
# "head": each head's head_dim dims, one weight shared by the heads (Qwen3, Gemma 3);
# "projection": the whole q or k projection at once, before it is split into heads (OLMo);
# "heads": each head's dims, with a weight per head (Cohere's Command R+).
QK_NORM_PLACES = ("head", "projection", "heads")


class Attention(nn.Module):
    """``x [T, hidden]`` -> ``[T, hidden]``; writes layer ``layer_idx``'s K/V through the
    attention backend (its ``forward``), after waiting for that layer of any host-tier load
    still landing in the pool (``KVPool.loads``: the only place a forward reads the pool)."""

    def __init__(
        self,
        cfg: ModelConfig,
        layer_idx: int,
        *,
        device: Any,
        dtype: torch.dtype,
        norm: Callable[..., nn.Module] = RMSNorm,
        qk_norm_over: str = "head",
        rope: Rope = apply_rope,
    ) -> None:
        super().__init__()
        if qk_norm_over not in QK_NORM_PLACES:
            raise ValueError(f"qk_norm_over must be one of {QK_NORM_PLACES}, got {qk_norm_over!r}")
        self.layer_idx = layer_idx
        self.use_rope = layer_idx not in cfg.nope_layers  # SmolLM3's, Cohere 2's NoPE layers
        self.rope = rope
        h, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, hkv, d
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        q_out, kv_out = h * d, hkv * d
        self.q_proj = Linear(cfg.hidden_size, q_out, bias=cfg.qkv_bias, **kw)
        self.k_proj = Linear(cfg.hidden_size, kv_out, bias=cfg.qkv_bias, **kw)
        self.v_proj = Linear(cfg.hidden_size, kv_out, bias=cfg.qkv_bias, **kw)
        self.o_proj = Linear(q_out, cfg.hidden_size, bias=cfg.o_bias, **kw)
        self.qk_norm_over = qk_norm_over
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if cfg.qk_norm:  # normalise q and k before RoPE
            q_shape, k_shape = {
                "head": (d, d), "projection": (q_out, kv_out), "heads": ((h, d), (hkv, d)),
            }[qk_norm_over]  # fmt: skip
            self.q_norm = norm(q_shape, cfg.rms_norm_eps, **kw)
            self.k_norm = norm(k_shape, cfg.rms_norm_eps, **kw)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        normed = self.q_norm is not None and self.k_norm is not None
        if normed and self.qk_norm_over == "projection":
            q, k = self.q_norm(q), self.k_norm(k)  # type: ignore[misc]
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if normed and self.qk_norm_over != "projection":
            q, k = self.q_norm(q), self.k_norm(k)  # type: ignore[misc]
        if self.use_rope:
            q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        # host-tier loads landing layer by layer (layer_loads.py): this layer's pages must have
        # landed before attention reads them. A backend without a pool (training's, in
        # tools/train_tiny.py) has nothing landing.
        pool = getattr(attn, "kv_pool", None)
        if pool is not None and pool.loads.pending:
            pool.loads.wait(self.layer_idx)
        o = attn.forward(self.layer_idx, q, k, v)  # [T, Hq, D]
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))
