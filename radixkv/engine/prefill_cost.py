"""Prefill budget in token-equivalents: new tokens plus their attention to past tokens.

A chunk of ``n`` new tokens on ``p`` already computed tokens costs about
``n + (n * p + n * n / 2) / R`` token-equivalents, where ``R`` is the linear layers' multiply-adds
per token divided by attention's multiply-adds per (query, key) pair. Counting only ``n`` (the
"tokens" budget) lets one step take thousands of new tokens that each attend to a long cached
prefix, which costs several times the budget's worth of compute and delays every first token
in that step; counting attention too splits such a step, so early requests finish sooner.
"""

from __future__ import annotations

import math

from radixkv.model.config import ModelConfig


def attention_cost_ratio(model_config: ModelConfig) -> float:
    """``R`` = linear multiply-adds per token / attention multiply-adds per (query, key) pair.

    Per layer: q and o projections ``hidden * heads * head_dim`` each, k and v
    ``hidden * kv_heads * head_dim`` each, a gated MLP ``3 * hidden * intermediate`` (a
    mixture-of-experts layer: the width of the experts a token runs through); attention
    does ``heads * head_dim`` for QK^T and again for PV per pair. Embedding and LM head are
    left out (the head runs on sampled rows only). radixkv-tiny: 37,888; Llama-3-8B: 26,624;
    Llama-3-70B: 52,224.
    """
    h = model_config.hidden_size
    q = model_config.num_heads * model_config.head_dim
    kv = model_config.num_kv_heads * model_config.head_dim
    linear = 2 * h * q + 2 * h * kv + 3 * h * model_config.active_intermediate_size
    return linear / (2 * q)


def weights_per_active(model_config: ModelConfig) -> float:
    """Linear-layer weights a layer stores over those a token runs through (1.0 for a dense
    model; a mixture-of-experts layer stores every expert and runs ``top_k`` of them).

    A step's fixed cost grows with it: a step of a few tokens reads the weights of every expert
    they reach, and multiplies each expert's few rows far below the matmul peak, so admitting
    prefills in larger groups pays more than for a dense model (the engine scales the
    scheduler's ``step_overhead_tokens`` by it)."""
    if model_config.moe is None:
        return 1.0
    h = model_config.hidden_size
    q = model_config.num_heads * model_config.head_dim
    kv = model_config.num_kv_heads * model_config.head_dim
    attn = 2 * h * q + 2 * h * kv
    stored = attn + 3 * h * model_config.stored_intermediate_size
    return stored / (attn + 3 * h * model_config.active_intermediate_size)


def chunk_cost(n: int, past: int, ratio: float | None) -> float:
    """Token-equivalents of computing ``n`` new tokens after ``past`` computed ones
    (``ratio`` None: the plain token count)."""
    if ratio is None:
        return float(n)
    return n + (n * past + n * n / 2) / ratio


def max_chunk(budget: float, past: int, ratio: float | None) -> int:
    """Largest ``n >= 0`` with ``chunk_cost(n, past, ratio) <= budget``."""
    if budget <= 0:
        return 0
    if ratio is None:
        return int(budget)
    # n^2 / (2R) + n (1 + p/R) - budget = 0, positive root
    a = 1 / (2 * ratio)
    b = 1 + past / ratio
    n = int((-b + math.sqrt(b * b + 4 * a * budget)) / (2 * a))
    while n > 0 and chunk_cost(n, past, ratio) > budget:  # float rounding
        n -= 1
    return n
