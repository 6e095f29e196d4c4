"""The Gemma family (Gemma, Gemma 2, Gemma 3's text model) as one module with flags.

What sets it apart from the Llama family (llama.py), as transformers computes it: RMSNorm
scales by ``1 + weight`` in fp32 (:class:`GemmaRMSNorm`); the MLP gates with a tanh GELU;
embeddings are multiplied by ``sqrt(hidden_size)`` rounded to the model's dtype. From Gemma 2
on, each sublayer's output is normed again before its residual add ("sandwich" norms:
``post_attention_layernorm`` after attention, ``pre_``/``post_feedforward_layernorm`` around
the MLP), attention scores are scaled by ``query_pre_attn_scalar ** -0.5`` and layers
alternate between a sliding window and full attention (config.layer_windows). Gemma 2 also
soft-caps attention scores and final logits (``cap * tanh(x / cap)``); Gemma 3 normalises q
and k per head, and its sliding layers use their own unscaled RoPE base
(``local_rope_theta``).

Parameter names equal Hugging Face's (``model.layers.N.self_attn.q_proj``, ...), so LoRA and
weight updates address the same modules as in the Llama family.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from radixkv.attention.base import AttentionBackend
from radixkv.model.attention import Attention
from radixkv.model.causal_lm import CausalLM
from radixkv.model.config import ModelConfig
from radixkv.model.errors import ModelLoadError
from radixkv.model.layers import GemmaRMSNorm, LayerTypeRope, SwiGLU, add_residual

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin [T, head_dim]


@functools.cache
def _embed_scale(hidden_size: int, dtype: torch.dtype) -> float:
    """sqrt(hidden) rounded to ``dtype`` first, as transformers multiplies (a Python float that
    ``dtype`` holds exactly, so the product rounds the same as with its 0-dim tensor)."""
    return float(torch.tensor(hidden_size**0.5, dtype=torch.float64).to(dtype))


def gemma_config_fields(cfg: dict[str, Any], file: str, arch: str) -> dict[str, Any]:
    """Gemma's attention scale (``query_pre_attn_scalar ** -0.5`` from Gemma 2 on) and soft
    caps in config.json ``cfg``, as ModelConfig fields (the family's ``config_fields``)."""
    out: dict[str, Any] = {}
    if arch == "GemmaForCausalLM":
        return out
    names = ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping")
    for name in names:
        value = cfg.get(name)
        if name == "query_pre_attn_scalar" and value is None:
            value = 256  # transformers' default
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ModelLoadError(file, name, f"must be a positive number, got {value!r}")
        if name == "query_pre_attn_scalar":
            out["attention_multiplier"] = float(value) ** -0.5
        else:
            out[name] = float(value)
    return out


class GemmaDecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer_idx: int, *, device: Any, dtype: torch.dtype
    ) -> None:
        super().__init__()
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.self_attn = Attention(cfg, layer_idx, norm=GemmaRMSNorm, **kw)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, False, act=cfg.hidden_act, **kw)
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps, **kw)
        # Gemma 1: the norm before the MLP (Llama's place); from Gemma 2 on: after attention
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, **kw)
        self.sandwich = cfg.architecture != "GemmaForCausalLM"
        if self.sandwich:
            self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, **kw)
            self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, **kw)
        # which RoPE table this layer reads (Gemma 3's sliding layers have their own)
        self.local = bool(cfg.layer_types) and cfg.layer_types[layer_idx] == "sliding_attention"

    def forward(self, x: torch.Tensor, rope: Rope, attn: AttentionBackend) -> torch.Tensor:
        """The residual stream ``x`` is updated in place when autograd is off (the caller owns
        it: the embedding's output or the previous layer's)."""
        cos, sin = rope
        a = self.self_attn(self.input_layernorm(x), cos, sin, attn)
        if not self.sandwich:
            x = add_residual(x, a)
            return add_residual(x, self.mlp(self.post_attention_layernorm(x)))
        x = add_residual(x, self.post_attention_layernorm(a))
        m = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return add_residual(x, m)


class GemmaForCausalLM(CausalLM):
    """Causal LM of the Gemma family; ``config.architecture`` selects Gemma 1, 2 or 3."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            config, GemmaDecoderLayer, GemmaRMSNorm, device=device, dtype=dtype or config.dtype
        )
        self.rotary = LayerTypeRope(
            config.rotary_dim, config.rope_theta, config.rope_scaling, config.local_rope_theta
        )

    def trunk(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        *,
        max_position: int,
    ) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        h = h * _embed_scale(self.config.hidden_size, h.dtype)
        rope, local = self.rotary.tables(positions, max_position, h.dtype)
        for layer in self.model.layers:
            h = layer(h, local if layer.local else rope, attn)
        return h

    def head(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.model.norm(h)).float()
        cap = self.config.final_logit_softcapping
        if cap is not None:  # Gemma 2
            logits = torch.tanh(logits / cap) * cap
        return logits


Gemma2ForCausalLM = GemmaForCausalLM
Gemma3ForCausalLM = GemmaForCausalLM
