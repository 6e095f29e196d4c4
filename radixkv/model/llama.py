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
from radixkv.model.causal_lm import CausalLM
from radixkv.model.config import ModelConfig
from radixkv.model.layers import RMSNorm, RotaryEmbedding, SwiGLU, apply_rope
from radixkv.model.linear import Linear
from radixkv.model.moe import SparseMoE


class Attention(nn.Module):
    """q/k/v projections, optional per-head q/k norms (``norm``: the family's RMSNorm), RoPE,
    the backend's paged attention, the output projection."""

    def __init__(
        self,
        cfg: ModelConfig,
        layer_idx: int,
        *,
        device: Any,
        dtype: torch.dtype,
        norm: type[nn.Module] = RMSNorm,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.use_rope = layer_idx not in cfg.nope_layers  # SmolLM3's NoPE layers: no RoPE
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, q_out, bias=cfg.qkv_bias, **kw)
        self.k_proj = Linear(cfg.hidden_size, kv_out, bias=cfg.qkv_bias, **kw)
        self.v_proj = Linear(cfg.hidden_size, kv_out, bias=cfg.qkv_bias, **kw)
        self.o_proj = Linear(q_out, cfg.hidden_size, bias=cfg.o_bias, **kw)
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if cfg.qk_norm:  # Qwen3, Gemma 3: per-head RMSNorm of q and k before RoPE
            self.q_norm = norm(cfg.head_dim, cfg.rms_norm_eps, device=device, dtype=dtype)
            self.k_norm = norm(cfg.head_dim, cfg.rms_norm_eps, device=device, dtype=dtype)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = attn.forward(self.layer_idx, q, k, v)  # [T, Hq, D]
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


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
        if torch.is_grad_enabled():
            x = x + m * self.self_attn(self.input_layernorm(x), cos, sin, attn)
            return x + m * ffn(self.post_attention_layernorm(x))
        x.add_(self.self_attn(self.input_layernorm(x), cos, sin, attn), alpha=m)
        return x.add_(ffn(self.post_attention_layernorm(x)), alpha=m)


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
        max_position: int | None = None,
    ) -> torch.Tensor:
        if max_position is None:
            max_position = int(positions.max())
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
