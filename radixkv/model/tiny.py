"""radixkv-tiny: an embedded Llama-architecture model, trained here on Python's own source.

No download: the weights ship inside the package (``weights/radixkv-tiny.safetensors``, fp16
storage, served in fp32), the tokenizer is byte-level, and a small chat template is built in. The
weights were trained from scratch on the CPU by ``tools/train_tiny.py`` on the CPython 3.11
standard library's source (PSF license; see that script for the corpus, its hash and the held-out
split), so the model continues Python code and docstrings: give it a function signature or the
start of a class and it writes Python-shaped text (not working code; held-out 1.86 bits/byte,
see docs/tiny_model.md). It was trained on 512-byte windows: keep prompt + output under ~500
tokens, past that it writes garbage. Greedy decoding falls into loops; sample. It exists so that the engine, the
cache, the benchmarks and the notebooks have a real model whose outputs can be read. Sized so a
4,000-token prefill takes a fraction of a second on 2 CPU cores.

``radixkv-tiny-random`` is the same shape with seeded random weights drawn on the fly (no file;
its output head only speaks printable ASCII). Tests that want weights independent of the shipped
file use it; its text is noise.

Proportions: a scale model of a production LLM, not just a small one. What the prefix cache
saves depends on how a token's cost splits between the linear layers (fixed per token) and
attention (growing with the context). Per layer, linear multiply-adds per token divided by
attention multiply-adds per (query, key) pair (``attention_cost_ratio`` in
engine/prefill_cost.py) is 26,624 for Llama-3-8B, 32,512 for Qwen2.5-7B and 52,224 for
Llama-3-70B; here it is 37,888 (hidden 512, SwiGLU 3072, one 64-dim attention head). A "small"
model with the usual shape (hidden 256, 4 heads, MLP 768) has 1,536: at 4k context its attention
would cost 3x its linear layers, about 20x the share attention has in those models, and every
cache and scheduling measurement would be about attention kernels rather than the workloads
the cache is for. The output head (264 x 512, run on sampled rows only) adds 1.4% to a
decoded token's linear work. Two layers keep it fast; head_dim 64 is a size FlashInfer compiles
for. GQA is exercised by the Hugging Face test models, not by this one.
"""

from __future__ import annotations

import json
import math
from functools import cache
from pathlib import Path
from typing import Any

import torch

from radixkv.model.config import ModelConfig
from radixkv.model.llama import LlamaForCausalLM
from radixkv.model.tokenizer import ByteTokenizer

TINY_NAME = "radixkv-tiny"
TINY_RANDOM_NAME = "radixkv-tiny-random"
TINY_NAMES = (TINY_NAME, TINY_RANDOM_NAME)
TINY_WEIGHTS = Path(__file__).with_name("weights") / "radixkv-tiny.safetensors"
TINY_SEED = 20240607
PRINTABLE = [10, *range(32, 127)]  # the bytes the output head can produce: newline and ASCII
LOGIT_STD = 3.0  # spread of the printable logits: temperature 1 samples vary, greedy is stable

SPECIAL_TOKENS = (
    "<|bos|>",
    "<|eos|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
    "<|reserved_0|>",
    "<|reserved_1|>",
)

TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unsupported role: ' + message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tiny_config(dtype: torch.dtype = torch.float32) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=256 + len(SPECIAL_TOKENS),
        hidden_size=512,
        intermediate_size=3072,  # 6x hidden, SwiGLU: linear/attention ratio of a 7-70B model
        num_layers=2,
        num_heads=1,  # one 64-dim head: attention's share of FLOPs as in an 8B model at 4k
        num_kv_heads=1,
        head_dim=64,
        max_position_embeddings=16384,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=False,  # trained untied; the random model's head speaks ASCII
        dtype=dtype,
        bos_token_id=256,
        eos_token_ids=(257, 261),
    )


def tiny_tokenizer() -> ByteTokenizer:
    return ByteTokenizer(
        SPECIAL_TOKENS,
        eos_tokens=("<|eos|>", "<|end|>"),
        bos_token="<|bos|>",
        chat_template=TINY_CHAT_TEMPLATE,
    )


@cache
def _trained_state() -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not TINY_WEIGHTS.is_file():
        raise FileNotFoundError(
            f"{TINY_NAME}: the packaged weights {TINY_WEIGHTS} are missing (reinstall radixkv, "
            f"or rebuild them with tools/train_tiny.py); {TINY_RANDOM_NAME!r} needs no file"
        )
    return load_file(str(TINY_WEIGHTS))


def tiny_training_summary() -> dict[str, Any]:
    """How the shipped weights were trained: corpus, its hash, steps, held-out loss."""
    from safetensors import safe_open

    with safe_open(str(TINY_WEIGHTS), framework="pt") as f:
        return json.loads((f.metadata() or {}).get("radixkv", "{}"))


@torch.no_grad()
def build_tiny_model(
    device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> LlamaForCausalLM:
    """The trained tiny model (the packaged weights), on ``device`` in ``dtype``."""
    cfg = tiny_config(dtype)
    model = LlamaForCausalLM(cfg, device="cpu", dtype=torch.float32)
    model.load_state_dict({k: v.float() for k, v in _trained_state().items()}, strict=True)
    model.eval()
    return model.to(device=torch.device(device), dtype=dtype)


@torch.no_grad()
def build_tiny_random_model(
    device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> LlamaForCausalLM:
    """radixkv-tiny-random: the tiny shape with seeded random weights, on ``device`` in ``dtype``."""
    cfg = tiny_config(dtype)
    model = LlamaForCausalLM(cfg, device="cpu", dtype=torch.float32)
    gen = torch.Generator().manual_seed(TINY_SEED)
    for name, param in sorted(model.named_parameters()):
        if name.endswith("norm.weight"):
            param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
        elif name.endswith("embed_tokens.weight"):
            param.copy_(torch.randn(param.shape, generator=gen))
        elif name == "lm_head.weight":
            param.copy_(
                LOGIT_STD * torch.randn(param.shape, generator=gen) / math.sqrt(cfg.hidden_size)
            )
            # Only printable ASCII can win: every other byte and the special tokens get logit 0,
            # far below the best of ~95 printable logits (std LOGIT_STD). A random model's text
            # is meaningless either way, but this way samples differ from each other and print
            # as text. (With tied embeddings a random model mostly repeats its input token.)
            keep = torch.zeros(cfg.vocab_size, dtype=torch.bool)
            keep[PRINTABLE] = True
            param[~keep] = 0.0
        else:  # linear weights: unit-variance outputs for unit-variance inputs
            param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(param.shape[-1]))
    model.eval()
    return model.to(device=torch.device(device), dtype=dtype)
