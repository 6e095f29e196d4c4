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

import torch
from torch import nn

from radixkv.attention.base import AttentionBackend
from radixkv.model.config import ModelConfig
from radixkv.model.linear import Linear


class CausalLM(nn.Module):
    """A causal LM over ragged batches; ``config.architecture`` selects the family's flags.

    ``forward`` mutates the KV pool behind ``attn`` (the new tokens' K/V, every layer) and
    returns fp32 logits of the rows ``logits_indices`` (all rows when None).
    """

    config: ModelConfig
    model: nn.Module  # embed_tokens, layers, norm
    lm_head: Linear

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
        max_position: int | None = None,
    ) -> torch.Tensor:
        """The decoder layers: ``[T]`` ids and positions -> hidden states ``[T, hidden]`` before
        the final norm (writes the KV pool like ``forward``)."""

    @abstractmethod
    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Trunk hidden states ``[R, hidden]`` -> fp32 logits ``[R, vocab]`` (final norm and
        LM head; each row on its own, so the rows can be taken in blocks)."""
