"""The Llama family (Llama, Mistral, Ministral, Qwen2, Qwen3, Granite, Phi-3, SmolLM3, and the
mixture-of-experts Mixtral, Qwen2-MoE, Qwen3-MoE and GraniteMoE) as one module with flags.

Tokens are ragged: the model sees ``input_ids [T]`` and ``positions [T]`` of all sequences of a
step concatenated; attention (the only place where sequences matter) is delegated to an
:class:`~radixkv.attention.base.AttentionBackend` that was planned for that layout.
Parameter names equal Hugging Face's, so a checkpoint's state dict loads as is (Phi-3's fused
``qkv_proj`` and ``gate_up_proj`` are split into these modules by the loader).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from radixkv.attention.base import AttentionBackend
from radixkv.model.attention import Attention
from radixkv.model.causal_lm import CausalLM
from radixkv.model.config import ModelConfig
from radixkv.model.layers import RMSNorm, RotaryEmbedding, SwiGLU, add_residual
from radixkv.model.moe import SparseMoE


class DecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer_idx: int, *, device: Any, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx, device=device, dtype=dtype)
        self.residual_multiplier = cfg.residual_multiplier  # Granite's; 1.0 elsewhere
        # the feed-forward block, under the checkpoint's name: "mlp", or Mixtral's experts
        # "block_sparse_moe"
        self.ffn_name = "mlp"
        if cfg.moe is not None and cfg.moe.is_sparse(layer_idx):
            if cfg.moe.style != "qwen":  # Mixtral's and GraniteMoE's name
                self.ffn_name = "block_sparse_moe"
            self.add_module(self.ffn_name, SparseMoE(cfg, device=device, dtype=dtype))
        else:
            self.mlp = SwiGLU(
                cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, device=device, dtype=dtype
            )
        self.input_layernorm = RMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, device=device, dtype=dtype
        )
        self.post_attention_layernorm = RMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, device=device, dtype=dtype
        )

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        """The residual stream ``x`` is updated in place when autograd is off (the caller owns
        it: the embedding's output or the previous layer's)."""
        ffn = self.mlp if self.ffn_name == "mlp" else self.block_sparse_moe
        m = self.residual_multiplier
        x = add_residual(x, self.self_attn(self.input_layernorm(x), cos, sin, attn), m)
        return add_residual(x, ffn(self.post_attention_layernorm(x)), m)


class LlamaForCausalLM(CausalLM):
    """Causal LM of the whole family; ``config.architecture`` only selects flags."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(config, DecoderLayer, RMSNorm, device=device, dtype=dtype or config.dtype)
        self.rotary = RotaryEmbedding(config.rotary_dim, config.rope_theta, config.rope_scaling)

    def trunk(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        *,
        max_position: int,
    ) -> torch.Tensor:
        cos, sin = self.rotary.cos_sin(positions, max_position)
        h = self.model.embed_tokens(input_ids)
        if self.config.embedding_multiplier != 1.0:  # Granite
            h = h * self.config.embedding_multiplier
        # cast once for all layers (apply_rope casts to the activations' dtype, as HF does)
        cos, sin = cos.to(h.dtype), sin.to(h.dtype)
        for layer in self.model.layers:
            h = layer(h, cos, sin, attn)
        return h

    def head(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.model.norm(h)).float()
        if self.config.logits_scaling != 1.0:  # Granite
            logits /= self.config.logits_scaling
        return logits


# HF class names, all the same implementation.
MistralForCausalLM = LlamaForCausalLM
Phi3ForCausalLM = LlamaForCausalLM
MinistralForCausalLM = LlamaForCausalLM
SmolLM3ForCausalLM = LlamaForCausalLM
Qwen2ForCausalLM = LlamaForCausalLM
Qwen3ForCausalLM = LlamaForCausalLM
GraniteForCausalLM = LlamaForCausalLM
MixtralForCausalLM = LlamaForCausalLM
GraniteMoeForCausalLM = LlamaForCausalLM
Qwen2MoeForCausalLM = LlamaForCausalLM
Qwen3MoeForCausalLM = LlamaForCausalLM
