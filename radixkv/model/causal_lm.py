"""CausalLM: what every model family gives the runner, LoRA and the loader.

A family (llama.py: Llama, Mistral, Qwen, Granite and their MoE kin; gemma.py: Gemma 1-3) is an
``nn.Module`` with Hugging Face's parameter names under ``model.embed_tokens``,
``model.layers[i].self_attn.{q,k,v,o}_proj``, ``model.layers[i].mlp`` and ``model.norm``, an
``lm_head``, and two halves of a forward: ``trunk`` (embeddings and decoder layers, which
write the KV pool through the attention backend) and ``head`` (final norm, LM head, logit
post-processing).
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch
from torch import nn

from radixkv.attention.base import AttentionBackend
from radixkv.model.config import ModelConfig
from radixkv.model.linear import Linear


class DecoderStack(nn.Module):
    """What every family keeps under ``model.``: ``embed_tokens``, ``layers`` (``layer(cfg, i,
    device=, dtype=)`` for each index) and the final ``norm`` (``norm(hidden, eps, ...)``)."""

    def __init__(
        self, cfg: ModelConfig, layer: Any, norm: Any, *, device: Any, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype
        )
        self.layers = nn.ModuleList(
            layer(cfg, i, device=device, dtype=dtype) for i in range(cfg.num_layers)
        )
        self.norm = norm(cfg.hidden_size, cfg.rms_norm_eps, device=device, dtype=dtype)


class CausalLM(nn.Module):
    """A causal LM over ragged batches; ``config.architecture`` selects the family's flags.

    ``forward`` mutates the KV pool behind ``attn`` (the new tokens' K/V, every layer) and
    returns fp32 logits of the rows ``logits_indices`` (all rows when None).
    """

    def __init__(
        self, config: ModelConfig, layer: Any, norm: Any, *, device: Any, dtype: torch.dtype
    ) -> None:
        """The family's :class:`DecoderStack` of ``layer`` modules and final ``norm``, and the
        LM head (sharing the embedding's weight when the config ties them)."""
        super().__init__()
        self.config = config
        self.model = DecoderStack(config, layer, norm, device=device, dtype=dtype)
        self.lm_head = Linear(
            config.hidden_size, config.vocab_size, bias=False, device=device, dtype=dtype
        )
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        logits_indices: torch.Tensor | None = None,
        *,
        max_position: int | None = None,
    ) -> torch.Tensor:
        """``input_ids, positions [T]`` int64 -> fp32 logits ``[len(logits_indices) or T, vocab]``.

        ``max_position`` (the largest entry of ``positions``) lets the caller skip a device sync.
        """
        if max_position is None:
            max_position = int(positions.max())
        h = self.trunk(input_ids, positions, attn, max_position=max_position)
        if logits_indices is not None:
            h = h.index_select(0, logits_indices)
        return self.head(h)

    @abstractmethod
    def trunk(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        *,
        max_position: int,
    ) -> torch.Tensor:
        """The decoder layers: ``[T]`` ids and positions -> hidden states ``[T, hidden]`` before
        the final norm (writes the KV pool like ``forward``); ``max_position`` is the largest
        entry of ``positions`` (it bounds the RoPE tables without a device sync)."""

    @abstractmethod
    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Trunk hidden states ``[R, hidden]`` -> fp32 logits ``[R, vocab]`` (final norm and
        LM head; each row on its own, so the rows can be taken in blocks)."""
