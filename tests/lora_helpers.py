"""Helpers for the LoRA tests: PEFT adapters of the small test Llama, saved as PEFT saves them.

PEFT (on transformers) is the reference: an adapter is made with ``get_peft_model`` on a copy of
the base model, given random factors large enough to change greedy outputs, and saved with
``save_pretrained``; the same PEFT model then computes the reference logits and greedy tokens.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import torch

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL = [*ATTN, "gate_proj", "up_proj", "down_proj"]


@torch.no_grad()
def make_peft_adapter(
    base: Any,
    folder: Path,
    *,
    seed: int,
    r: int = 8,
    alpha: float = 16,
    target_modules: list[str] = ALL,
    use_rslora: bool = False,
    **extra: Any,
) -> Any:
    """Save a random PEFT LoRA adapter of ``base`` (a transformers model, not changed) to
    ``folder``; returns the PEFT model (the reference), in eval mode."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=target_modules,
        lora_dropout=0.0,
        use_rslora=use_rslora,
        init_lora_weights=False,
        **extra,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(copy.deepcopy(base), cfg)
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_" in name:  # A: [r, in], B: [out, r]; deltas about as large as the weights'
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
    folder.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(folder)
    return model.eval()


@torch.no_grad()
def peft_logits(model: Any, ids: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def peft_greedy(model: Any, ids: list[int], max_new_tokens: int, eos: int) -> list[int]:
    """Greedy continuation, step by step with full forwards (PEFT's generate wraps HF's)."""
    out = list(ids)
    for _ in range(max_new_tokens):
        tok = int(peft_logits(model, out)[-1].argmax())
        out.append(tok)
        if tok == eos:
            break
    return out[len(ids) :]


@torch.no_grad()
def radixkv_adapter_logits(lm: Any, adapter: Any, ids: list[int]) -> torch.Tensor:
    """fp32 logits of every position of ``ids`` through the loaded model ``lm`` (a
    ``LoadedModel``) with the LoRA ``adapter`` (a ``LoRAAdapter``) in one prefill, torch
    backend, page size 4."""
    from radixkv.kv.kv_pool import KVPool
    from radixkv.model.runner import ModelRunner, SeqInput

    c = lm.config
    pool = KVPool(
        c.num_layers, -(-len(ids) // 4) + 1, 4, c.num_kv_heads, c.head_dim, c.dtype, "cpu"
    )
    runner = ModelRunner(lm.model, pool, backend="torch")
    slot = runner.loras.add(adapter)
    try:
        table = list(range(pool.num_pages))
        return runner.forward([SeqInput(ids, table, 0, slot)], all_logits=True)
    finally:
        runner.loras.remove(slot)  # the set is the model's: leave it as found
