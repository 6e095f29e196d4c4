"""SparseMoE: the mixture-of-experts feed-forward block of Mixtral, Qwen2-MoE, Qwen3-MoE and
GraniteMoE.

A router (``gate``, a bias-free linear layer) scores the experts for every token; each token
goes to its ``top_k`` most probable experts (softmax in fp32, as Hugging Face computes it) and
gets their SwiGLU outputs summed, weighted by those probabilities (renormalized to sum to 1
when the config says so). Qwen2-MoE adds a shared expert every token runs through, scaled by a
sigmoid gate.

Tokens are grouped by expert, so each expert multiplies all of its tokens of the step in one
matmul and experts no token chose cost nothing; outputs are accumulated expert by expert in
ascending order, the order transformers adds them in, so fp32 logits agree with it as for the
dense models. Parameter names are the checkpoints' (``experts.N.gate_proj`` or Mixtral's
``experts.N.w1``), so a Hugging Face state dict loads as is.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from radixkv.model.config import ModelConfig
from radixkv.model.layers import SwiGLU, swiglu
from radixkv.model.linear import Linear

__all__ = ["MixtralExpert", "SparseMoE"]


class MixtralExpert(nn.Module):
    """One Mixtral expert, ``w2(silu(w1(x)) * w3(x))``: SwiGLU under Mixtral's weight names."""

    def __init__(self, hidden: int, intermediate: int, *, device: Any, dtype: torch.dtype) -> None:
        super().__init__()
        kw: dict[str, Any] = {"bias": False, "device": device, "dtype": dtype}
        self.w1 = Linear(hidden, intermediate, **kw)  # gate
        self.w3 = Linear(hidden, intermediate, **kw)  # up
        self.w2 = Linear(intermediate, hidden, **kw)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x, self.w1, self.w3, self.w2)


class SparseMoE(nn.Module):
    """``x [T, hidden]`` -> ``[T, hidden]``: the routed experts' weighted sum (module docstring).

    Mixtral multiplies expert outputs by the fp32 routing weights and rounds the product once;
    the Qwen models and GraniteMoE round the weights to the activations' dtype first. Both as
    transformers does, which matters only in bf16/fp16. (GraniteMoE's softmax over the top-k
    logits equals the renormalized top-k of the full softmax.)"""

    def __init__(self, cfg: ModelConfig, *, device: Any, dtype: torch.dtype) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None
        self.top_k = moe.top_k
        self.norm_topk_prob = moe.norm_topk_prob
        self.fp32_weights = moe.style == "mixtral"
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        h = cfg.hidden_size
        self.gate = Linear(h, moe.num_experts, bias=False, **kw)  # the router
        experts: list[nn.Module]
        if moe.style != "qwen":
            experts = [MixtralExpert(h, moe.expert_size, **kw) for _ in range(moe.num_experts)]
        else:
            experts = [SwiGLU(h, moe.expert_size, False, **kw) for _ in range(moe.num_experts)]
        self.experts = nn.ModuleList(experts)
        self.shared_expert: SwiGLU | None = None
        self.shared_expert_gate: Linear | None = None
        if moe.shared_expert_size:
            self.shared_expert = SwiGLU(h, moe.shared_expert_size, False, **kw)
            self.shared_expert_gate = Linear(h, 1, bias=False, **kw)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing of ``x [T, hidden]``: expert ids ``[T, top_k]`` (most probable first) and
        their weights ``[T, top_k]`` (fp32 for Mixtral, else ``x``'s dtype)."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # [T, E]
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.fp32_weights:
            weights = weights.to(x.dtype)
        return experts, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        k = self.top_k
        flat = experts.reshape(-1)  # [T * k]: (token, slot) pairs, token-major
        # pairs grouped by expert, one host sync for the group sizes
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        tokens = order.div(k, rounding_mode="floor")  # [T * k] token of each grouped pair
        pair_weights = weights.reshape(-1).index_select(0, order).unsqueeze(1)  # [T * k, 1]
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            rows = tokens[start : start + n]
            y = self.experts[e](x.index_select(0, rows)) * pair_weights[start : start + n]
            out.index_add_(0, rows, y.to(out.dtype))
            start += n
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            shared = self.shared_expert(x).mul_(torch.sigmoid(self.shared_expert_gate(x)))
            out.add_(shared)
        return out
