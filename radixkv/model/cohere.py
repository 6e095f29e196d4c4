"""The Cohere family (Command R / Aya: CohereForCausalLM; Command R7B / Command A:
Cohere2ForCausalLM) as one module with flags.

What sets it apart from the Llama family (llama.py), as transformers computes it: LayerNorm
(mean-centred, no bias, in fp32: :class:`CohereLayerNorm`) instead of RMSNorm; one norm per
layer feeding attention and the MLP in parallel (``x + attn(n) + mlp(n)``, ``n = norm(x)``);
RoPE rotating adjacent pairs of dims (``x[2i], x[2i+1]``) rather than halves, in fp32; logits
multiplied by ``logit_scale`` (kept as ``ModelConfig.logits_scaling = 1 / logit_scale``).
Command R+ normalises q and k per head with a LayerNorm whose weight differs per head
(``use_qk_norm``). Cohere 2 windows three layers of four and gives its full layers no RoPE
(``ModelConfig.nope_layers``).

Parameter names equal Hugging Face's, so LoRA and weight updates address the same modules as
in the Llama family.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from radixkv.attention.base import AttentionBackend
from radixkv.model.attention import Attention
from radixkv.model.causal_lm import CausalLM
from radixkv.model.config import ModelConfig
from radixkv.model.errors import ModelLoadError
from radixkv.model.layers import RotaryEmbedding, SwiGLU, add_residual


def cohere_config_fields(cfg: dict[str, Any], file: str, arch: str) -> dict[str, Any]:
    """Cohere's ``logit_scale`` (logits are multiplied by it) in config.json ``cfg`` as
    ``logits_scaling``, which logits are divided by (the family's ``config_fields``)."""
    scale = cfg.get("logit_scale", 0.0625)
    if isinstance(scale, bool) or not isinstance(scale, int | float) or scale <= 0:
        raise ModelLoadError(file, "logit_scale", f"must be a positive number, got {scale!r}")
    return {"logits_scaling": 1.0 / scale}


class CohereLayerNorm(nn.Module):
    """``(x - mean) / std * weight`` over the last dim, in fp32, rounded once; ``shape`` is
    the weight's (``dim``, or ``(heads, head_dim)`` for Command R+'s per-head q/k norms)."""

    def __init__(
        self, shape: int | tuple[int, ...], eps: float, *, device: Any, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(shape, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h - h.mean(-1, keepdim=True)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h).to(x.dtype)


def apply_rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [T, H, D]`` with each pair ``(x[2i], x[2i+1])`` rotated by ``cos``/``sin`` ``[T,
    D/2]`` (fp32), computed in fp32 and rounded once, as transformers' Cohere does."""
    xf = x.float()
    x1, x2 = xf[..., ::2], xf[..., 1::2]  # [T, H, D/2] each
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2).to(x.dtype)


class CohereDecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer_idx: int, *, device: Any, dtype: torch.dtype
    ) -> None:
        super().__init__()
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        # Command R+'s q/k LayerNorms have a weight per head; RoPE turns adjacent dim pairs
        self.self_attn = Attention(
            cfg, layer_idx, norm=CohereLayerNorm, qk_norm_over="heads", rope=apply_rope_pairs, **kw
        )
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, False, **kw)
        self.input_layernorm = CohereLayerNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        """The residual stream ``x`` is updated in place when autograd is off (the caller owns
        it: the embedding's output or the previous layer's)."""
        n = self.input_layernorm(x)
        return add_residual(add_residual(x, self.self_attn(n, cos, sin, attn)), self.mlp(n))


class CohereForCausalLM(CausalLM):
    """Causal LM of the Cohere family; ``config.architecture`` selects Cohere or Cohere 2."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            config, CohereDecoderLayer, CohereLayerNorm, device=device, dtype=dtype or config.dtype
        )
        self.rotary = RotaryEmbedding(config.rotary_dim, config.rope_theta, config.rope_scaling)

    def trunk(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        *,
        max_position: int,
    ) -> torch.Tensor:
        cos, sin = self.rotary.cos_sin(positions, max_position)  # [T, D]: (freqs, freqs)
        half = cos.shape[-1] // 2
        cos, sin = cos[:, :half], sin[:, :half]  # one entry per rotated pair, fp32
        h = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            h = layer(h, cos, sin, attn)
        return h

    def head(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.model.norm(h)).float()
        return logits / self.config.logits_scaling  # times logit_scale


Cohere2ForCausalLM = CohereForCausalLM
