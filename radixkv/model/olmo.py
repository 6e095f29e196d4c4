"""The OLMo family (OLMo 2, OLMo 3) as one module with flags.

What sets it apart from the Llama family (llama.py), as transformers computes it: each decoder
layer norms its sublayers' outputs before the residual add instead of their inputs
(``post_attention_layernorm`` after attention, ``post_feedforward_layernorm`` after the MLP;
there is no input norm); q and k are RMS-normed over the whole projection (all heads at once)
before RoPE; and RMSNorm multiplies its weight in fp32 before rounding (:class:`OlmoRMSNorm`).
OLMo 3 adds sliding windows on three layers of four (config.layer_windows), whose RoPE is
unscaled (``local_rope_theta``) where the full layers' is YaRN-scaled.

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
from radixkv.model.layers import LayerTypeRope, OlmoRMSNorm, SwiGLU, add_residual

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin [T, rotary_dim]


class OlmoDecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer_idx: int, *, device: Any, dtype: torch.dtype
    ) -> None:
        super().__init__()
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        # q/k normed over the whole projection, with OLMo's RMSNorm
        self.self_attn = Attention(
            cfg, layer_idx, norm=OlmoRMSNorm, qk_norm_over="projection", **kw
        )
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, **kw)
        self.post_attention_layernorm = OlmoRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.post_feedforward_layernorm = OlmoRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        # which RoPE table this layer reads (OLMo 3's sliding layers have their own)
        self.local = bool(cfg.layer_types) and cfg.layer_types[layer_idx] == "sliding_attention"

    def forward(self, x: torch.Tensor, rope: Rope, attn: AttentionBackend) -> torch.Tensor:
        """The residual stream ``x`` is updated in place when autograd is off (the caller owns
        it: the embedding's output or the previous layer's)."""
        x = add_residual(x, self.post_attention_layernorm(self.self_attn(x, *rope, attn)))
        return add_residual(x, self.post_feedforward_layernorm(self.mlp(x)))


class OlmoForCausalLM(CausalLM):
    """Causal LM of the OLMo family; ``config.architecture`` selects OLMo 2 or 3."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            config, OlmoDecoderLayer, OlmoRMSNorm, device=device, dtype=dtype or config.dtype
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
        rope, local = self.rotary.tables(positions, max_position, h.dtype)
        for layer in self.model.layers:
            h = layer(h, local if layer.local else rope, attn)
        return h

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(h)).float()


Olmo2ForCausalLM = OlmoForCausalLM
Olmo3ForCausalLM = OlmoForCausalLM
